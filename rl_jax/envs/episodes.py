"""Whole episodes on a generator with the tool called inline (held-out evaluation).

`run_episodes` adds one single-sample group per prompt with the environment's turn end,
steps the generator until every episode has ended, and answers each tool call at once
in the calling thread (env.tool without the pool's injected latency or failures: an
evaluation measures the policy, not the tool). A tool that raises gives the error
observation, as in training. The generator is used through its public interface only
(rl_jax.sampler.generator.Generator: add_group with turn_end, step, take_turns, resume,
end_episode), so nothing here imports sampler code.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from rl_jax.envs.base import End, make_turn_end

# Group ids of evaluation episodes: far below Generator.generate's own (-1, -2, ...).
_FIRST_GROUP_ID = -(10**9)


@dataclasses.dataclass
class EpisodeResult:
  """One finished episode: its rollout and what its episode counted."""
  rollout: Any  # rl_jax.types.Rollout
  tool_calls: int
  tool_failures: int


def run_episodes(generator, env, tokenizer, examples: Sequence, prompts: Sequence, *,
                 max_new_tokens: int, sampling=None, seed: int = 0) -> list[EpisodeResult]:
  """Episodes of examples[k] from prompts[k] (token ids), in order."""
  turn_end = make_turn_end(tokenizer, env.stop_strings)
  gids = [_FIRST_GROUP_ID - k for k in range(len(prompts))]
  episodes, attempts = {}, {}
  for k, (gid, prompt) in enumerate(zip(gids, prompts)):
    generator.add_group(gid, np.asarray(prompt, np.int32), 1, seed + k, sampling=sampling,
                        max_new_tokens=max_new_tokens, turn_end=turn_end)
    episodes[gid], attempts[gid] = env.start(examples[k]), None
  done: dict[int, Any] = {}
  while len(done) < len(gids):
    for r in generator.step():
      if r.group_id in episodes:
        done[r.group_id] = r
    for turn in generator.take_turns():
      gid = turn.group_id
      if attempts[gid] is not None and attempts[gid] != turn.attempt:
        episodes[gid] = env.start(examples[gids.index(gid)])  # restarted from its prompt
      attempts[gid] = turn.attempt
      episode = episodes[gid]
      action = episode.step(tokenizer.decode(turn.tokens), turn_index=turn.turn_index)
      if isinstance(action, End):
        r = generator.end_episode(gid, turn.sample_index, turn.attempt, action.reason)
        if r is not None:
          done[gid] = r
        continue
      try:
        value = env.tool(action.request)
      except Exception:  # noqa: BLE001  (a bad request: the error observation)
        value = None
      obs = tokenizer.encode(episode.observe(value))
      generator.resume(gid, turn.sample_index, turn.attempt, np.asarray(obs, np.int32))
  return [EpisodeResult(rollout=done[g], tool_calls=episodes[g].tool_calls,
                        tool_failures=episodes[g].tool_failures) for g in gids]

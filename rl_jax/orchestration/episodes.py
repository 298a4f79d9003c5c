"""Tool-using episodes in the RL sampler: the environment's side of the sampler thread.

For a task with an environment (rl_jax.envs), every sample of an admitted group is an
episode. The SamplerWorker (rl_jax/orchestration/sampler_worker.py) calls, on its thread:

  group_kwargs()    add_group's turn_end (the environment's stop strings) and episode
                    budget (env.max_total_tokens, 0 = sampler.max_new_tokens)
  drain(gen)        before each Generator.step: tool results that arrived since the last
                    step resume their parked sequences (Generator.resume with the
                    observation's tokens) — so the observation is in the KV cache before
                    the next decode call
  after_step(gen)   after each Generator.step: turns that ended in a tool call
                    (Generator.take_turns) become tool calls on the tool pool, or end
                    their episode (Generator.end_episode, e.g. at env.max_turns); the
                    rollouts ended that way are returned
  finished(r)       a rollout finished (any way): its episode is forgotten; the number of
                    tool calls it made

Tool results arrive on pool threads and go through a thread-safe inbox; nothing else
here is touched by another thread. A result is dropped (counted, env/late_results) when
its episode is gone or has moved on: the group finished or was aborted, or the generator
restarted the episode from its prompt after a preemption (a new `attempt`; the new
attempt's first turn starts a fresh episode). Generator methods other than
update_params belong to the sampler thread, which is why results are not applied from
the pool's callback directly.

Tool failures and timeouts give the model the environment's error observation
(rl_jax/envs/base.py) and are counted by RunAccounting.tool_result.

`ToolUse` is what such a task adds to the Pipeline (rl_jax/orchestration/loop.py): the
tool pool, the driver, and the held-out tool-call rate of each evaluation.
"""
from __future__ import annotations

import dataclasses
import queue
from typing import Any

import numpy as np

from rl_jax.envs import End, make_turn_end


@dataclasses.dataclass
class _Live:
  attempt: int
  turn: int  # the turn whose tool call is outstanding (-1: none)
  episode: Any  # rl_jax.envs.Episode


class EpisodeDriver:
  """Runs one environment's episodes for the sampler thread (module docstring)."""

  def __init__(self, *, env, pool, tokenizer, accounting, budget: int):
    self.env, self.pool, self.tokenizer, self.acc = env, pool, tokenizer, accounting
    self.budget = int(budget)
    self._turn_end = make_turn_end(tokenizer, env.stop_strings)
    self._examples: dict[int, Any] = {}  # group id -> example, while any episode runs
    self._samples: dict[int, int] = {}  # group id -> samples not yet finished
    self._live: dict[tuple[int, int], _Live] = {}
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()

  def group_kwargs(self) -> dict:
    return {"max_new_tokens": self.budget, "turn_end": self._turn_end}

  def add_group(self, gid: int, example, num_samples: int) -> None:
    self._examples[gid], self._samples[gid] = example, int(num_samples)

  def _on_result(self, key, result) -> None:  # a pool thread
    self._inbox.put((key, result))

  def drain(self, gen) -> None:
    """Applies the tool results that arrived (an observation that fills the episode
    budget ends its episode: a rollout from the generator's next step)."""
    while True:
      try:
        (gid, idx, attempt, turn), result = self._inbox.get_nowait()
      except queue.Empty:
        return
      self.acc.tool_result(result)
      live = self._live.get((gid, idx))
      if live is None or live.attempt != attempt or live.turn != turn:
        self.acc.count("tool_results_dropped")
        continue
      live.turn = -1
      text = live.episode.observe(result.value)
      gen.resume(gid, idx, attempt, np.asarray(self.tokenizer.encode(text), np.int32))

  def after_step(self, gen) -> list:
    """Tool calls (or episode ends) for the turns the last step parked."""
    ended = []
    for turn in gen.take_turns():
      key = (turn.group_id, turn.sample_index)
      live = self._live.get(key)
      if live is None or live.attempt != turn.attempt:
        # The first turn, or the episode restarted from its prompt (preemption).
        live = self._live[key] = _Live(attempt=turn.attempt, turn=-1,
                                       episode=self.env.start(self._examples[turn.group_id]))
      action = live.episode.step(self.tokenizer.decode(turn.tokens), turn_index=turn.turn_index)
      if isinstance(action, End):
        self.acc.count(f"episodes_ended_{action.why or action.reason}")
        r = gen.end_episode(turn.group_id, turn.sample_index, turn.attempt, action.reason)
        if r is not None:
          ended.append(r)
        continue
      live.turn = turn.turn_index
      self.pool.submit((turn.group_id, turn.sample_index, turn.attempt, turn.turn_index),
                       action.request, callback=self._on_result)
    return ended

  def finished(self, r) -> int:
    """Forgets a finished rollout's episode; the tool calls the episode made."""
    live = self._live.pop((r.group_id, r.sample_index), None)
    left = self._samples.get(r.group_id)
    if left is not None:
      if left <= 1:
        self._samples.pop(r.group_id)
        self._examples.pop(r.group_id, None)
      else:
        self._samples[r.group_id] = left - 1
    return 0 if live is None else live.episode.tool_calls


class ToolUse:
  """A run's tool use, for a task with an environment: the tool pool, the EpisodeDriver
  the sampler thread runs (`driver`) and the held-out tool-call-rate curve `curve`
  ([[wall_time_s, step, rate]], checkpointed)."""

  def __init__(self, cfg, env, tokenizer, accounting):
    from rl_jax import envs
    from rl_jax.envs.tools import ToolPool
    self.acc = accounting
    self.pool = ToolPool(env, cfg.env.tool, seed=cfg.seed)
    self.driver = EpisodeDriver(env=env, pool=self.pool, tokenizer=tokenizer,
                                accounting=accounting, budget=envs.episode_budget(cfg))
    accounting.has_env = True
    self.curve: list = []

  def restore(self, curve: list) -> None:
    self.curve = list(curve)
    if self.curve:
      self.acc.heldout_tool_call_rate = self.curve[-1][2]

  def heldout(self, result: dict) -> str:
    """Takes a held-out evaluation's tool-call rate; its console line."""
    self.acc.heldout_tool_call_rate = result["tool_call_rate"]
    return (f"held-out: reward {result['reward_mean']:.3f}, accuracy {result['accuracy']:.3f}, "
            f"tool-call rate {result['tool_call_rate']:.3f}, turns {result['turns_mean']:.2f}")

  def note(self, wall: float, step: int) -> None:
    """The latest held-out tool-call rate joins the curve."""
    self.curve.append([wall, step, self.acc.heldout_tool_call_rate])

  def summary(self) -> dict:
    """summary.json's tool-use entries."""
    return {**self.acc.env_summary(), "heldout_tool_call_rate_curve": self.curve,
            "heldout_tool_call_rate_initial": self.curve[0][2],
            "heldout_tool_call_rate_final": self.curve[-1][2]}

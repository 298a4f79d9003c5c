"""The fixed held-out set and its greedy evaluation, shared by the run loop and
launch/evaluate.py so that a checkpoint evaluated later scores as the run did.

For a task with an environment (tool use) every held-out prompt is a whole greedy
episode (rl_jax.envs.episodes.run_episodes: the tool answers at once, without the tool
pool's injected latency or failures), scored on its whole completion text; the score
also reports the held-out tool-call rate (share of episodes with at least one call).
"""
from __future__ import annotations

import numpy as np


class Heldout:
  """The task's held-out prompts (encoded as the prompt pipeline encodes them).

  max_new_tokens: the completion budget (for an environment, the episode's)."""

  def __init__(self, task, data_cfg, tokenizer, *, max_new_tokens: int, env=None):
    from rl_jax.data import prompts as prompts_lib
    examples = task.heldout_examples()
    records = prompts_lib.heldout_records(task, data_cfg, tokenizer)
    self.task, self.tokenizer, self.max_new_tokens = task, tokenizer, max_new_tokens
    self.env = env
    self.examples = [examples[r["index"]] for r in records]
    self.prompts = [r["prompt_tokens"] for r in records]
    # Long prompts follow data.on_long_prompt: reported, since the set may shrink.
    self.counters = {"heldout_prompts_dropped": len(examples) - len(records),
                     "heldout_prompts_truncated": sum(bool(r["truncated"]) for r in records)}

  def generate(self, generator) -> list:
    """Greedy completions of every held-out prompt (device work); with an environment,
    their episodes (rl_jax.envs.episodes.EpisodeResult)."""
    if self.env is None:
      return generator.generate(self.prompts, greedy=True, max_new_tokens=self.max_new_tokens)
    from rl_jax.envs.episodes import run_episodes
    from rl_jax.sampler.engine import Sampling
    return run_episodes(generator, self.env, self.tokenizer, self.examples, self.prompts,
                        max_new_tokens=self.max_new_tokens, sampling=Sampling.greedy())

  def generate_beside(self, evaluator, sampler, console) -> list:
    """generate(evaluator) with the evaluator (a Generator made with borrows_pool=True)
    in the paused `sampler` generator's KV pool (Generator.lend_pool: room for one
    sequence and its prompt's partial page), with heartbeat lines on `console`."""
    n, done, tokens = len(self.prompts), evaluator.rollouts_finished, evaluator.tokens_generated
    with sampler.lend_pool(evaluator, evaluator.engine.pages_per_seq + 1), console.heartbeat(
        lambda: f"held-out evaluation: {evaluator.rollouts_finished - done}/{n} done, "
                f"{evaluator.tokens_generated - tokens:,} tokens"):
      return self.generate(evaluator)

  def score(self, completions) -> dict:
    """rl_jax.tasks.evaluate of the completions: reward_mean, accuracy, n; episodes also
    give tool_call_rate, tool_calls_mean and turns_mean."""
    from rl_jax.tasks import evaluate as evaluate_task
    if self.env is None:
      texts = [self.tokenizer.decode(c) for c in completions]
      return evaluate_task(self.task, self.examples, texts)
    texts = [self.tokenizer.decode(e.rollout.completion_tokens) for e in completions]
    out = evaluate_task(self.task, self.examples, texts)
    calls = np.asarray([e.tool_calls for e in completions], np.float64)
    out.update(tool_call_rate=float((calls > 0).mean()) if calls.size else 0.0,
               tool_calls_mean=float(calls.mean()) if calls.size else 0.0,
               turns_mean=float(np.mean([e.rollout.num_turns for e in completions]))
               if completions else 0.0)
    return out


def make_heldout(cfg, task, tokenizer, env=None) -> Heldout:
  """The run's held-out set: the completion budget, and the task's environment if any."""
  from rl_jax import envs
  env = env if env is not None else envs.make_env(task, cfg.env)
  budget = cfg.sampler.max_new_tokens if env is None else envs.episode_budget(cfg)
  return Heldout(task, cfg.data, tokenizer, max_new_tokens=budget, env=env)


def evaluate_params(cfg, model_cfg, params, tokenizer) -> dict:
  """Greedy held-out evaluation of `params` (host or device arrays) with the pieces
  Pipeline.evaluate uses: the same Heldout set, engine and Generator.generate. Returns
  Heldout.score's dict (reward_mean, accuracy, n)."""
  from rl_jax import sharding
  from rl_jax.sampler.engine import Engine
  from rl_jax.sampler.generator import Generator
  from rl_jax.tasks import make_task
  meshes = sharding.make_meshes(cfg.mesh)
  task = make_task(cfg.task, seed=cfg.seed, on_bad_line=cfg.data.on_bad_line)
  heldout = make_heldout(cfg, task, tokenizer)
  engine = Engine.from_config(cfg.sampler, model_cfg, mesh=meshes.sampler, tokenizer=tokenizer)
  return heldout.score(heldout.generate(Generator(engine, params)))

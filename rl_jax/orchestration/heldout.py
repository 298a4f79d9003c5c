"""The fixed held-out set and its greedy evaluation, shared by the run loop and
launch/evaluate.py so that a checkpoint evaluated later scores as the run did."""
from __future__ import annotations


class Heldout:
  """The task's held-out prompts (encoded as the prompt pipeline encodes them)."""

  def __init__(self, task, data_cfg, tokenizer, *, max_new_tokens: int):
    from rl_jax.data import prompts as prompts_lib
    examples = task.heldout_examples()
    records = prompts_lib.heldout_records(task, data_cfg, tokenizer)
    self.task, self.tokenizer, self.max_new_tokens = task, tokenizer, max_new_tokens
    self.examples = [examples[r["index"]] for r in records]
    self.prompts = [r["prompt_tokens"] for r in records]
    # Long prompts follow data.on_long_prompt: reported, since the set may shrink.
    self.counters = {"heldout_prompts_dropped": len(examples) - len(records),
                     "heldout_prompts_truncated": sum(bool(r["truncated"]) for r in records)}

  def generate(self, generator) -> list:
    """Greedy completions of every held-out prompt (device work)."""
    return generator.generate(self.prompts, greedy=True, max_new_tokens=self.max_new_tokens)

  def score(self, completions) -> dict:
    """rl_jax.tasks.evaluate of the completions: reward_mean, accuracy, n."""
    from rl_jax.tasks import evaluate as evaluate_task
    texts = [self.tokenizer.decode(c) for c in completions]
    return evaluate_task(self.task, self.examples, texts)


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
  heldout = Heldout(task, cfg.data, tokenizer, max_new_tokens=cfg.sampler.max_new_tokens)
  engine = Engine.from_config(cfg.sampler, model_cfg, mesh=meshes.sampler, tokenizer=tokenizer)
  return heldout.score(heldout.generate(Generator(engine, params)))

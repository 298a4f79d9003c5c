"""Multi-turn tool use: multiplication with a calculator tool, async GRPO, tiny char model.

The model may write a call such as "<calc>37*48</calc>"; the environment answers
"<result>1776</result>" after a lognormal tool latency (rl_jax/envs/calculator.py), and the
model then answers. Without the tool the tiny model is mostly wrong on multi-digit
products; the warm-up demonstrations call the tool in only part of the examples
(task.tool_demo_fraction), so RL has to learn when calling pays. While a sequence waits
for its tool, its KV pages stay and its decode slot serves other sequences.

  python launch/train.py --config configs/calculator.py
  python launch/train.py --config configs/calculator.py:mode=sync      (the baseline)
  python launch/compare.py --config configs/calculator.py
"""
from configs import base


def get_config(arg=None):
  c = base.get_config()
  c.model.preset = "tiny_char"
  c.task.name = "calculator"
  c.task.digits = 2
  c.task.num_terms = 2
  c.task.operators = "*"
  c.task.tool_demo_fraction = 0.3
  c.task.heldout_size = 256
  c.mesh.sampler.data = 4
  c.mesh.sampler.tensor = 1
  c.mesh.trainer.data = 4
  c.mesh.trainer.fsdp = 1
  c.mesh.trainer.tensor = 1
  c.data.max_prompt_length = 16
  c.sampler.max_prefill_length = 32
  # "<calc>99*99</calc>" + "<result>9801</result>" + "9801" + eos = 44 tokens.
  c.sampler.max_new_tokens = 48
  c.sampler.page_size = 8
  c.sampler.max_concurrent_decodes = 64
  c.trainer.length_buckets = (32, 64)
  c.trainer.learning_rate = 1e-4
  c.warmstart.steps = 400
  c.warmstart.batch_size = 64
  c.warmstart.learning_rate = 1e-3
  c.env.max_turns = 3
  c.env.max_total_tokens = 0
  # A slow, heavy-tailed tool (lognormal, mean 0.2 s, p99 about 1.2 s).
  c.env.tool.workers = 64
  c.env.tool.latency = "lognormal"
  c.env.tool.latency_mean_s = 0.2
  c.env.tool.latency_sigma = 1.0
  c.rl.mode = "async"
  c.rl.total_steps = 100
  c.rl.max_staleness = 1
  c.rl.groups_per_step = 16
  c.rl.group_size = 8
  c.rl.eval_every = 10
  c.verifier.workers = 16
  for kv in (arg or "").split(","):
    if not kv:
      continue
    key, _, value = kv.partition("=")
    if key == "mode":
      c.rl.mode = value
    else:
      raise ValueError(f"unknown variant {key!r}; known: mode")
  return c

"""The embedded default: tiny char-level model, 2-digit addition, async GRPO on 8 CPU devices.

A heavy-tailed verifier latency (lognormal, emulating tool calls) and a spread of
response lengths make the barrier of sync mode costly; configs/sync_baseline.py is
the same workload in sync mode. Variants: `--config configs/default.py:mode=sync`.
"""
from configs import base


def get_config(arg=None):
  c = base.get_config()
  c.model.preset = "tiny_char"
  c.task.name = "arithmetic"
  c.task.digits = 2
  c.task.num_terms = 2
  c.task.operators = "+"
  # Pure data parallelism on both sides: on CPU, FSDP/TP collectives cost more than the
  # tiny model's math. Sampler devices first, then trainer devices.
  c.mesh.sampler.data = 4
  c.mesh.sampler.tensor = 1
  c.mesh.trainer.data = 4
  c.mesh.trainer.fsdp = 1
  c.mesh.trainer.tensor = 1
  c.data.max_prompt_length = 16
  c.sampler.max_prefill_length = 16
  c.sampler.max_new_tokens = 12
  c.sampler.page_size = 8
  c.sampler.max_concurrent_decodes = 64
  c.trainer.length_buckets = (16, 32)
  c.trainer.learning_rate = 1e-4
  c.warmstart.steps = 300
  c.warmstart.batch_size = 64
  c.warmstart.learning_rate = 1e-3
  c.rl.mode = "async"
  c.rl.total_steps = 300
  c.rl.max_staleness = 2
  c.rl.groups_per_step = 16
  c.rl.group_size = 8
  c.rl.eval_every = 20
  c.task.heldout_size = 512
  # Tool-call-like verification: many concurrent calls, heavy-tailed latency (lognormal,
  # mean 0.15 s, p99 about 0.9 s): a sync step waits for the slowest of 128 calls.
  c.verifier.workers = 64
  c.verifier.latency = "lognormal"
  c.verifier.latency_mean_s = 0.15
  c.verifier.latency_sigma = 1.0
  for kv in (arg or "").split(","):
    if not kv:
      continue
    key, _, value = kv.partition("=")
    if key == "mode":
      c.rl.mode = value
    else:
      raise ValueError(f"unknown variant {key!r}; known: mode")
  return c

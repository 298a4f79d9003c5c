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
  c.rl.mode = "async"
  c.verifier.latency = "lognormal"
  c.verifier.latency_mean_s = 0.05
  c.verifier.latency_sigma = 1.5
  for kv in (arg or "").split(","):
    if not kv:
      continue
    key, _, value = kv.partition("=")
    if key == "mode":
      c.rl.mode = value
    else:
      raise ValueError(f"unknown variant {key!r}; known: mode")
  return c

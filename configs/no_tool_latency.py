"""The default workload with verifier latency off: the compute-bound case.

Same model, task, batch, learning rate and staleness bound as configs/default.py; only
the injected verifier latency is gone, so a rollout is scored as soon as it is decoded
and nothing slow is left to overlap with training (on the embedded CPU layout the
sampler and trainer already share the machine's cores). Variants: `:mode=sync`.
"""
from configs import default


def get_config(arg=None):
  c = default.get_config(arg)
  c.verifier.latency = "none"
  c.verifier.latency_mean_s = 0.0
  return c

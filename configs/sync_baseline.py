"""The embedded default workload in sync mode: the baseline async is compared against."""
from configs import default


def get_config(arg=None):
  c = default.get_config(arg)
  c.rl.mode = "sync"
  return c

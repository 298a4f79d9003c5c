"""Length buckets of the train step: rows are padded to the smallest bucket that fits.

No jax here, so the planner (rl_jax.planner) pads simulated batches by the same rule.
"""
from __future__ import annotations

from typing import Sequence


def pick_bucket(length: int, length_buckets: Sequence[int]) -> int:
  """The smallest bucket >= length; ValueError when none is (config validation keeps
  the largest bucket >= data.max_prompt_length + sampler.max_new_tokens)."""
  fits = [b for b in sorted(length_buckets) if b >= length]
  if not fits:
    raise ValueError(
        f"a sequence of {length} tokens exceeds the largest trainer.length_buckets entry "
        f"({max(length_buckets)})")
  return fits[0]

"""The trainer's state and the tree / row helpers its update uses (rl_jax.trainer.train_step)."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class TrainState(NamedTuple):
  """Trainer state; every leaf lives on the trainer mesh."""
  params: Any  # float32 master params (the adapters under LoRA), TRAIN_RULES shardings
  opt_state: Any  # optax state (Adam moments sharded like params)
  step: jax.Array  # int32: step / sft_step calls completed
  skipped: jax.Array  # int32: optimizer updates skipped for a non-finite loss or gradient


def split_rows(x: jax.Array, n: int) -> jax.Array:
  """[b, ...] -> [n, b // n, ...]; chunk i holds rows i, i + n, i + 2n, ..."""
  return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)


def merge_rows(x: jax.Array) -> jax.Array:
  """Inverse of split_rows: [n, b // n, ...] -> [b, ...]."""
  return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def global_norm(tree) -> jax.Array:
  """sqrt(sum of squares over every leaf)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def tree_where(flag: jax.Array, new, old):
  """new where flag else old, leaf by leaf (a select: the kept tree is bitwise unchanged)."""
  return jax.tree.map(lambda a, b: jnp.where(flag, a, b), new, old)

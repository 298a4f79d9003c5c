"""Learning-rate schedules and the optax chain used by the trainer.

The chain is clip_by_global_norm(grad_clip) -> adamw(schedule, b1, b2, weight_decay).
Weight decay applies to matrices only (ndim >= 2): decaying norm scales and biases
towards zero pulls them away from their identity / neutral values for no benefit.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "cosine")


def lr_schedule(*, learning_rate: float, schedule: str, warmup_steps: int,
                total_steps: int) -> optax.Schedule:
  """lr(n) for the n-th applied optimizer update, n = 0, 1, ...

  warm(n)   = min(1, (n + 1) / warmup_steps)          (1 when warmup_steps = 0)
  constant: lr(n) = learning_rate * warm(n)
  cosine:   lr(n) = learning_rate * warm(n) * (1 + cos(pi * p)) / 2,
            p = clip((n - warmup_steps) / (total_steps - warmup_steps), 0, 1)
  Warm-up starts at lr / warmup_steps rather than 0 so the first update is not wasted.
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"trainer.schedule must be one of {SCHEDULES}, got {schedule!r}")
  decay_steps = max(total_steps - warmup_steps, 1)

  def lr(count):
    n = jnp.asarray(count, jnp.float32)
    warm = jnp.minimum(1.0, (n + 1.0) / warmup_steps) if warmup_steps > 0 else 1.0
    if schedule == "constant":
      return learning_rate * warm
    progress = jnp.clip((n - warmup_steps) / decay_steps, 0.0, 1.0)
    return learning_rate * warm * 0.5 * (1.0 + jnp.cos(math.pi * progress))
  return lr


def decay_mask(params):
  """True for leaves that receive weight decay (matrices and embeddings)."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(*, learning_rate: float | optax.Schedule, b1: float, b2: float,
                   weight_decay: float, grad_clip: float) -> optax.GradientTransformation:
  """clip_by_global_norm(grad_clip) (skipped when grad_clip <= 0) then AdamW."""
  adamw = optax.adamw(learning_rate, b1=b1, b2=b2, eps=1e-8, weight_decay=weight_decay,
                      mask=decay_mask)
  if grad_clip <= 0:
    return adamw
  return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)

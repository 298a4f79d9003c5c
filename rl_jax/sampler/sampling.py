"""Token sampling of the decode step, written so every pass over the vocabulary is an
ordinary XLA op (no sort, no loop, no conditional).

Shape letters: b slots, v vocabulary, c truncation cap (the candidates `lax.top_k`
keeps), r = 2 words of a raw threefry key.

Randomness is a counter-based hash, Threefry-2x32 (20 rounds, Salmon et al. 2011),
written out in array ops: bit-identical to jax.extend.random.threefry_2x32, but with no
`while` loop (XLA:CPU lowers JAX's own threefry to a rolled loop, whose body a cost
analysis counts once). A request's key is fold_in(fold_in(key(seed), sample_index),
position) exactly as JAX computes it; the Gumbel noise of vocabulary entry i at a step
is -log(-log(u)), u uniform in [0, 1) from the hash of counter i under the step key. So
a request's tokens depend only on its seed, sample index, position and logits.

Sampling (per slot b, z = logits / temperature, or the logits when greedy):
  token = argmax(z + gumbel * [not greedy])     (one pass: greedy is noise 0)
  logprob = z[token] - logsumexp(z)
With truncation (top-k, top-p; the program variant `truncate`, chosen by the host):
  the c = min(cap, v) largest z by lax.top_k; top-k keeps ranks < top_k (top_k > c acts
  as c); top-p then keeps the smallest prefix whose mass reaches top_p, mass measured
  under the top-k renormalised distribution (the full one when top_k is 0). Rows that
  truncate sample among their kept candidates, with the same per-entry noise; the
  log-prob is under the truncated distribution. A nucleus wider than c tokens is cut at
  c (the log-prob is still that of the distribution actually sampled from).

A request's settings are a `Sampling` (re-exported by engine.py).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

TRUNCATION_CAP = 256
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Per-request sampling: temperature <= 0 means greedy; top_k 0 and top_p 1 are off.
  Truncation keeps at most TRUNCATION_CAP (256) candidates: a larger top_k acts as the
  cap, and a nucleus wider than the cap is cut there (sample_tokens)."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  @classmethod
  def greedy(cls) -> Sampling:
    return cls(temperature=0.0)

  def __post_init__(self):
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 is off), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def threefry2x32(k0, k1, x0, x1, xp=jnp):
  """Threefry-2x32 of counters (x0, x1) under key (k0, k1), all uint32 and broadcast
  together; returns (y0, y1). `xp` is jax.numpy on device or numpy on the host."""
  u32 = xp.uint32
  k0, k1, x0, x1 = (xp.asarray(a, u32) for a in (k0, k1, x0, x1))
  ks = (k0, k1, k0 ^ k1 ^ u32(_PARITY))

  def rotl(x, r):
    return (x << u32(r)) | (x >> u32(32 - r))

  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = rotl(x1, r) ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + u32(i + 1)
  return x0, x1


def request_key(seed: int, sample_index: int) -> np.ndarray:
  """uint32 [2]: key_data(fold_in(key(seed), sample_index)) of JAX's threefry, on the
  host (seed in [0, 2^31))."""
  with np.errstate(over="ignore"):
    y0, y1 = threefry2x32(np.uint32(0), np.uint32(seed), np.uint32(0),
                          np.uint32(sample_index), xp=np)
  return np.asarray([y0, y1], np.uint32)


def step_keys(keys_br: jax.Array, pos_b: jax.Array) -> jax.Array:
  """uint32 [b, 2]: fold_in(key_b, pos_b) per slot."""
  y0, y1 = threefry2x32(keys_br[:, 0], keys_br[:, 1], jnp.zeros_like(pos_b, jnp.uint32),
                        pos_b.astype(jnp.uint32))
  return jnp.stack([y0, y1], axis=-1)


def gumbel(keys_br: jax.Array, index_bv: jax.Array) -> jax.Array:
  """float32 Gumbel(0, 1) noise of vocabulary entries index_bv under each row's key."""
  y0, y1 = threefry2x32(keys_br[:, :1], keys_br[:, 1:], jnp.zeros_like(index_bv, jnp.uint32),
                        index_bv.astype(jnp.uint32))
  bits = (y0 ^ y1) >> jnp.uint32(9) | jnp.uint32(0x3F800000)
  u = lax.bitcast_convert_type(bits, jnp.float32) - 1.0
  return -jnp.log(-jnp.log(jnp.maximum(u, jnp.finfo(jnp.float32).tiny)))


def sample_tokens(*, logits_bv: jax.Array, keys_br: jax.Array, temperature_b: jax.Array,
                  top_k_b: jax.Array, top_p_b: jax.Array,
                  truncate: bool = True) -> tuple[jax.Array, jax.Array]:
  """(tokens_b int32, logprobs_b float32) for one step (module docstring); keys_br are
  the step keys (step_keys). truncate=False ignores top_k / top_p (the host passes it
  when no slot truncates)."""
  b, v = logits_bv.shape
  logits_bv = logits_bv.astype(jnp.float32)
  greedy_b = temperature_b <= 0
  z_bv = logits_bv / jnp.where(greedy_b, 1.0, temperature_b)[:, None]
  noise_b1 = (~greedy_b).astype(jnp.float32)[:, None]
  index_v = lax.broadcasted_iota(jnp.int32, (b, v), 1)
  tokens_b = jnp.argmax(z_bv + noise_b1 * gumbel(keys_br, index_v), axis=-1).astype(jnp.int32)
  lse_b = jax.nn.logsumexp(z_bv, axis=-1)
  logprobs_b = jnp.take_along_axis(z_bv, tokens_b[:, None], axis=-1)[:, 0] - lse_b
  if not truncate:
    return tokens_b, logprobs_b
  c = min(TRUNCATION_CAP, v)
  top_bc, idx_bc = lax.top_k(z_bv, c)
  rank_c = jnp.arange(c)
  by_k_b = top_k_b > 0
  keep_bc = ~by_k_b[:, None] | (rank_c[None] < top_k_b[:, None])
  lse_k_b = jnp.where(by_k_b, jax.nn.logsumexp(jnp.where(keep_bc, top_bc, -jnp.inf), -1),
                      lse_b)
  probs_bc = jnp.where(keep_bc, jnp.exp(top_bc - lse_k_b[:, None]), 0.0)
  mass_before_bc = jnp.cumsum(probs_bc, axis=-1) - probs_bc
  # top_p == 1 keeps everything even when float rounding lets the cumulative mass hit 1.
  keep_bc &= (mass_before_bc < top_p_b[:, None]) | (top_p_b[:, None] >= 1)
  kept_bc = jnp.where(keep_bc, top_bc, -jnp.inf)
  pick_b = jnp.argmax(kept_bc + noise_b1 * gumbel(keys_br, idx_bc), axis=-1)
  trunc_tokens_b = jnp.take_along_axis(idx_bc, pick_b[:, None], axis=-1)[:, 0]
  trunc_logprobs_b = (jnp.take_along_axis(top_bc, pick_b[:, None], axis=-1)[:, 0] -
                      jax.nn.logsumexp(kept_bc, axis=-1))
  truncates_b = ~greedy_b & (by_k_b | (top_p_b < 1))
  return (jnp.where(truncates_b, trunc_tokens_b, tokens_b).astype(jnp.int32),
          jnp.where(truncates_b, trunc_logprobs_b, logprobs_b))

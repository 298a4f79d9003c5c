"""The vocabulary projection in sequence chunks: token log-probs, entropy and greedy hits
without ever holding the [b, t, v] float32 logits.

Shape letters: b rows, t positions, n chunks, c positions per chunk (t padded to n * c),
e hidden, v vocabulary.

Position convention (rl_jax.trainer.grpo): x_bt[:, t] concerns tokens_bt[:, t + 1], which
the model predicts at position t; the last column predicts nothing and is 0 (hit False).
For each chunk of c positions, with z = x @ W (x and W in the compute dtype, products
accumulated in float32, z float32), one pass over z gives

  lse_bc     = logsumexp_v z_bcv           p_bcv = exp(z_bcv - lse_bc)
  logp_bc    = z_bcv[next token] - lse_bc
  entropy_bc = lse_bc - sum_v p_bcv z_bcv
  hit_bc     = argmax_v z_bcv == next token

The gradient is a custom VJP. With g_bc the cotangent of logp_bc,

  dz_bcv = g_bc (onehot(next)_bcv - p_bcv)     cast to the compute dtype
           (at the next token 1 - p = -expm1(logp_bc), from the float32 log-prob)
  dx_bce = dz_bcv @ W^T,   dW = sum over chunks of x_bce^T @ dz_bcv   (float32 accumulation)

so all three GEMMs of the head (forward, dx, dW) take two compute-dtype operands: in
bfloat16 they run at the bf16 rate. Entropy and hits carry no gradient.

Memory: with `recompute=False` the forward keeps p_bcv of every chunk in the compute
dtype ([b, t, v] of it; the backward then does no head GEMM twice); with `recompute=True`
the backward recomputes each chunk's z from x and W (one more GEMM per chunk) and the
largest vocabulary-sized buffer is one chunk's [b, c, v] float32. The trainer picks by
size (trainer.logprob_save_bytes). Chunks split t, never b, so rows keep their
data-parallel sharding.

Precision in bfloat16 (against the float32 reference): the forward's only rounding is
of x and W to bf16 (logits otherwise accumulate in float32); the backward rounds
dz_bcv to bf16, a relative error <= 2^-9 per element, which is below the rounding of x
and W themselves. (A softmax kept in bf16 has the same relative error per element; its
next-token entry, where 1 - p would cancel, comes from the float32 log-prob instead.) tests/test_head.py measures it on the same bf16-rounded x and W: the
loss equals the float32 head's, the largest gradient error is 3.8e-3 (dx) and 4.2e-3 (dW)
of the largest gradient entry, and at most 5.1e-3 of each confident position's own dx
(p > 0.99; about 2^-8, under the test's bound of 4 * 2^-9 everywhere).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rl_jax.model.presets import ModelConfig


class TokenStats(NamedTuple):
  logp_bt: jax.Array  # float32, log pi(tokens[:, t + 1] | prefix)
  entropy_bt: jax.Array  # float32, entropy of the distribution at t (no gradient)
  hit_bt: jax.Array  # bool, argmax at t == tokens[:, t + 1] (no gradient)


def head_weight(model_cfg: ModelConfig, params: dict) -> tuple[jax.Array, str]:
  """The vocabulary projection and its einsum spec over a [b, c, e] chunk."""
  if model_cfg.tie_embeddings:
    return params["embed"], "bce,ve->bcv"
  return params["lm_head"], "bce,ev->bcv"


def _logits(x_bce, w, spec):
  return jnp.einsum(spec, x_bce, w, preferred_element_type=jnp.float32)


def _onehot(next_bc, v):
  return jnp.arange(v, dtype=next_bc.dtype) == next_bc[..., None]


def _chunk_forward(x_bce, next_bc, w, spec):
  """(logp_bc, entropy_bc, hit_bc), p_bcv (float32) of one chunk from one pass over z."""
  z_bcv = _logits(x_bce, w, spec)
  m_bc = jnp.max(z_bcv, axis=-1)
  e_bcv = jnp.exp(z_bcv - m_bc[..., None])
  s_bc = jnp.sum(e_bcv, axis=-1)
  lse_bc = m_bc + jnp.log(s_bc)
  p_bcv = e_bcv / s_bc[..., None]
  # A compare-and-sum rather than a gather: it partitions over sharded rows and vocab
  # without collecting the chunk's logits on one device, and fuses with the reductions.
  picked_bc = jnp.sum(jnp.where(_onehot(next_bc, z_bcv.shape[-1]), z_bcv, 0.0), axis=-1)
  entropy_bc = lse_bc - jnp.sum(p_bcv * z_bcv, axis=-1)
  hit_bc = jnp.argmax(z_bcv, axis=-1) == next_bc
  return (picked_bc - lse_bc, entropy_bc, hit_bc), p_bcv


def _scan_forward(x_nbce, next_nbc, w, spec, keep_probs):
  def body(_, xs):
    stats, p_bcv = _chunk_forward(xs[0], xs[1], w, spec)
    return None, (stats, p_bcv.astype(x_nbce.dtype) if keep_probs else None)
  _, (stats, probs_nbcv) = jax.lax.scan(body, None, (x_nbce, next_nbc))
  return stats, probs_nbcv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_stats(x_nbce, next_nbc, w, spec, recompute):
  """(logp_nbc, entropy_nbc, hit_nbc) of every chunk; gradient only through logp."""
  del recompute
  return _scan_forward(x_nbce, next_nbc, w, spec, keep_probs=False)[0]


def _chunked_stats_fwd(x_nbce, next_nbc, w, spec, recompute):
  stats, probs_nbcv = _scan_forward(x_nbce, next_nbc, w, spec, keep_probs=not recompute)
  return stats, (x_nbce, next_nbc, w, stats[0], probs_nbcv)


def _chunked_stats_bwd(spec, recompute, residuals, cotangents):
  x_nbce, next_nbc, w, logp_nbc, probs_nbcv = residuals
  g_nbc = cotangents[0]  # entropy and hits carry no gradient
  dtype = x_nbce.dtype
  x_spec, w_spec, z_spec = spec.replace("->", ",").split(",")
  dx_spec, dw_spec = f"{z_spec},{w_spec}->{x_spec}", f"{x_spec},{z_spec}->{w_spec}"

  def body(dw, xs):
    x_bce, next_bc, g_bc, logp_bc, p_bcv = xs
    if recompute:
      p_bcv = _chunk_forward(x_bce, next_bc, w, spec)[1].astype(dtype)
    onehot_bcv = _onehot(next_bc, p_bcv.shape[-1])
    # The next token's entry 1 - p is taken from the float32 log-prob: from a bf16 p it
    # would cancel (p = 0.999 rounds to 1.0 in bf16, and its gradient to 0). dz is formed
    # in the compute dtype: a float32 detour lets XLA hoist one convert of every chunk's
    # saved softmax out of the loop (3x the saved bytes, measured).
    dz_bcv = jnp.where(onehot_bcv, (-jnp.expm1(logp_bc)).astype(dtype)[..., None], -p_bcv)
    dz_bcv = g_bc.astype(dtype)[..., None] * dz_bcv
    dx_bce = jnp.einsum(dx_spec, dz_bcv, w, preferred_element_type=jnp.float32)
    dw = dw + jnp.einsum(dw_spec, x_bce, dz_bcv, preferred_element_type=jnp.float32)
    return dw, dx_bce.astype(dtype)

  dw, dx_nbce = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32),
                             (x_nbce, next_nbc, g_nbc, logp_nbc, probs_nbcv))
  return dx_nbce, None, dw.astype(w.dtype)


_chunked_stats.defvjp(_chunked_stats_fwd, _chunked_stats_bwd)


def token_stats(model_cfg: ModelConfig, params: dict, x_bte: jax.Array, tokens_bt: jax.Array,
                *, chunk_len: int, recompute: bool = True) -> TokenStats:
  """TokenStats of hidden states x_bte (model.hidden_states) in chunks of `chunk_len`
  positions (0 or >= t: one chunk). `params` in the compute dtype, like x_bte.
  `recompute`: the backward recomputes each chunk's logits instead of keeping the
  [b, t, v] probabilities in the compute dtype (module docstring)."""
  b, t, e = x_bte.shape
  c = t if chunk_len <= 0 else min(chunk_len, t)
  n = -(-t // c)
  next_bt = jnp.concatenate([tokens_bt[:, 1:], jnp.zeros_like(tokens_bt[:, :1])], axis=1)
  pad = n * c - t
  x_bte = jnp.pad(x_bte, ((0, 0), (0, pad), (0, 0)))
  next_bt = jnp.pad(next_bt, ((0, 0), (0, pad)))
  x_nbce = x_bte.reshape(b, n, c, e).swapaxes(0, 1)
  next_nbc = next_bt.reshape(b, n, c).swapaxes(0, 1)
  w, spec = head_weight(model_cfg, params)
  logp_nbc, entropy_nbc, hit_nbc = _chunked_stats(x_nbce, next_nbc, w.astype(x_bte.dtype),
                                                  spec, bool(recompute))
  unchunk = lambda a_nbc: a_nbc.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  last_t = jnp.arange(t) == t - 1
  return TokenStats(logp_bt=jnp.where(last_t, 0.0, unchunk(logp_nbc)),
                    entropy_bt=unchunk(entropy_nbc),
                    hit_bt=unchunk(hit_nbc) & ~last_t)


"""The vocabulary projection in sequence chunks: token log-probs, entropy and greedy hits
without ever holding the [b, t, v] float32 logits.

Shape letters: b rows, t positions, n chunks, c positions per chunk (t padded to n * c),
e hidden, v vocabulary.

Position convention (rl_jax.trainer.grpo): x_bt[:, t] concerns tokens_bt[:, t + 1], which
the model predicts at position t; the last column predicts nothing and is 0 (hit False).
For each chunk of c positions, with z = x @ W in float32 (W the tied embedding or the
lm head, in the compute dtype):

  lse_bc     = logsumexp_v z_bcv
  logp_bc    = z_bcv[next token] - lse_bc
  entropy_bc = lse_bc - sum_v softmax(z_bcv)_v z_bcv
  hit_bc     = argmax_v z_bcv == next token

The chunks run in a lax.scan whose body is under jax.checkpoint, so the backward pass
recomputes a chunk's logits instead of saving them: the largest vocabulary-sized buffer
is one chunk's [b, c, v] float32, forward or backward. Entropy and hits carry no gradient.
Chunks split t, never b, so rows keep their data-parallel sharding.
"""
from __future__ import annotations

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


def _chunk_stats(x_bce, next_bc, w, spec, dtype):
  z_bcv = jnp.einsum(spec, x_bce, w.astype(dtype), preferred_element_type=jnp.float32)
  lse_bc = jax.nn.logsumexp(z_bcv, axis=-1)
  # A compare-and-sum rather than a gather: it partitions over sharded rows and vocab
  # without collecting the chunk's logits on one device, and fuses with the logsumexp.
  onehot_bcv = jnp.arange(z_bcv.shape[-1], dtype=next_bc.dtype) == next_bc[..., None]
  picked_bc = jnp.sum(jnp.where(onehot_bcv, z_bcv, 0.0), axis=-1)
  z_sg = jax.lax.stop_gradient(z_bcv)
  lse_sg = jax.lax.stop_gradient(lse_bc)
  entropy_bc = lse_sg - jnp.sum(jnp.exp(z_sg - lse_sg[..., None]) * z_sg, axis=-1)
  hit_bc = jnp.argmax(z_sg, axis=-1) == next_bc
  return picked_bc - lse_bc, entropy_bc, hit_bc


def token_stats(model_cfg: ModelConfig, params: dict, x_bte: jax.Array, tokens_bt: jax.Array,
                *, chunk_len: int) -> TokenStats:
  """TokenStats of hidden states x_bte (model.hidden_states) in chunks of `chunk_len`
  positions (0 or >= t: one chunk). `params` in the compute dtype, like x_bte."""
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
  # The weight's gradient is summed over the n chunks in the scan's carry, in w's dtype.
  body = jax.checkpoint(
      lambda _, xs: (None, _chunk_stats(xs[0], xs[1], w, spec, x_bte.dtype)),
      prevent_cse=False)
  _, (logp_nbc, entropy_nbc, hit_nbc) = jax.lax.scan(body, None, (x_nbce, next_nbc))
  unchunk = lambda a_nbc: a_nbc.swapaxes(0, 1).reshape(b, n * c)[:, :t]
  last_t = jnp.arange(t) == t - 1
  return TokenStats(logp_bt=jnp.where(last_t, 0.0, unchunk(logp_nbc)),
                    entropy_bt=unchunk(entropy_nbc),
                    hit_bt=unchunk(hit_nbc) & ~last_t)

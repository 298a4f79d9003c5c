"""Prompt prefill into dense K/V and its scatter into KV pages (the Engine's prefill
programs; pure functions, jitted by rl_jax.sampler.engine).

Shape letters: l layers, k kv heads, n prompts, t positions, d head dim, m pages per
prompt, p page size (positions per page).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import model
from rl_jax.model import transformer as tfm
from rl_jax.sampler import decode
from rl_jax.sampler import page_table as pt


class Prefix(NamedTuple):
  """Dense K/V of one padded prompt (JetStream's `Prefix`).

  Positions 0..true_length-2 are written to pages at insert; the last prompt token
  is kept as the first decode input.
  """
  k_lktd: jax.Array
  v_lktd: jax.Array
  last_token: jax.Array  # int32 scalar
  true_length: jax.Array  # int32 scalar


def prompt_kv(params, tokens_nt, *, model_cfg, kv_dtype):
  """K/V of n right-padded prompts, each [l, k, n, t, d] (causal: padding after a
  prompt does not change its positions). Layers unrolled over decode.layer_params, so
  per-layer weights are read in place; logits are never computed."""
  positions_nt = jnp.broadcast_to(jnp.arange(tokens_nt.shape[1], dtype=jnp.int32),
                                  tokens_nt.shape)
  x_nte, cos_ntd, sin_ntd = decode.embed_positions(model_cfg, params, tokens_nt, positions_nt)

  def attend(q_nthd, k_ntkd, v_ntkd):
    out_nthd = model.causal_attention(q_nthd, k_ntkd, v_ntkd,
                                      implementation=model_cfg.attention)
    return out_nthd, (k_ntkd, v_ntkd)

  k_l, v_l = [], []
  for i in range(model_cfg.num_layers):  # XLA drops the last layer's unused MLP
    x_nte, (k_ntkd, v_ntkd) = tfm.layer_forward(model_cfg, decode.layer_params(params, i),
                                                x_nte, cos_ntd, sin_ntd, attend)
    k_l.append(k_ntkd.transpose(2, 0, 1, 3).astype(kv_dtype))
    v_l.append(v_ntkd.transpose(2, 0, 1, 3).astype(kv_dtype))
  return jnp.stack(k_l), jnp.stack(v_l)


def prefill(params, padded_tokens_t, true_length, *, model_cfg, kv_dtype):
  k_lkntd, v_lkntd = prompt_kv(params, padded_tokens_t[None], model_cfg=model_cfg,
                                kv_dtype=kv_dtype)
  return Prefix(k_lkntd[:, :, 0], v_lkntd[:, :, 0],
                padded_tokens_t[true_length - 1].astype(jnp.int32),
                jnp.asarray(true_length, jnp.int32))


def _layer_values(pools, x_l):
  """x_l split per layer when the pools are a per-layer tuple, else x_l itself."""
  return tuple(x_l[i] for i in range(len(pools))) if isinstance(pools, tuple) else x_l


def scatter_prompts(state, k_lkntd, v_lkntd, true_length_n, pages_nm, *, page_size):
  """Scatter positions 0..true_length-2 of each prompt n into its pages pages_nm[n]
  (page j holds positions j*p .. j*p+p-1); the rest goes to the null page."""
  t = k_lkntd.shape[3]
  m = pages_nm.shape[1]
  pos_t = jnp.arange(t)
  page_nt = jnp.where(pos_t[None] < true_length_n[:, None] - 1,
                      pages_nm[:, jnp.minimum(pos_t // page_size, m - 1)], pt.NULL_PAGE)
  slot_nt = jnp.broadcast_to(pos_t % page_size, page_nt.shape)

  def write(pool, x_kntd):  # pool [..., n_pool, p, d], x [..., n, t, d]
    return decode.pool_set(pool, np.s_[..., page_nt, slot_nt, :], x_kntd)

  return state._replace(
      k_pages=jax.tree.map(write, state.k_pages, _layer_values(state.k_pages, k_lkntd)),
      v_pages=jax.tree.map(write, state.v_pages, _layer_values(state.v_pages, v_lkntd)))


def write_prefix(state, prefix, pages_m, *, page_size):
  return scatter_prompts(state, prefix.k_lktd[:, :, None], prefix.v_lktd[:, :, None],
                          prefix.true_length[None], pages_m[None], page_size=page_size)


def prefill_into_pages(params, state, tokens_nt, true_length_n, pages_nm, *, model_cfg,
                        kv_dtype, page_size):
  """Prefill n prompts and write their cached positions into their pages, one program."""
  k_lkntd, v_lkntd = prompt_kv(params, tokens_nt, model_cfg=model_cfg, kv_dtype=kv_dtype)
  return scatter_prompts(state, k_lkntd, v_lkntd, true_length_n, pages_nm,
                          page_size=page_size)

"""Prefill over an existing prefix: new tokens attend over K/V a sequence already holds.

Shape letters (as engine.py / decode.py): l layers, k kv heads, h query heads, d
head_dim, n sequences in one call (padded to a power of two), t new tokens per sequence
(a prefill length bucket), T dense prefix positions, w page-table columns read, p tokens
per page, s key positions of a paged read (s = w p), e embed.

Two forms, both through the model's per-layer hook (transformer.layer_forward with an
`attend` that writes the new K/V first, then attends over old + new keys with a causal
mask on positions), the code path decode and prefill use, so the three agree to float
rounding:

- dense, JetStream's `Engine.prefill(existing_prefix=...)`: `prefix` holds the K/V of
  positions 0..L-1 (L = prefix.true_length); the new tokens sit at positions L..L+m-1.
  The result is a Prefix over all L + m tokens, padded to the smallest prefill bucket
  that holds them (so L + m <= max_prefill_length), with the last new token as its
  last_token: it equals a prefill of the whole sequence.
- paged, the generator's resume after a tool call: for each of n sequences, m_i tokens
  at positions start_i.. are written in place into the sequence's pages and attend over
  its first w page-table columns (positions <= their own), one program per (n, t, w)
  bucket triple, the decode state donated. Tokens beyond max_prefill_length go in
  several calls of at most that many tokens each.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.model import transformer as tfm
from rl_jax.sampler import decode
from rl_jax.sampler import page_table as pt


def _dense_attend(q_1thd, k_1tkd, v_1tkd, layer_cache, start):
  """Write the new K/V into the layer's dense cache at `start`, attend causally."""
  k_kTd, v_kTd = layer_cache
  t, big_t = q_1thd.shape[1], k_kTd.shape[1]
  k_kTd = lax.dynamic_update_slice(k_kTd, k_1tkd[0].transpose(1, 0, 2).astype(k_kTd.dtype),
                                   (0, start, 0))
  v_kTd = lax.dynamic_update_slice(v_kTd, v_1tkd[0].transpose(1, 0, 2).astype(v_kTd.dtype),
                                   (0, start, 0))
  mask_1tT = (jnp.arange(big_t)[None] <= start + jnp.arange(t)[:, None])[None]
  out_1thd = tfm.gqa_attention(q_1thd.astype(k_kTd.dtype), k_kTd.transpose(1, 0, 2)[None],
                               v_kTd.transpose(1, 0, 2)[None], mask_1tT)
  return out_1thd, (k_kTd, v_kTd)


def dense_extend(params, k_lkTd, v_lkTd, start, tokens_t, num_new, *, model_cfg,
                 out_len: int):
  """(k_lkTd, v_lkTd, last_token) of `prefix + tokens_t[:num_new]`, T = out_len.

  The cache is widened to T0 + t so the write at `start` <= T0 never clamps."""
  t = tokens_t.shape[0]
  pad = jnp.zeros(k_lkTd.shape[:2] + (t,) + k_lkTd.shape[3:], k_lkTd.dtype)
  cache = (jnp.concatenate([k_lkTd, pad], axis=2), jnp.concatenate([v_lkTd, pad], axis=2))
  positions_1t = (start + jnp.arange(t, dtype=jnp.int32))[None]
  # Logits are not returned, so XLA drops the vocabulary projection.
  _, (k_all, v_all) = model.forward(model_cfg, decode.stack_layers(params), tokens_t[None],
                                    positions_1t,
                                    attn_fn=_dense_attend, cache=cache, attn_ctx=start)
  return k_all[:, :, :out_len], v_all[:, :, :out_len], tokens_t[num_new - 1]


def _paged_attend(k_pool, v_pool, layer, *, pages_nw, write_page_nt, write_slot_nt,
                  mask_nts):
  """attend(q, k, v) for one layer: write the new K/V into the pages, then attend over
  the first w page-table columns. `layer` indexes stacked pools (None: per-layer)."""
  def attend(q_nthd, k_ntkd, v_ntkd):
    if layer is None:
      at = np.s_[:, write_page_nt, write_slot_nt]
      k_new = decode.pool_set(k_pool, at, k_ntkd.transpose(2, 0, 1, 3))
      v_new = decode.pool_set(v_pool, at, v_ntkd.transpose(2, 0, 1, 3))
      k_read, v_read = k_new, v_new
    else:  # an integer and two index arrays: the indexed dims come first, [n, t, k, d]
      at = np.s_[layer, :, write_page_nt, write_slot_nt]
      k_new, v_new = decode.pool_set(k_pool, at, k_ntkd), decode.pool_set(v_pool, at, v_ntkd)
      k_read, v_read = k_new[layer], v_new[layer]
    k_read, v_read = decode.pool_view(k_read), decode.pool_view(v_read)
    kh, _, p, d = k_read.shape
    n, w = pages_nw.shape

    def gather(pool_knpd):  # [k, n, w, p, d] -> [n, s, k, d]
      return pool_knpd[:, pages_nw].reshape(kh, n, w * p, d).transpose(1, 2, 0, 3)

    out_nthd = tfm.gqa_attention(q_nthd.astype(k_read.dtype), gather(k_read),
                                 gather(v_read), mask_nts)
    return out_nthd, (k_new, v_new)
  return attend


def paged_extend(params, state, tokens_nt, start_n, count_n, pages_nw, *, model_cfg):
  """The state with K/V of tokens_nt[i, :count_n[i]] at positions start_n[i].. written
  into the pages of row i of pages_nw (padding tokens write to the null page)."""
  dtype = jnp.dtype(model_cfg.dtype)
  stacked = not isinstance(state.k_pages, tuple)
  p = state.k_pages.shape[-2] if stacked else state.k_pages[0].shape[-2]
  n, t = tokens_nt.shape
  w = pages_nw.shape[1]
  pos_nt = start_n[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  live_nt = jnp.arange(t)[None] < count_n[:, None]
  col_nt = jnp.minimum(pos_nt // p, w - 1)
  write_page_nt = jnp.where(live_nt, jnp.take_along_axis(pages_nw, col_nt, axis=1),
                            pt.NULL_PAGE)
  mask_nts = jnp.arange(w * p)[None, None] <= pos_nt[:, :, None]
  attend_at = functools.partial(_paged_attend, pages_nw=pages_nw, write_page_nt=write_page_nt,
                                write_slot_nt=pos_nt % p, mask_nts=mask_nts)
  x_nte = jnp.take(params["embed"], tokens_nt, axis=0, mode="clip").astype(dtype)
  cos_ntd, sin_ntd = tfm.rope_tables(pos_nt, tfm.rope_inv_freq(model_cfg))
  cos_ntd, sin_ntd = cos_ntd.astype(dtype), sin_ntd.astype(dtype)
  k_pages, v_pages = state.k_pages, state.v_pages
  k_list, v_list = (None, None) if stacked else (list(k_pages), list(v_pages))
  for i in range(model_cfg.num_layers):
    lp = decode.layer_params(params, i)
    if stacked:
      x_nte, (k_pages, v_pages) = tfm.layer_forward(
          model_cfg, lp, x_nte, cos_ntd, sin_ntd, attend_at(k_pages, v_pages, i))
    else:
      x_nte, (k_list[i], v_list[i]) = tfm.layer_forward(
          model_cfg, lp, x_nte, cos_ntd, sin_ntd, attend_at(k_list[i], v_list[i], None))
  if not stacked:
    k_pages, v_pages = tuple(k_list), tuple(v_list)
  return state._replace(k_pages=k_pages, v_pages=v_pages)


class Extender:
  """The jitted dense and paged extend programs of one Engine (`Extender.of(engine)`)."""

  def __init__(self, engine):
    self.engine = engine
    rep = shd.replicated(engine.mesh)
    cfg = engine.model_cfg
    sh = engine.prefix_shardings
    self._dense = jax.jit(
        functools.partial(dense_extend, model_cfg=cfg), static_argnames=("out_len",),
        out_shardings=(sh.k_lktd, sh.v_lktd, rep))
    self._paged = jax.jit(
        functools.partial(paged_extend, model_cfg=cfg),
        in_shardings=(engine.param_shardings, engine.state_shardings, rep, rep, rep, rep),
        out_shardings=engine.state_shardings, donate_argnums=(1,))

  @classmethod
  def of(cls, engine) -> Extender:
    """The engine's Extender, built on first use (programs compile per shape)."""
    ext = engine.__dict__.get("_extender")
    if ext is None:
      ext = engine.__dict__["_extender"] = cls(engine)
    return ext

  def prefill(self, params: Any, prefix, padded_tokens, true_length: int):
    """JetStream's prefill with an existing prefix: a Prefix (same type as `prefix`)
    over the prefix's true_length tokens followed by padded_tokens[:true_length]."""
    eng = self.engine
    start = int(prefix.true_length)
    m = int(true_length)
    tokens_t = np.asarray(padded_tokens, np.int32).reshape(-1)
    if not 1 <= m <= tokens_t.shape[0]:
      raise ValueError(f"true_length {m} outside 1..{tokens_t.shape[0]}")
    if start + m > eng.max_prefill_length:
      raise ValueError(f"existing prefix of {start} tokens + {m} new tokens exceed "
                       f"sampler.max_prefill_length={eng.max_prefill_length}")
    out_len = next(b for b in eng.prefill_buckets if b >= start + m)
    k, v, last = self._dense(eng.sampler_params(params), prefix.k_lktd, prefix.v_lktd,
                             np.int32(start), tokens_t, np.int32(m), out_len=out_len)
    return prefix._replace(k_lktd=k, v_lktd=v, last_token=last,
                           true_length=jnp.asarray(start + m, jnp.int32))

  def extend(self, params: Any, state, entries: Sequence[tuple]):
    """Write the K/V of new tokens into sequences' pages. entries: (tokens, start,
    pages) per sequence: tokens (>= 1) go to positions start.., which `pages` (the
    sequence's page list) must cover; positions < start must already be cached."""
    eng = self.engine
    params = eng.sampler_params(params)
    chunk = eng.max_prefill_length
    todo = [(np.asarray(toks, np.int32).reshape(-1), int(start), pages)
            for toks, start, pages in entries]
    for toks, start, pages in todo:
      if toks.size < 1 or pt.pages_for(start + toks.size, eng.page_size) > len(pages):
        raise ValueError(f"extend of {toks.size} tokens at {start} needs pages for "
                         f"{start + toks.size} positions, got {len(pages)} pages")
    offset = 0
    while todo:
      n = 1 << (len(todo) - 1).bit_length()
      part = [toks[offset:offset + chunk] for toks, _, _ in todo]
      t = next(b for b in eng.prefill_buckets if b >= max(x.size for x in part))
      tokens_nt = np.full((n, t), eng.model_cfg.pad_id, np.int32)
      start_n = np.zeros((n,), np.int32)
      count_n = np.zeros((n,), np.int32)
      for i, (x, (_, start, _)) in enumerate(zip(part, todo)):
        tokens_nt[i, :x.size] = x
        start_n[i], count_n[i] = start + offset, x.size
      w = eng.page_bucket(int((start_n + count_n).max()))
      pages_nw = np.full((n, w), pt.NULL_PAGE, np.int32)
      for i, (_, _, pages) in enumerate(todo):
        row = np.asarray(pages, np.int32)[:w]
        pages_nw[i, :row.size] = row
      state = self._paged(params, state, tokens_nt, start_n, count_n, pages_nw)
      offset += chunk
      todo = [e for e in todo if e[0].size > offset]
    return state

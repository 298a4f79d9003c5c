"""The per-step decode program of the paged engine: layer loop, paged attention, KV
writes and sampling, as pure functions (engine.py jits them).

Shape letters:
  b decode slots, s decode steps per call, l layers, n pages in the pool, p tokens per
  page, k kv heads, g query heads per kv head, h query heads (h = k g), d head_dim,
  e embed, v vocab, w page-table columns read by this call (a width bucket), u live
  (slot, page) pairs read by this call ("ragged" attention), r words of a raw PRNG key.

Layout. The K/V pools are laid out per layer as [k, n, p, d] (the layout of
jax.experimental.pallas.ops.tpu.paged_attention): with `layers="unrolled"` the state
holds one such array per layer (a tuple), the layer loop is a Python loop, and every
layer's KV write is a scatter into its own donated buffer, so nothing but the written
rows moves. With `layers="scan"` the pools are stacked [l, k, n, p, d], the layers run
in `lax.scan` with the stacked pools in the carry (written in place by a scatter at
the layer index), which compiles once per layer shape; on a GPU it measured 2.2x
slower per step than the unrolled loop (notes/measurements/h200-2026-11-30).

A step writes the new token's K/V into its page first, then attends over the slot's
pages with `kv_len_b = position + 1` keys, so the page holding the position must be
owned by the slot (the generator allocates pages for every position a step writes).
Attention ("jnp", the default off TPU) reads only `w` page-table columns; the host
picks `w` per call as the smallest width bucket covering every busy slot's pages
(engine.page_buckets). "ragged" reads only the u pages busy slots use (softmax per slot
by segment max / sum), whatever the mix of lengths; "pallas_tpu" hands the page table
and lengths to JAX's Pallas TPU kernel, which stops at each slot's length itself;
"pallas_gpu" is rl_jax's Pallas GPU kernel (paged_attention_gpu.py), likewise.

Sampling: sampling.py (the sampled token's log-prob is z[token] - logsumexp(z), z the
logits actually sampled from, after temperature and truncation).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rl_jax.model import transformer as tfm
from rl_jax.sampler import paged_attention_gpu
from rl_jax.sampler import sampling

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
LAYER_MODES = ("unrolled", "scan")
NULL_PAGE = 0  # absorbs the writes of idle slots (page_table.NULL_PAGE)


class DecodeState(NamedTuple):
  """Everything a decode step reads and writes; lives on the sampler mesh.

  k_pages / v_pages: a tuple of num_layers [k, n, p, d] arrays (layers unrolled) or
  one [l, k, n, p, d] array (layers scanned).
  """
  k_pages: jax.Array | tuple
  v_pages: jax.Array | tuple
  page_table_bm: jax.Array  # int32 page ids, NULL_PAGE where unused
  lengths_b: jax.Array  # int32 tokens in the cache = position of tokens_b
  tokens_b: jax.Array  # int32 next input token (K/V not yet cached)
  active_b: jax.Array  # bool
  generated_b: jax.Array  # int32 tokens sampled since insert
  max_new_b: jax.Array  # int32 sampling budget
  stop_on_eos_b: jax.Array  # bool: a stop id ends the sequence
  keys_br: jax.Array  # uint32 [b, 2] raw threefry key per request (sampling.request_key)
  temperature_b: jax.Array  # float32, <= 0 greedy
  top_k_b: jax.Array  # int32, 0 off
  top_p_b: jax.Array  # float32, 1 off


class StepOutput(NamedTuple):
  """What one generate call returns for the host, per step s and slot b."""
  tokens_sb: jax.Array  # int32 sampled token
  logprobs_sb: jax.Array  # float32 behaviour log-prob of that token
  valid_sb: jax.Array  # bool: the slot was decoding at that step
  finish_sb: jax.Array  # int32 FINISH_NONE | FINISH_STOP | FINISH_LENGTH
  generated_b: jax.Array  # int32 tokens sampled since insert, after the call


def resolve_layers(mode: str) -> str:
  """"auto" -> "unrolled" (the lean per-step program on every backend measured: 3.4x
  faster than a scanned step on an H200, and no slower on CPU); else mode itself."""
  if mode == "auto":
    return "unrolled"
  if mode not in LAYER_MODES:
    raise ValueError(f"sampler.layers must be auto, unrolled or scan, got {mode!r}")
  return mode


def resolve_attention(impl: str, backend: str | None = None) -> str:
  """"auto" -> "pallas_tpu" on TPU (JAX's Pallas paged-attention kernel), else "jnp"
  (a page-table gather at the [k, n, p, d] layout); "pallas_gpu" only where it can run
  (else paged_attention_gpu.KernelUnavailableError, one line)."""
  if impl == "auto":
    return "pallas_tpu" if (backend or jax.default_backend()) == "tpu" else "jnp"
  if impl not in ATTENTION:
    raise ValueError(f"sampler.attention must be one of auto, {', '.join(ATTENTION)}, "
                     f"got {impl!r}")
  if impl == "pallas_gpu":
    paged_attention_gpu.check_backend(backend)
  return impl


def paged_attention_jnp(q_bhd, k_pages_knpd, v_pages_knpd, page_table_bw, kv_len_b):
  """softmax(q k^T / sqrt(d)) v over the first kv_len_b positions of each slot's pages.

  Reads the w pages of `page_table_bw` per slot (a gather at the [k, b, w p, d] layout);
  scores and softmax in float32; out_bhd in the pools' dtype.
  """
  b, h, d = q_bhd.shape
  kh, _, p, _ = k_pages_knpd.shape
  w = page_table_bw.shape[1]
  q_bkgd = q_bhd.astype(k_pages_knpd.dtype).reshape(b, kh, h // kh, d)
  k_kbsd = k_pages_knpd[:, page_table_bw].reshape(kh, b, w * p, d)
  v_kbsd = v_pages_knpd[:, page_table_bw].reshape(kh, b, w * p, d)
  scores_bkgs = jnp.einsum("bkgd,kbsd->bkgs", q_bkgd, k_kbsd,
                           preferred_element_type=jnp.float32) * (d ** -0.5)
  live_bs = jnp.arange(w * p)[None] < kv_len_b[:, None]
  scores_bkgs = jnp.where(live_bs[:, None, None], scores_bkgs, jnp.finfo(jnp.float32).min)
  probs_bkgs = jax.nn.softmax(scores_bkgs, axis=-1).astype(v_kbsd.dtype)
  out_bkgd = jnp.einsum("bkgs,kbsd->bkgd", probs_bkgs, v_kbsd)
  return out_bkgd.reshape(b, h, d)


def paged_attention_pallas_tpu(q_bhd, k_pages_knpd, v_pages_knpd, page_table_bw, kv_len_b):
  """The same attention through jax.experimental.pallas.ops.tpu.paged_attention (TPU
  only; on CPU it runs under pltpu.force_tpu_interpret_mode, which tests use). The
  kernel does not scale q, so q is scaled by 1/sqrt(d) first."""
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
  d = q_bhd.shape[-1]
  w = page_table_bw.shape[1]
  block = max(c for c in (1, 2, 4, 8) if w % c == 0)
  q_bhd = (q_bhd.astype(jnp.float32) * d ** -0.5).astype(k_pages_knpd.dtype)
  return paged_attention(q_bhd, k_pages_knpd, v_pages_knpd, kv_len_b.astype(jnp.int32),
                         page_table_bw.astype(jnp.int32), pages_per_compute_block=block)


def ragged_attention_jnp(q_bhd, k_pages_knpd, v_pages_knpd, live_page_u, live_slot_u,
                         live_col_u, kv_len_b):
  """The same attention reading only the u live (slot, page) pairs of this call.

  live_slot_u / live_col_u list, slot by slot, the page-table columns each busy slot
  uses (padding: col -1); live_page_u are their page ids. Scores per page, then a
  softmax per slot through segment max / sum over the pages of each slot, so KV traffic
  is the live pages, not slots x width.
  """
  b, h, d = q_bhd.shape
  kh, _, p, _ = k_pages_knpd.shape
  q_ukgd = q_bhd.astype(k_pages_knpd.dtype).reshape(b, kh, h // kh, d)[live_slot_u]
  k_kupd = k_pages_knpd[:, live_page_u]
  v_kupd = v_pages_knpd[:, live_page_u]
  scores_ukgp = jnp.einsum("ukgd,kupd->ukgp", q_ukgd, k_kupd,
                           preferred_element_type=jnp.float32) * (d ** -0.5)
  pos_up = live_col_u[:, None] * p + jnp.arange(p)[None]
  live_up = (live_col_u[:, None] >= 0) & (pos_up < kv_len_b[live_slot_u][:, None])
  scores_ukgp = jnp.where(live_up[:, None, None], scores_ukgp, jnp.finfo(jnp.float32).min)
  max_bkg = jax.ops.segment_max(scores_ukgp.max(-1), live_slot_u, num_segments=b)
  exp_ukgp = jnp.where(live_up[:, None, None],
                       jnp.exp(scores_ukgp - max_bkg[live_slot_u][..., None]), 0.0)
  sum_bkg = jax.ops.segment_sum(exp_ukgp.sum(-1), live_slot_u, num_segments=b)
  out_ukgd = jnp.einsum("ukgp,kupd->ukgd", exp_ukgp.astype(v_kupd.dtype), v_kupd,
                        preferred_element_type=jnp.float32)
  out_bkgd = jax.ops.segment_sum(out_ukgd, live_slot_u, num_segments=b)
  out_bkgd = out_bkgd / jnp.maximum(sum_bkg, jnp.finfo(jnp.float32).tiny)[..., None]
  return out_bkgd.astype(v_kupd.dtype).reshape(b, h, d)


def _ragged(q_bhd, k_pages_knpd, v_pages_knpd, live, kv_len_b):
  return ragged_attention_jnp(q_bhd, k_pages_knpd, v_pages_knpd, *live, kv_len_b)


# The one dispatch point of decode attention (sampler.attention names its key):
# attention(q_bhd, k_pages_knpd, v_pages_knpd, pages, kv_len_b) -> out_bhd, where pages is
# the [b, w] page table, or (live_page_u, live_slot_u, live_col_u) for "ragged".
ATTENTION = {"jnp": paged_attention_jnp, "pallas_tpu": paged_attention_pallas_tpu,
             "pallas_gpu": paged_attention_gpu.paged_attention, "ragged": _ragged}
ATTENTION_IMPLS = tuple(ATTENTION)


def pool_dtype(kv_dtype, backend: str | None = None):
  """Storage dtype of the K/V pools: `kv_dtype`, but bfloat16 on CPU is stored as its
  uint16 bits. XLA's CPU backend upcasts the whole operand of a bf16 scatter to float32
  and back (and a bitcast around the scatter is a pool-sized copy too), so every KV
  write cost two passes over the pool and a pool-sized f32 temporary: a call's time and
  memory grew with the pool. A uint16 scatter is in place."""
  kv_dtype = jnp.dtype(kv_dtype)
  if kv_dtype == jnp.bfloat16 and (backend or jax.default_backend()) == "cpu":
    return jnp.dtype(jnp.uint16)
  return kv_dtype


def pool_view(pool):
  """The K/V values of a pool (uint16 storage read as bfloat16; fused into the reads)."""
  return lax.bitcast_convert_type(pool, jnp.bfloat16) if pool.dtype == jnp.uint16 else pool


def pool_set(pool, index, values, **at_kw):
  """pool.at[index].set(values) in the pool's storage dtype (pool_dtype): in place when
  the pool is donated; `index` as np.s_ writes it."""
  if pool.dtype == jnp.uint16 and values.dtype != jnp.uint16:
    values = lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)
  return pool.at[index].set(values.astype(pool.dtype), **at_kw)


def _layer_attend(k_pages, v_pages, layer, *, attention: Callable, pages, kv_len_b,
                  write_page_b, write_slot_b):
  """attend(q, k, v) for model.layer_forward: writes k/v at (page, slot) of this layer's
  pool (a [k, n, p, d] array, or the stacked pool at index `layer`), then attends."""
  def attend(q_b1hd, k_b1kd, v_b1kd):
    k_bkd, v_bkd = k_b1kd[:, 0], v_b1kd[:, 0]
    if layer is None:
      k_new = pool_set(k_pages, np.s_[:, write_page_b, write_slot_b], k_bkd.transpose(1, 0, 2))
      v_new = pool_set(v_pages, np.s_[:, write_page_b, write_slot_b], v_bkd.transpose(1, 0, 2))
      k_read, v_read = k_new, v_new
    else:
      k_new = pool_set(k_pages, np.s_[layer, :, write_page_b, write_slot_b], k_bkd)
      v_new = pool_set(v_pages, np.s_[layer, :, write_page_b, write_slot_b], v_bkd)
      k_read = lax.dynamic_index_in_dim(k_new, layer, keepdims=False)
      v_read = lax.dynamic_index_in_dim(v_new, layer, keepdims=False)
    out_bhd = attention(q_b1hd[:, 0], pool_view(k_read), pool_view(v_read), pages, kv_len_b)
    return out_bhd[:, None], (k_new, v_new)
  return attend


def layer_params(params, i: int) -> dict:
  """Layer i's weights. params["layers"] is a tuple of per-layer dicts (the sampler's
  layout with unrolled layers, Engine.load_params: each weight its own buffer) or a dict
  of stacked [l, ...] arrays, whose slice x[i] XLA materialises: a copy of every layer
  weight per decode step (2 x 1.43 GB per step for Qwen2.5-0.5B in fp32 on CPU)."""
  layers = params["layers"]
  if isinstance(layers, (tuple, list)):
    return layers[i]
  return jax.tree.map(lambda x: x[i], layers)


def unstack_layers(params) -> dict:
  """params with params["layers"] as a tuple of per-layer dicts (layer_params)."""
  layers = params["layers"]
  if isinstance(layers, (tuple, list)):
    return params
  n = jax.tree.leaves(layers)[0].shape[0]
  return {**params, "layers": tuple(jax.tree.map(lambda x, i=i: x[i], layers)
                                    for i in range(n))}


def stack_layers(params) -> dict:
  """params with stacked [l, ...] layers (model.forward's layout; a copy when given
  per-layer weights)."""
  layers = params["layers"]
  if not isinstance(layers, (tuple, list)):
    return params
  return {**params, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def run_layers(model_cfg, params, x_bte, cos_btd, sin_btd, k_pages, v_pages, attend_at, *,
               layers: str):
  """(x_bte, k_pages, v_pages) after every layer; attend_at(k_pages, v_pages, layer)
  returns the layer's attend function, which writes K/V into the pools (one layer's
  [k, n, p, d] pool with layer None, else the stacked pools at index `layer`)."""
  if layers == "unrolled":
    k_list, v_list = list(k_pages), list(v_pages)
    for i in range(model_cfg.num_layers):
      x_bte, (k_list[i], v_list[i]) = tfm.layer_forward(
          model_cfg, layer_params(params, i), x_bte, cos_btd, sin_btd,
          attend_at(k_list[i], v_list[i], None))
    return x_bte, tuple(k_list), tuple(v_list)

  def body(carry, lp):
    x, k_all, v_all, layer = carry
    x, (k_all, v_all) = tfm.layer_forward(model_cfg, lp, x, cos_btd, sin_btd,
                                            attend_at(k_all, v_all, layer))
    return (x, k_all, v_all, layer + 1), None
  (x_bte, k_pages, v_pages, _), _ = lax.scan(
      body, (x_bte, k_pages, v_pages, jnp.int32(0)), stack_layers(params)["layers"])
  return x_bte, k_pages, v_pages


def embed_positions(model_cfg, params, tokens_bt, pos_bt):
  """(x_bte, cos_btd, sin_btd) in the model dtype: token embeddings and RoPE tables."""
  dtype = jnp.dtype(model_cfg.dtype)
  x_bte = jnp.take(params["embed"], tokens_bt, axis=0, mode="clip").astype(dtype)
  cos_btd, sin_btd = tfm.rope_tables(pos_bt, tfm.rope_inv_freq(model_cfg))
  return x_bte, cos_btd.astype(dtype), sin_btd.astype(dtype)


def decode_logits(model_cfg, params, tokens_b, pos_b, k_pages, v_pages, *, pages,
                  write_page_b, layers: str, attention: str):
  """(logits_bv float32, k_pages, v_pages): one token per slot through every layer.

  tokens_b sit at positions pos_b; their K/V go to (write_page_b, pos_b % p). `pages`
  is what the attention reads: the [b, w] page table, or the live triple for "ragged".
  """
  p = (k_pages[0] if layers == "unrolled" else k_pages).shape[-2]
  x_b1e, cos_b1d, sin_b1d = embed_positions(model_cfg, params, tokens_b[:, None],
                                            pos_b[:, None])
  attend_at = functools.partial(
      _layer_attend, attention=ATTENTION[attention], pages=pages,
      kv_len_b=pos_b + 1, write_page_b=write_page_b, write_slot_b=pos_b % p)
  x_b1e, k_pages, v_pages = run_layers(model_cfg, params, x_b1e, cos_b1d, sin_b1d,
                                       k_pages, v_pages, attend_at, layers=layers)
  return tfm.lm_logits(model_cfg, params, x_b1e)[:, 0], k_pages, v_pages


def decode_step(state: DecodeState, *, model_cfg, params, stop_ids, layers, attention,
                truncate=True, live=None):
  """One token for every slot: (new state, (tokens_b, logprobs_b, valid_b, finish_b)).

  state.page_table_bm may be a prefix of the columns (width w): a busy slot's position
  must fall in its first w pages. With attention "ragged", live = (live_slot_u,
  live_col_u) lists every page column a busy slot may read in this call. truncate:
  the sampling variant (sampling.sample_tokens); False when no slot truncates.
  """
  pos_b = state.lengths_b
  p = (state.k_pages[0] if layers == "unrolled" else state.k_pages).shape[-2]
  w = state.page_table_bm.shape[1]
  col_b = jnp.minimum(pos_b // p, w - 1)
  page_b = jnp.take_along_axis(state.page_table_bm, col_b[:, None], axis=1)[:, 0]
  page_b = jnp.where(state.active_b, page_b, NULL_PAGE)
  pages = state.page_table_bm
  if attention == "ragged":
    slot_u, col_u = live
    pages = (state.page_table_bm[slot_u, jnp.maximum(col_u, 0)], slot_u, col_u)
  logits_bv, k_pages, v_pages = decode_logits(
      model_cfg, params, state.tokens_b, pos_b, state.k_pages, state.v_pages,
      pages=pages, write_page_b=page_b, layers=layers, attention=attention)

  tokens_b, logprobs_b = sampling.sample_tokens(
      logits_bv=logits_bv, keys_br=sampling.step_keys(state.keys_br, pos_b),
      temperature_b=state.temperature_b, top_k_b=state.top_k_b, top_p_b=state.top_p_b,
      truncate=truncate)

  valid_b = state.active_b
  generated_b = state.generated_b + valid_b
  hit_stop_b = jnp.zeros_like(valid_b)
  for stop_id in stop_ids:
    hit_stop_b |= tokens_b == stop_id
  stop_b = valid_b & state.stop_on_eos_b & hit_stop_b
  length_b = valid_b & ~stop_b & (generated_b >= state.max_new_b)
  finish_b = jnp.where(stop_b, FINISH_STOP, jnp.where(length_b, FINISH_LENGTH, FINISH_NONE))
  new_state = state._replace(
      k_pages=k_pages, v_pages=v_pages,
      lengths_b=state.lengths_b + valid_b,
      tokens_b=jnp.where(valid_b, tokens_b, state.tokens_b),
      active_b=valid_b & ~stop_b & ~length_b,
      generated_b=generated_b)
  return new_state, (tokens_b, logprobs_b, valid_b, finish_b.astype(jnp.int32))


POOL_FIELDS = ("k_pages", "v_pages")
SLOT_FIELDS = tuple(f for f in DecodeState._fields if f not in POOL_FIELDS)


def generate(params, state: DecodeState, live=None, *, num_slots: int, num_pages: int,
             steps: int, **step_kw) -> tuple[DecodeState, StepOutput]:
  """`steps` decode steps over slots [0, num_slots) reading page-table columns
  [0, num_pages): with the KV in pages, a smaller batch or a shorter context is just a
  slice of the per-slot registers and page tables. The pools are written in place.
  `live`: the (live_slot_u, live_col_u) lists of "ragged" attention, else None."""
  sub = state._replace(**{f: getattr(state, f)[:num_slots] for f in SLOT_FIELDS})
  sub = sub._replace(page_table_bm=sub.page_table_bm[:, :num_pages])
  step = functools.partial(decode_step, params=params, live=live, **step_kw)
  sub, (tokens_sb, logprobs_sb, valid_sb, finish_sb) = lax.scan(
      lambda s, _: step(s), sub, None, length=steps)
  written = [f for f in SLOT_FIELDS if f != "page_table_bm"]  # decode never edits tables
  new_state = state._replace(
      k_pages=sub.k_pages, v_pages=sub.v_pages,
      **{f: getattr(state, f).at[:num_slots].set(getattr(sub, f)) for f in written})
  return new_state, StepOutput(tokens_sb, logprobs_sb, valid_sb, finish_sb, sub.generated_b)

"""The prefill lane: prompts prefilled inside the Generator's one program per pass
(updates.apply_and_generate), before the pass's inserts copy their template pages.

Shape letters: L lane tokens, l layers, k kv heads, h query heads, d head_dim, e embed,
n pages in the pool, p tokens per page, m pages per sequence.

The lane is a fixed number of token positions (Engine.prefill_lane). The cached tokens
of each prompt (all but its last, which is the first decode input) are packed one prompt
after another, each token with its position in its prompt, its prompt's index in the
lane (the segment) and the page that holds that position. One forward over the lane
attends causally within each segment (lane_attention: the splash kernel's segment ids
on TPU, a dense segment mask on the XLA path), so packed prompts never see each other,
and scatters every token's K/V into its page; padding tokens form segment -1 and write
to the null page. Prompts that do not fit go through Engine.prefill_into_pages instead.
Two lane sizes (`sizes`) mean at most two extra programs per (slot bucket, width bucket)
pair, whatever the prompt lengths.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.model import attention
from rl_jax.model import transformer as tfm
from rl_jax.sampler import decode
from rl_jax.sampler import page_table as pt

FIELDS = 4  # token, position, segment, page


def default_tokens(max_prefill_length: int) -> int:
  """Engine.prefill_lane when not given: room for two of the longest prompts."""
  return 2 * int(max_prefill_length)


def sizes(lane: int) -> tuple[int, ...]:
  """The lane sizes a fused call may take, the smallest that holds a pass's prompts:
  a quarter lane (most passes start few prompts) and the whole lane. The lane's bytes
  grow with its size (weights and the KV scatters are fixed, the activations and
  the L x L attention scale), so a short pass need not pay for the whole lane."""
  return tuple(sorted({max(1, int(lane) // 4), int(lane)}))


class Lane(NamedTuple):
  """A packed lane (int32 [L] each); from `pack`, or traced from a packed vector."""
  token_L: jax.Array | np.ndarray
  pos_L: jax.Array | np.ndarray
  seg_L: jax.Array | np.ndarray
  page_L: jax.Array | np.ndarray


def pack(out_fL: np.ndarray, prompts: Sequence, pages: Sequence, page_size: int) -> None:
  """Writes the lane of `prompts` (their cached tokens) into out_fL (int32 [4, L], from
  `empty_rows`), each prompt's position j to page pages[i][j // page_size]."""
  at = 0
  for i, (prompt, pg) in enumerate(zip(prompts, pages)):
    n = len(prompt) - 1
    pos = np.arange(n)
    out_fL[0, at:at + n] = prompt[:-1]
    out_fL[1, at:at + n] = pos
    out_fL[2, at:at + n] = i
    out_fL[3, at:at + n] = np.asarray(pg, np.int32)[pos // page_size]
    at += n


def empty_rows(lane: int) -> np.ndarray:
  """int32 [4, L]: an all-padding lane (segment -1, null page)."""
  out = np.zeros((FIELDS, lane), np.int32)
  out[2] = -1
  out[3] = pt.NULL_PAGE
  return out


def lane_attention(q_1Lhd, k_1Lkd, v_1Lkd, seg_L, *, implementation: str):
  """Causal attention within each segment of the lane; out_1Lhd in v's dtype.

  implementation (model.attention.select of the model's `attention`): "splash" runs
  the Pallas splash kernel with the segments as its segment ids (TPU; interpret mode
  elsewhere); anything else the XLA path, float32 scores under a dense [L, L] mask of
  causal & same-segment (transformer.causal_attention).
  """
  if implementation == "splash":
    return attention.splash_causal_attention(q_1Lhd, k_1Lkd, v_1Lkd, seg_L[None])
  mask_1LL = (seg_L[:, None] == seg_L[None, :])[None]
  return tfm.causal_attention(q_1Lhd, k_1Lkd, v_1Lkd, mask_1LL)


def _lane_attend(k_pages, v_pages, layer, *, seg_L, implementation, page_L, slot_L):
  """attend(q, k, v): causal attention within each segment of the lane, and the lane's
  K/V written to (page_L, slot_L) of this layer's pool (or the stacked pools at
  `layer`)."""
  def attend(q_1Lhd, k_1Lkd, v_1Lkd):
    out_1Lhd = lane_attention(q_1Lhd, k_1Lkd, v_1Lkd, seg_L, implementation=implementation)
    k_Lkd, v_Lkd = k_1Lkd[0], v_1Lkd[0]
    if layer is None:
      k_new = decode.pool_set(k_pages, np.s_[:, page_L, slot_L], k_Lkd.transpose(1, 0, 2))
      v_new = decode.pool_set(v_pages, np.s_[:, page_L, slot_L], v_Lkd.transpose(1, 0, 2))
    else:
      k_new = decode.pool_set(k_pages, np.s_[layer, :, page_L, slot_L], k_Lkd)
      v_new = decode.pool_set(v_pages, np.s_[layer, :, page_L, slot_L], v_Lkd)
    return out_1Lhd, (k_new, v_new)
  return attend


def write(params, state: decode.DecodeState, lane: Lane, *, model_cfg,
          layers: str) -> decode.DecodeState:
  """`state` with the lane's K/V written into its pages (every layer)."""
  p = (state.k_pages[0] if layers == "unrolled" else state.k_pages).shape[-2]
  x_1Le, cos_1Ld, sin_1Ld = decode.embed_positions(model_cfg, params, lane.token_L[None],
                                                   lane.pos_L[None])
  implementation = attention.select(
      model_cfg.attention, jnp.dtype(model_cfg.dtype), jax.default_backend(),
      (lane.token_L.shape[0], model_cfg.num_heads, model_cfg.num_kv_heads,
       model_cfg.head_dim)).name

  def attend_at(k_pages, v_pages, layer):
    return _lane_attend(k_pages, v_pages, layer, seg_L=lane.seg_L,
                        implementation=implementation, page_L=lane.page_L,
                        slot_L=lane.pos_L % p)

  # Only the K/V are used: XLA drops the last layer's MLP (unrolled layers).
  _, k_pages, v_pages = decode.run_layers(model_cfg, params, x_1Le, cos_1Ld, sin_1Ld,
                                          state.k_pages, state.v_pages, attend_at,
                                          layers=layers)
  return state._replace(k_pages=k_pages, v_pages=v_pages)

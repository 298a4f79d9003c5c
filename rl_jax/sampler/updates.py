"""Slot register and page-table updates of the paged engine's DecodeState (engine.py jits
them): start sequences (with copy-on-write of a partial prompt page), replace page-table
rows, free slots and move sequences between slots.

Shape letters: b decode slots, i inserted sequences (padded), m pages per sequence.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.sampler import decode
from rl_jax.sampler import page_table as pt


class InsertBatch(NamedTuple):
  """Host-side description of sequences to start, padded to max_concurrent_decodes rows.

  Padding rows have slot == max_concurrent_decodes (dropped on device) and copy the null
  page onto itself.
  """
  slot_i: np.ndarray  # int32
  page_table_im: np.ndarray  # int32
  copy_src_i: np.ndarray  # int32 page to copy into copy_dst_i (copy-on-write)
  copy_dst_i: np.ndarray  # int32
  token_i: np.ndarray  # int32 last prompt token
  length_i: np.ndarray  # int32 cached prompt tokens (prompt length - 1)
  max_new_i: np.ndarray  # int32
  stop_on_eos_i: np.ndarray  # bool
  seed_i: np.ndarray  # int32
  sample_index_i: np.ndarray  # int32
  temperature_i: np.ndarray  # float32
  top_k_i: np.ndarray  # int32
  top_p_i: np.ndarray  # float32


def _move_slots(state, src_i, dst_i):
  """Move sequences from slots src_i to slots dst_i (registers and page tables only)."""
  moved = {f: getattr(state, f).at[dst_i].set(getattr(state, f)[src_i], mode="drop")
           for f in decode.SLOT_FIELDS}
  moved["active_b"] = moved["active_b"].at[src_i].set(False, mode="drop")
  return state._replace(**moved)


def _insert(state, ins: InsertBatch):
  # Copy-on-write of the partial last prompt page: every new sequence writes its own
  # tokens after the prompt, so it gets a private copy before its first step.
  def copy(pool):  # pool [..., n, p, d]
    return pool.at[..., ins.copy_dst_i, :, :].set(pool[..., ins.copy_src_i, :, :])

  k_pages, v_pages = jax.tree.map(copy, state.k_pages), jax.tree.map(copy, state.v_pages)
  keys_ir = jax.vmap(lambda seed, j: jax.random.key_data(
      jax.random.fold_in(jax.random.key(seed), j)))(ins.seed_i, ins.sample_index_i)

  def put(x, v):
    return x.at[ins.slot_i].set(v.astype(x.dtype), mode="drop")

  return state._replace(
      k_pages=k_pages, v_pages=v_pages,
      page_table_bm=put(state.page_table_bm, ins.page_table_im),
      lengths_b=put(state.lengths_b, ins.length_i),
      tokens_b=put(state.tokens_b, ins.token_i),
      active_b=put(state.active_b, jnp.ones_like(ins.slot_i, bool)),
      generated_b=put(state.generated_b, jnp.zeros_like(ins.slot_i)),
      max_new_b=put(state.max_new_b, ins.max_new_i),
      stop_on_eos_b=put(state.stop_on_eos_b, ins.stop_on_eos_i),
      keys_br=put(state.keys_br, keys_ir),
      temperature_b=put(state.temperature_b, ins.temperature_i),
      top_k_b=put(state.top_k_b, ins.top_k_i),
      top_p_b=put(state.top_p_b, ins.top_p_i))


def _free_slots(state, slot_i):
  m = state.page_table_bm.shape[1]
  return state._replace(
      active_b=state.active_b.at[slot_i].set(False, mode="drop"),
      page_table_bm=state.page_table_bm.at[slot_i].set(
          jnp.full((slot_i.shape[0], m), pt.NULL_PAGE, jnp.int32), mode="drop"))


def _set_page_rows(state, slot_i, page_table_im):
  return state._replace(
      page_table_bm=state.page_table_bm.at[slot_i].set(page_table_im, mode="drop"))



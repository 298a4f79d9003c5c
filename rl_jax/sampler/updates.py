"""Slot register and page-table updates of the paged engine's DecodeState, staged on the
host and applied on device in one program: alone (Engine.insert_many, set_page_rows,
free_slots, move_slots) or fused in front of a generate call (Engine.apply_and_generate,
the Generator's one dispatch per scheduling pass).

Shape letters: b decode slots, u update rows (inserts or page-table rows, padded), m
pages per sequence (page-table width), c insert columns, s decode steps per call, k
slots a generate call covers, n pages in the pool, r words of a raw PRNG key.

`Pending` keeps the updates of a pass in a canonical form keyed by the slot each one
ends in, so any sequence of insert / set_rows / free / move calls becomes one update:
  src_b  the slot whose registers slot b takes (b itself unless a move landed there);
  off_b  slot b stops decoding and its page table points at the null page (a free, or
         the slot a sequence moved away from);
  inserts  (u rows) the registers of a starting sequence (token, length, budget,
         sampling, the PRNG key of (seed, sample_index), computed on the host by
         sampling.request_key) and a copy-on-write page copy;
  rows   (u rows) the full page-table row of a slot (an insert or a grown sequence).
On device, in this order: gather every register by src_b, apply off_b, scatter the
inserts, scatter the rows, copy pages. A free cancels a pending insert of its slot (and
its page copy), so a page it released may be reused in the same pass.

Everything travels as one int32 vector (float fields as their bits; padding rows name
slot b and copy into page n, both dropped by the scatters): one host-to-device transfer
per pass. `pack_output` likewise returns a generate call's outputs as one int32 array.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rl_jax.sampler import decode
from rl_jax.sampler import page_table as pt
from rl_jax.sampler import prefill_lane
from rl_jax.sampler import sampling

# Columns of one insert row.
INSERT_COLUMNS = ("slot", "token", "length", "max_new_tokens", "stop_on_eos", "key0",
                  "key1", "temperature", "top_k", "top_p", "copy_src", "copy_dst")
_COL = {name: i for i, name in enumerate(INSERT_COLUMNS)}


def _f32_bits(x: float) -> int:
  return int(np.asarray(x, np.float32).view(np.int32))


_F32_ONE = _f32_bits(1.0)  # (a positive float's bits compare as the float: > 0 iff > 0.0)


class Layout(NamedTuple):
  """Static shape of a packed update: b slots, u rows per list, m page-table columns,
  n pages in the pool (the drop target of padding copies), L prefill-lane tokens (0:
  no lane) and p tokens per page."""
  num_slots: int
  rows: int
  width: int
  num_pages: int
  lane: int = 0
  page_size: int = 1

  @property
  def size(self) -> int:
    b, u, m = self.num_slots, self.rows, self.width
    return 2 * b + u * len(INSERT_COLUMNS) + u * (m + 1) + prefill_lane.FIELDS * self.lane

  def split(self, v):
    """(src_b, off_b, inserts_uc, rows_u(m+1), lane_4L) views of a packed vector."""
    b, u, m = self.num_slots, self.rows, self.width
    c = len(INSERT_COLUMNS)
    ins_end = 2 * b + u * c
    rows_end = ins_end + u * (m + 1)
    return (v[:b], v[b:2 * b], v[2 * b:ins_end].reshape(u, c),
            v[ins_end:rows_end].reshape(u, m + 1),
            v[rows_end:rows_end + prefill_lane.FIELDS * self.lane].reshape(
                prefill_lane.FIELDS, self.lane))

  def empty(self) -> np.ndarray:
    """The packed vector of no update (read-only; pack copies it)."""
    return _empty(self)


@functools.lru_cache(maxsize=None)
def _empty(layout: Layout) -> np.ndarray:
  v = np.zeros((layout.size,), np.int32)
  src_b, _, ins_uc, rows_uc, lane_4L = layout.split(v)
  src_b[:] = np.arange(layout.num_slots)
  lane_4L[:] = prefill_lane.empty_rows(layout.lane)
  ins_uc[:, _COL["slot"]] = layout.num_slots
  ins_uc[:, _COL["copy_src"]] = pt.NULL_PAGE
  ins_uc[:, _COL["copy_dst"]] = layout.num_pages
  rows_uc[:, 0] = layout.num_slots
  v.flags.writeable = False
  return v


class Pending:
  """Updates staged on the host for one apply (see the module docstring).

  insert(entry): entry as Engine.insert_many takes it (slot, pages, token, length,
  max_new_tokens, stop_on_eos, seed, sample_index, sampling, optional copy=(src, dst)).
  prefill(prompt, pages): the prompt's cached tokens go to the prefill lane of the
  fused call if they fit in its `lane_tokens` (prefill_lane.py), written before the
  inserts copy any page.
  """

  def __init__(self, num_slots: int, lane_tokens: int = 0):
    self.num_slots = int(num_slots)
    self.lane_tokens = int(lane_tokens)
    self.clear()

  def clear(self) -> None:
    self.src: dict[int, int] = {}  # slot -> slot whose registers it takes
    self.off: set[int] = set()
    self.ins: dict[int, list] = {}  # slot -> insert row (INSERT_COLUMNS)
    self.rows: dict[int, object] = {}  # slot -> its page ids
    self.lane: list[tuple[np.ndarray, object]] = []  # (prompt, pages) in the lane
    self.lane_used = 0

  def __bool__(self) -> bool:
    return bool(self.src or self.off or self.ins or self.rows or self.lane)

  def prefill(self, prompt, pages) -> bool:
    """Stage a prompt in the prefill lane; False (nothing staged) if it does not fit."""
    n = len(prompt) - 1
    if self.lane_used + n > self.lane_tokens:
      return False
    self.lane.append((np.asarray(prompt, np.int32), pages))
    self.lane_used += n
    return True

  def _check(self, slot) -> int:
    slot = int(slot)
    if not 0 <= slot < self.num_slots:
      raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")
    return slot

  def insert(self, entry: dict) -> None:
    slot = self._check(entry["slot"])
    s = entry["sampling"]
    copy = entry.get("copy")
    self.src.pop(slot, None)
    self.off.discard(slot)
    key0, key1 = sampling.request_key(int(np.int64(entry["seed"]) % (2 ** 31)),
                                      int(entry["sample_index"])).view(np.int32).tolist()
    self.ins[slot] = [
        slot, int(entry["token"]), int(entry["length"]), int(entry["max_new_tokens"]),
        int(bool(entry["stop_on_eos"])), key0, key1, _f32_bits(s.temperature), int(s.top_k),
        _f32_bits(s.top_p), int(copy[0]) if copy else pt.NULL_PAGE,
        int(copy[1]) if copy else -1]  # -1: no copy (the pool size, set when packed)
    self.rows[slot] = entry["pages"]

  def take_lane(self) -> list:
    """The staged lane prompts [(prompt, pages)], removed from this update."""
    lane, self.lane, self.lane_used = self.lane, [], 0
    return lane

  def set_rows(self, slot: int, pages) -> None:
    self.rows[self._check(slot)] = pages

  def free(self, slot: int) -> None:
    slot = self._check(slot)
    self.src.pop(slot, None)
    self.ins.pop(slot, None)
    self.rows.pop(slot, None)
    self.off.add(slot)

  def move(self, src: int, dst: int) -> None:
    """The sequence in slot `src` continues in slot `dst` (its pages stay)."""
    src, dst = self._check(src), self._check(dst)
    if src == dst:
      return
    origin = self.src.pop(src, src)
    if origin == dst:
      self.src.pop(dst, None)
    else:
      self.src[dst] = origin
    for staged in (self.ins, self.rows):
      if src in staged:
        staged[dst] = staged.pop(src)
      else:
        staged.pop(dst, None)
    if dst in self.ins:
      self.ins[dst][_COL["slot"]] = dst
    if src in self.off:
      self.off.add(dst)
    else:
      self.off.discard(dst)
    self.off.add(src)

  def truncates(self) -> bool:
    """Whether a staged insert samples with top-k or top-p (temperature > 0)."""
    return any(r[_COL["temperature"]] > 0 and (r[_COL["top_k"]] > 0 or
                                               r[_COL["top_p"]] != _F32_ONE)
               for r in self.ins.values())

  def fits(self, layout: Layout) -> bool:
    return (len(self.ins) <= layout.rows and len(self.rows) <= layout.rows and
            self.lane_used <= layout.lane)

  def pack(self, layout: Layout) -> np.ndarray:
    """The int32 vector `apply` reads; raises if the updates exceed layout.rows."""
    if not self.fits(layout):
      raise ValueError(f"{len(self.ins)} inserts, {len(self.rows)} page rows and "
                       f"{self.lane_used} lane tokens exceed this update's {layout.rows} "
                       f"rows and {layout.lane} lane tokens")
    v = layout.empty().copy()
    src_b, off_b, ins_uc, rows_uc, lane_4L = layout.split(v)
    if self.lane:
      prefill_lane.pack(lane_4L, [x for x, _ in self.lane], [pg for _, pg in self.lane],
                        layout.page_size)
    for dst, s in self.src.items():
      src_b[dst] = s
    if self.off:
      off_b[list(self.off)] = 1
    if self.ins:
      ins = np.asarray(list(self.ins.values()), np.int32)
      ins[ins[:, _COL["copy_dst"]] < 0, _COL["copy_dst"]] = layout.num_pages
      ins_uc[:len(ins)] = ins
    for i, (slot, pages) in enumerate(self.rows.items()):
      if len(pages) > layout.width:
        raise ValueError(f"sequence owns {len(pages)} pages but the page table holds "
                         f"{layout.width}")
      rows_uc[i, 0] = slot
      rows_uc[i, 1:1 + len(pages)] = pages
    return v


def apply(state: decode.DecodeState, upd_v: jax.Array, *, layout: Layout) -> decode.DecodeState:
  """`state` with a packed update applied (see the module docstring for the order)."""
  src_b, off_b, ins_uc, rows_uc, _ = layout.split(upd_v)
  regs = {f: getattr(state, f)[src_b] for f in decode.SLOT_FIELDS}
  off_b = off_b != 0
  regs["active_b"] = regs["active_b"] & ~off_b
  regs["page_table_bm"] = jnp.where(off_b[:, None], pt.NULL_PAGE, regs["page_table_bm"])

  def col(name):
    return ins_uc[:, _COL[name]]

  slot_u = col("slot")
  keys_ur = lax.bitcast_convert_type(jnp.stack([col("key0"), col("key1")], -1), jnp.uint32)
  new = {"tokens_b": col("token"), "lengths_b": col("length"),
         "active_b": jnp.ones_like(slot_u, bool), "generated_b": jnp.zeros_like(slot_u),
         "max_new_b": col("max_new_tokens"), "stop_on_eos_b": col("stop_on_eos") != 0,
         "keys_br": keys_ur,
         "temperature_b": lax.bitcast_convert_type(col("temperature"), jnp.float32),
         "top_k_b": col("top_k"),
         "top_p_b": lax.bitcast_convert_type(col("top_p"), jnp.float32)}
  for f, v in new.items():
    regs[f] = regs[f].at[slot_u].set(v.astype(regs[f].dtype), mode="drop")
  regs["page_table_bm"] = regs["page_table_bm"].at[rows_uc[:, 0]].set(rows_uc[:, 1:],
                                                                       mode="drop")

  # Copy-on-write of a partial prompt page: each new sequence writes its own tokens
  # after the prompt, so it gets a private copy of the group's template page.
  def copy(pool):  # pool [..., n, p, d]
    return decode.pool_set(pool, np.s_[..., col("copy_dst"), :, :],
                           pool[..., col("copy_src"), :, :], mode="drop")

  return state._replace(k_pages=jax.tree.map(copy, state.k_pages),
                        v_pages=jax.tree.map(copy, state.v_pages), **regs)


def pack_output(out: decode.StepOutput) -> jax.Array:
  """One int32 [4 s + 1, k] array: tokens, log-prob bits, valid, finish, generated."""
  as_i32 = lambda x: x.astype(jnp.int32)
  return jnp.concatenate([
      out.tokens_sb, lax.bitcast_convert_type(out.logprobs_sb, jnp.int32),
      as_i32(out.valid_sb), as_i32(out.finish_sb), out.generated_b[None]], axis=0)


def unpack_output(x: np.ndarray, steps: int) -> decode.StepOutput:
  """The host StepOutput (NumPy views) of pack_output's array."""
  x = np.asarray(x)
  s = steps
  return decode.StepOutput(x[:s], x[s:2 * s].view(np.float32), x[2 * s:3 * s] != 0,
                           x[3 * s:4 * s], x[4 * s])


def apply_and_generate(params, state, upd_v, live=None, *, layout: Layout, **generate_kw):
  """The prefill lane (if layout.lane), apply, then decode.generate, in one program;
  outputs packed (pack_output)."""
  if layout.lane:
    lane = prefill_lane.Lane(*layout.split(upd_v)[4])
    state = prefill_lane.write(params, state, lane, model_cfg=generate_kw["model_cfg"],
                               layers=generate_kw["layers"])
  state = apply(state, upd_v, layout=layout)
  state, out = decode.generate(params, state, live, **generate_kw)
  return state, pack_output(out)

"""The paged-memory half of the Generator: page growth, slot compaction and preemption.

A running sequence takes the pages its next generate call may fill (the call in flight
counted too, since the host reads its tokens one call late), not its worst case; when
the pool runs short the youngest group holding pages is preempted: its running and
parked samples restart from the prompt under a new attempt, and its prompt pages are
returned. Busy sequences are moved into the lowest slots before each call so that the
call covers the smallest slot bucket (registers only: the KV stays in its pages).
"""
from __future__ import annotations

import collections

import numpy as np

from rl_jax.sampler import page_table as pt
from rl_jax.sampler.sequences import GroupState, SeqState


class PagesMixin:
  """Generator methods for pages and slots; they use the Generator's state and belong
  to the sampler thread."""

  def _call_positions(self, seq: SeqState) -> int:
    """Positions `seq`'s cache may hold after the next generate call (and the call in
    flight, whose tokens the host has not seen yet)."""
    calls = 1 + (self._inflight is not None and seq in self._inflight.seqs)
    return min(seq.length + calls * self.engine.steps_per_call, seq.cache_limit)

  def _live_pages(self):
    """(slots, columns) of every page a busy sequence may read in the next call, for
    "ragged" attention (None otherwise)."""
    if self.engine.attention != "ragged":
      return None
    busy = [s for s in self._slots if s is not None]
    counts = [pt.pages_for(self._call_positions(s), self.engine.page_size) for s in busy]
    slots = np.repeat([s.slot for s in busy], counts)
    cols = np.concatenate([np.arange(n) for n in counts])
    return slots, cols

  def _pages_short(self, seq: SeqState) -> int:
    """Pages `seq` lacks for the tokens its next generate call may cache."""
    need = pt.pages_for(self._call_positions(seq), self.engine.page_size)
    return max(need - len(seq.pages), 0)

  def _prefill(self, g: GroupState, batch: list) -> None:
    """Take the group's prompt pages; its prompt joins `batch`, prefilled in one call."""
    g.prefix_pages = self.allocator.allocate(g.num_full + g.partial)
    if g.prefix_pages.size:  # a one-token prompt caches nothing: its token is the first input
      batch.append(g)

  def _release_prefix(self, g: GroupState) -> None:
    if g.prefix_pages is not None:
      self.allocator.release(g.prefix_pages)
      g.prefix_pages = None

  def _grow_pages(self) -> None:
    alloc = self.allocator
    grown = []
    running = sorted((s for s in self._slots if s is not None), key=lambda s: s.group.order)
    for seq in running:
      if self._slots[seq.slot] is not seq:
        continue  # preempted while serving an older sequence
      need = self._pages_short(seq)
      new = alloc.allocate(need) if need > 0 else None
      while need > 0 and new is None:
        self._preempt(max((g for g in self._groups
                           if g.running or g.parked or g.prefix_pages is not None),
                          key=lambda g: g.order))
        if self._slots[seq.slot] is not seq:
          break
        new = alloc.allocate(need)
      if new is not None and self._slots[seq.slot] is seq:
        seq.pages.extend(int(p) for p in new)
        grown.append(seq)
    for seq in grown:
      if self._slots[seq.slot] is seq:
        self._pending.set_rows(seq.slot, seq.pages)

  def _compact(self) -> int:
    """Move busy sequences into the lowest slots so the smallest slot bucket that can
    hold them all does; returns that bucket (the slots the next generate covers)."""
    busy = [i for i, s in enumerate(self._slots) if s is not None]
    want = next(k for k in self.engine.slot_buckets if k >= len(busy))
    high = [i for i in busy if i >= want]
    if high:
      low = [i for i in range(want) if self._slots[i] is None][:len(high)]
      for src, dst in zip(high, low):
        self._pending.move(src, dst)
        seq = self._slots[src]
        seq.slot, self._slots[dst], self._slots[src] = dst, seq, None
    return want

  def _preempt(self, g: GroupState) -> None:
    """Drop the group's running and parked samples (they restart from the prompt, under
    a new attempt) and its pages."""
    seqs = [s for s in self._slots if s is not None and s.group is g]
    for seq in seqs:
      self._pending.free(seq.slot)
      self._slots[seq.slot] = None
      self.allocator.release(seq.pages)
      g.running -= 1
    restarted = [s.sample_index for s in seqs] + self._drop_parked(g)
    if g.attempts is not None:
      for i in restarted:
        g.attempts[i] += 1
    g.waiting = collections.deque(sorted(list(g.waiting) + restarted))
    self._release_prefix(g)
    self.preemptions += 1

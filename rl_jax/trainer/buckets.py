"""Row shapes of the train step: length buckets, row-count buckets, sequence packing.

Shape letters: s sequences (the rows of a padded TrainBatch), r trained rows, t positions
of a trained row (a length bucket), k segments of one row.

Padded rows: sequence s is row s, right padded to the smallest length bucket that fits
the batch's longest sequence (pick_bucket).

Packed rows (trainer.packing): rows of that same length hold whole sequences back to back,
placed longest first into the first row with room (first-fit decreasing). A sequence is
one segment of its row: segment ids 0, 1, ... in placement order, positions restart at 0
in every segment, and the tail of a row after its last segment is padding with the next
id. With num_minibatches n the step trains rows i, i + n, ... together (minibatch i), so
the sequences of padded minibatch i (rows i, i + n, ...) are packed among themselves into
rows i, i + n, ...: every minibatch trains the same sequences as without packing.

Compiles stay bounded: the rows of a minibatch are rounded up by `row_bucket` to a fixed
set of counts (multiples of the micro-batch rows), at most the padded count, and the row
length is a length bucket, so a config has a fixed, small set of row shapes.

No jax here, so the planner (rl_jax.planner) pads and packs simulated batches by the
same rules.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


def pick_bucket(length: int, length_buckets: Sequence[int]) -> int:
  """The smallest bucket >= length; ValueError when none is (config validation keeps
  the largest bucket >= data.max_prompt_length + sampler.max_new_tokens)."""
  fits = [b for b in sorted(length_buckets) if b >= length]
  if not fits:
    raise ValueError(
        f"a sequence of {length} tokens exceeds the largest trainer.length_buckets entry "
        f"({max(length_buckets)})")
  return fits[0]


def row_bucket(rows: int, *, quantum: int, limit: int) -> int:
  """`rows` rounded up to q * m (q = quantum) where m keeps 4 significant bits:
  m = 1..16 exactly, then 18, 20, ..., 32, then 36, 40, ..., 64, ... (< 1/16 waste);
  at most `limit` (a multiple of q). At most 16 + 8 log2(limit / (16 q)) values."""
  m = max(1, -(-int(rows) // quantum))
  step = 1 << max(0, m.bit_length() - 4)
  return min(-(-m // step) * step * quantum, int(limit))


def first_fit_decreasing(lengths: Sequence[int], row_len: int) -> list[list[int]]:
  """Indices into `lengths` (each <= row_len) grouped into rows of at most row_len
  positions: longest first (ties by index), each into the first row with room; a row
  lists its sequences in placement order."""
  lengths = np.asarray(lengths, np.int64)
  # Rows not opened yet are all free, and they come after every opened row.
  free = np.full(len(lengths), int(row_len))
  rows: list[list[int]] = []
  for i in np.lexsort((np.arange(len(lengths)), -lengths)):
    r = int(np.argmax(free >= lengths[i]))
    free[r] -= lengths[i]
    if r == len(rows):
      rows.append([])
    rows[r].append(int(i))
  return rows


@dataclasses.dataclass(frozen=True)
class RowLayout:
  """Where each sequence of a padded batch is trained: sequence s fills row row_s[s],
  columns start_s[s] .. start_s[s] + length_s[s] - 1, as segment seg_s[s] of that row
  (sequences of length 0, padding rows, are nowhere)."""
  row_s: np.ndarray  # int64 [s]
  start_s: np.ndarray  # int64 [s]
  length_s: np.ndarray  # int64 [s]
  seg_s: np.ndarray  # int64 [s]
  num_rows: int
  row_len: int

  @property
  def shape(self) -> tuple[int, int]:
    return (self.num_rows, self.row_len)

  @property
  def padding_frac(self) -> float:
    """Share of the trained positions (num_rows x row_len) that hold no token."""
    return 1.0 - float(self.length_s.sum()) / max(self.num_rows * self.row_len, 1)

  def _tokens(self):
    """(sequence, offset within it, flat destination) of every placed token."""
    seq = np.repeat(np.arange(len(self.length_s)), self.length_s)
    offset = np.arange(seq.size) - np.repeat(np.cumsum(self.length_s) - self.length_s,
                                             self.length_s)
    return seq, offset, self.row_s[seq] * self.row_len + self.start_s[seq] + offset

  def scatter(self, x_st: np.ndarray, fill) -> np.ndarray:
    """A per-position array of the padded batch, x_st [s, t'] (sequence s from column 0),
    laid out in the trained rows: [r, t], `fill` where no sequence is."""
    seq, offset, dst = self._tokens()
    out = np.full(self.num_rows * self.row_len, fill, x_st.dtype)
    out[dst] = x_st[seq, offset]
    return out.reshape(self.shape)

  def spread(self, x_s: np.ndarray, fill) -> np.ndarray:
    """A per-sequence value x_s [s] on each of its positions: [r, t]."""
    return self.scatter(np.broadcast_to(x_s[:, None], (len(x_s), self.row_len)), fill)

  def positions(self) -> np.ndarray:
    """int32 [r, t]: the offset of each position in its segment (0 on padding)."""
    seq, offset, dst = self._tokens()
    out = np.zeros(self.num_rows * self.row_len, np.int32)
    out[dst] = offset
    return out.reshape(self.shape)

  def segment_ids(self) -> np.ndarray:
    """int32 [r, t]: segment of each position within its row; a row's padding tail
    takes the id after its last segment."""
    seq, _, dst = self._tokens()
    per_row = np.bincount(self.row_s[self.length_s > 0], minlength=self.num_rows)
    out = np.repeat(per_row.astype(np.int32), self.row_len)
    out[dst] = self.seg_s[seq]
    return out.reshape(self.shape)


def padded_layout(lengths_s: np.ndarray, row_len: int) -> RowLayout:
  """Sequence s alone in row s (the layout of TrainBatch itself)."""
  lengths_s = np.asarray(lengths_s, np.int64)
  zeros = np.zeros_like(lengths_s)
  return RowLayout(row_s=np.arange(len(lengths_s)), start_s=zeros, length_s=lengths_s,
                   seg_s=zeros, num_rows=len(lengths_s), row_len=int(row_len))


def packed_layout(lengths_s: np.ndarray, *, row_len: int, num_minibatches: int,
                  quantum: int) -> RowLayout:
  """Sequences packed per minibatch (module docstring); every minibatch gets
  row_bucket(most rows any minibatch needs, quantum, s / num_minibatches) rows.
  len(lengths_s) must be a multiple of num_minibatches * quantum."""
  lengths_s = np.asarray(lengths_s, np.int64)
  n = int(num_minibatches)
  row_s, start_s, seg_s = (np.zeros_like(lengths_s) for _ in range(3))
  rows_needed = 0
  for i in range(n):
    members = np.arange(i, len(lengths_s), n)
    members = members[lengths_s[members] > 0]
    rows = first_fit_decreasing(lengths_s[members].tolist(), row_len)
    rows_needed = max(rows_needed, len(rows))
    for j, row in enumerate(rows):
      seqs = members[row]
      row_s[seqs] = j * n + i
      start_s[seqs] = np.cumsum(lengths_s[seqs]) - lengths_s[seqs]
      seg_s[seqs] = np.arange(len(seqs))
  per_minibatch = row_bucket(rows_needed, quantum=quantum, limit=len(lengths_s) // n)
  return RowLayout(row_s=row_s, start_s=start_s, length_s=lengths_s, seg_s=seg_s,
                   num_rows=per_minibatch * n, row_len=int(row_len))

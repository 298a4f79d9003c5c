"""Sampler / trainer contention: how fast each role runs while the other one is busy.

On separate accelerators the two roles barely interact. When they share compute (the
CPU backend's devices are one host's cores; a host-bound loop shares one Python
process), a decode call slows down or stalls while a train step runs, and a train step
slows down while decode calls run. The simulation (rl_jax.planner.simulate) models it
with two shares: while both roles are busy, the sampler progresses at `sampler_share`
of its alone speed and the trainer at `trainer_share` (1: no contention, 0: stalled).

Fit from a pilot's busy timelines (summary.json "timeline": the [start, end] pipeline
times of every sampler generate call and every train step). An interval of alone
duration D that overlaps the other role's busy time for ov seconds does share * ov
seconds of alone work during the overlap, so its observed duration d satisfies
D = (d - ov) + share * ov. Summed over the n intervals that overlap, with D taken as the
mean duration of the intervals that do not (same kind of work, no contention):

  share = (n * mean alone duration - sum (d - ov)) / sum ov,

clipped to [0, 1]. When at least MIN_INTERVALS intervals lie wholly inside the other
role's busy time, they alone decide: each ran at `share` throughout, so

  share = mean alone duration / mean duration of those wholly inside.

That needs no split of a partly overlapped interval into work done before and during
the overlap (a call that starts just before a train step mostly waits for the device
like one inside it, so the formula above, which counts its part outside as full-speed
work, fits too low a share: 0.055 against 0.12 from the calls wholly inside, on the
compute-bound config's pilot). Intervals whose part outside the overlap alone exceeds OUTLIER x the
median alone duration (a train step that compiles a new shape) are left out. A role with fewer than MIN_INTERVALS intervals of
either kind keeps share 1 (sync mode: the roles take turns; a compute-bound async
trainer that always overlaps the sampler: its alone speed is unknown), as does one
whose intervals overlap the other role's busy time for under MIN_OVERLAP_FRAC of its
busy seconds.

The fitted step models want alone seconds: a role's busy seconds in a row's interval
minus (1 - share) * the seconds both roles were busy (`alone_busy_s`).
"""
from __future__ import annotations

import dataclasses

import numpy as np

MIN_INTERVALS = 10  # intervals that overlap the other role's busy time, and that do not
OUTLIER = 5.0  # in median alone durations: longer non-overlapped parts are left out
MIN_OVERLAP_FRAC = 0.05  # overlap needed, as a share of the role's busy seconds


@dataclasses.dataclass
class Contention:
  """Fitted shares and the timelines they came from (sorted [start, end] arrays)."""
  sampler_share: float = 1.0
  trainer_share: float = 1.0
  sampler: np.ndarray | None = None  # [n, 2]
  trainer: np.ndarray | None = None  # [m, 2]
  # Share of each role's busy seconds (fit window) that overlaps the other role's: the
  # fallback for rows the bounded timelines do not reach.
  overlap_frac: dict = dataclasses.field(default_factory=lambda: {"sampler": 0.0, "trainer": 0.0})

  def both_busy_s(self, t0: float, t1: float) -> float | None:
    """Seconds in [t0, t1] when both roles were busy; None when the timelines do not
    cover the interval (summary.json keeps a bounded number of intervals)."""
    if self.sampler is None or self.trainer is None:
      return None
    for tl in (self.sampler, self.trainer):
      if not len(tl) or tl[0, 0] > t0 + 1e-9:
        return None
    a, b = _clip(self.sampler, t0, t1), _clip(self.trainer, t0, t1)
    return float(np.sum(overlap_s(a, b)))

  def alone_busy_s(self, role: str, busy_s: float, t0: float, t1: float) -> float:
    """`role`'s busy seconds in [t0, t1] converted to alone seconds; where the
    timelines do not reach, the window's overlap_frac of busy_s counts as overlapped."""
    share = self.sampler_share if role == "sampler" else self.trainer_share
    if share >= 1.0:
      return busy_s
    both = self.both_busy_s(t0, t1)
    if both is None:
      both = self.overlap_frac[role] * busy_s
    return busy_s - (1.0 - share) * min(both, busy_s)


def _clip(iv: np.ndarray, t0: float, t1: float) -> np.ndarray:
  lo, hi = np.maximum(iv[:, 0], t0), np.minimum(iv[:, 1], t1)
  keep = hi > lo
  return np.stack([lo[keep], hi[keep]], axis=1)


def overlap_s(iv: np.ndarray, other: np.ndarray) -> np.ndarray:
  """Seconds of each interval of `iv` covered by the (disjoint, sorted) `other`."""
  iv, other = np.asarray(iv, np.float64).reshape(-1, 2), np.asarray(other, np.float64).reshape(-1, 2)
  if not len(iv) or not len(other):
    return np.zeros(len(iv))
  starts, lengths = other[:, 0], other[:, 1] - other[:, 0]
  before = np.concatenate([[0.0], np.cumsum(lengths)])  # busy seconds of the first k

  def covered(t):
    """Busy seconds of `other` before time t (its intervals are disjoint and sorted)."""
    k = np.searchsorted(starts, t, side="right")  # intervals starting at or before t
    last = np.maximum(k - 1, 0)
    partial = np.clip(t - starts[last], 0.0, lengths[last])
    return np.where(k > 0, before[last] + partial, 0.0)

  return covered(iv[:, 1]) - covered(iv[:, 0])


def fit_share(iv: np.ndarray, other: np.ndarray) -> float | None:
  """The work-conserving share of the module docstring, in [0, 1]; None when too few
  intervals overlap `other`, or too few do not, to tell."""
  iv = np.asarray(iv, np.float64).reshape(-1, 2)
  d = iv[:, 1] - iv[:, 0]
  ov = overlap_s(iv, other)
  alone = ov <= 1e-9
  if alone.sum() < MIN_INTERVALS:
    return None
  keep = d - ov <= OUTLIER * np.median(d[alone])
  d, ov, alone = d[keep], ov[keep], alone[keep]
  hit = ~alone
  if (alone.sum() < MIN_INTERVALS or hit.sum() < MIN_INTERVALS or
      np.sum(ov) < MIN_OVERLAP_FRAC * np.sum(d)):
    return None
  inside = ov >= d - 1e-9  # wholly inside the other role's busy time
  if inside.sum() >= MIN_INTERVALS:
    share = np.mean(d[alone]) / np.mean(d[inside])
  else:
    share = (hit.sum() * np.mean(d[alone]) - np.sum(d[hit] - ov[hit])) / np.sum(ov[hit])
  return float(np.clip(share, 0.0, 1.0))


def fit_contention(summary: dict, t_start: float, notes: list[str]) -> Contention:
  """Shares from the busy timelines after pipeline time `t_start` (the fit window)."""
  tl = summary.get("timeline") or {}
  sampler, trainer = tl.get("sampler"), tl.get("trainer")
  if not sampler or not trainer:
    notes.append("contention: no busy timelines in summary.json; roles taken as independent")
    return Contention()
  s = np.asarray(sampler, np.float64).reshape(-1, 2)
  t = np.asarray(trainer, np.float64).reshape(-1, 2)
  s, t = s[np.argsort(s[:, 0])], t[np.argsort(t[:, 0])]
  c = Contention(sampler=s, trainer=t)
  ws, wt = s[s[:, 0] >= t_start], t[t[:, 0] >= t_start]
  share_s, share_t = fit_share(ws, t), fit_share(wt, s)
  for role, iv, other in (("sampler", ws, t), ("trainer", wt, s)):
    busy = float(np.sum(iv[:, 1] - iv[:, 0])) if len(iv) else 0.0
    c.overlap_frac[role] = float(np.sum(overlap_s(iv, other))) / busy if busy > 0 else 0.0
  c.sampler_share = 1.0 if share_s is None else share_s
  c.trainer_share = 1.0 if share_t is None else share_t
  if share_s is None and share_t is None:
    notes.append("contention: sampler and trainer never overlap; roles taken as independent")
  else:
    notes.append(f"contention: while both are busy the sampler runs at "
                 f"{c.sampler_share:.2f} and the trainer at {c.trainer_share:.2f} of alone speed")
  return c

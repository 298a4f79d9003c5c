"""The discrete-event machinery of the planner's simulation: a time-ordered event queue,
a pool of identical servers with one FIFO waiting line (the verifier pool), work that
progresses at a changing rate (contention) and the sampler's decode segments."""
from __future__ import annotations

import dataclasses
import heapq
import math


class Progress:
  """Work measured in alone seconds, done at `rate` alone seconds per second from
  `t_mark` on; the rate changes when the other role starts or stops (contention)."""

  def __init__(self, now: float, rate: float = 1.0, work_s: float = 0.0):
    self.t_mark, self.rate, self.done, self.work_s = now, rate, 0.0, work_s

  def work_at(self, now: float) -> float:
    return self.done + (now - self.t_mark) * self.rate

  def time_of(self, work: float) -> float:
    """When `work` alone seconds will be done at the current rate."""
    return self.t_mark + (work - self.done) / self.rate

  def set_rate(self, now: float, rate: float) -> None:
    self.done, self.t_mark, self.rate = self.work_at(now), now, rate


@dataclasses.dataclass
class Segment:
  """Decode steps the sampler runs with a fixed active set, from t0. Durations are
  alone seconds; `progress` maps them to pipeline time."""
  t0: float
  prefill_s: float
  steps: int
  a_s: float
  g_s: float
  token: int
  progress: Progress

  def duration(self, steps: int) -> float:
    return self.prefill_s + steps * self.a_s + self.g_s * steps * (steps - 1) / 2

  def steps_done(self, work: float) -> int:
    """Whole steps finished after `work` alone seconds: largest j with duration(j) <= work."""
    e = work - self.prefill_s
    if e <= 0:
      return 0
    if self.g_s > 0:
      half = self.g_s / 2
      lin = self.a_s - half
      j = int((-lin + math.sqrt(lin * lin + 4 * half * e)) / (2 * half))
    else:
      j = int(e / self.a_s)
    while j > 0 and self.duration(j) > work:
      j -= 1
    while self.duration(j + 1) <= work:
      j += 1
    return min(j, self.steps)


class EventQueue:
  """Time-ordered events; ties keep insertion order."""

  def __init__(self):
    self._heap: list = []
    self._n = 0

  def push(self, time: float, kind: str, payload=None) -> None:
    heapq.heappush(self._heap, (time, self._n, kind, payload))
    self._n += 1

  def pop(self):
    time, _, kind, payload = heapq.heappop(self._heap)
    return time, kind, payload

  def __bool__(self) -> bool:
    return bool(self._heap)


class ServerPool:
  """`servers` identical servers with one FIFO waiting line (the verifier pool).

  With FIFO service each arrival starts when it arrives or when the earliest of the
  servers frees, whichever is later, so its finish time is known at arrival:
  arrive(now, service_s) returns it (no departure events: one event per finish is all a
  simulation needs). Arrivals must come in time order.
  """

  def __init__(self, servers: int):
    if servers < 1:
      raise ValueError(f"a server pool needs >= 1 server, got {servers}")
    self._free_at = [0.0] * int(servers)  # a heap of the times each server frees
    self.wait_total_s = 0.0
    self.service_total_s = 0.0
    self.started = 0

  def arrive(self, now: float, service_s: float) -> float:
    start = max(now, self._free_at[0])
    finish = start + service_s
    heapq.heapreplace(self._free_at, finish)
    self.wait_total_s += start - now
    self.service_total_s += service_s
    self.started += 1
    return finish

  @property
  def mean_wait_s(self) -> float:
    return self.wait_total_s / max(self.started, 1)

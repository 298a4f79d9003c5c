"""The discrete-event machinery of the planner's simulation: a time-ordered event queue
and a pool of identical servers with one FIFO waiting line (the verifier pool)."""
from __future__ import annotations

import collections
import heapq


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

  arrive() returns the finish time when the item starts at once, else None (it waits);
  depart() frees a server and returns (finish time, item) of the next waiter, if any.
  """

  def __init__(self, servers: int):
    self.free = servers
    self.line: collections.deque = collections.deque()
    self.wait_total_s = 0.0
    self.service_total_s = 0.0
    self.started = 0

  def arrive(self, now: float, item, service_s: float) -> float | None:
    if self.free:
      self.free -= 1
      self.started += 1
      self.service_total_s += service_s
      return now + service_s
    self.line.append((now, item, service_s))
    return None

  def depart(self, now: float):
    if self.line:
      arrived, item, service_s = self.line.popleft()
      self.wait_total_s += now - arrived
      self.started += 1
      self.service_total_s += service_s
      return now + service_s, item
    self.free += 1
    return None

  @property
  def mean_wait_s(self) -> float:
    return self.wait_total_s / max(self.started, 1)

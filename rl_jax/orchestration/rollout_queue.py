"""A bounded FIFO of verified groups, with the accounting that drives admission.

The sampler thread admits a group only when `can_admit()`; verifier callbacks `put`
completed groups; the trainer `get`s them and `release`s them once the policy version
they were trained into is published. Admission counts a group from the moment it is
admitted until that release, so the queue can never hold more than its bound, a put
never blocks, and a group admitted now is at most max_staleness versions old when the
trainer reaches it. (Releasing at dequeue instead would let the sampler refill the
batch being trained with groups that are consumed one version too late.)
"""
from __future__ import annotations

import collections
import threading
import time

from rl_jax.types import Group


class RolloutQueue:
  """Eligible-group queue. Thread-safe; no lock is held across device work."""

  def __init__(self, maxsize: int, max_inflight: int):
    self.maxsize = int(maxsize)
    self.max_inflight = int(max_inflight)
    self._q: collections.deque[Group] = collections.deque()
    self._cv = threading.Condition()
    self.inflight = 0  # admitted, not yet in the queue (sampling or verifying)
    self.held = 0  # dequeued by the trainer, not yet released
    self.enqueued_total = 0
    self.dequeued_total = 0
    self.max_depth_seen = 0
    self._closed = False

  def can_admit(self, n: int = 1) -> bool:
    """Admission control: in-flight + queued stays within both bounds."""
    with self._cv:
      outstanding = self.inflight + len(self._q) + n
      return (outstanding + self.held <= self.max_inflight and outstanding <= self.maxsize)

  def admitted(self, n: int = 1) -> None:
    with self._cv:
      self.inflight += n

  def abandon(self, n: int = 1) -> None:
    """An admitted group that will never arrive (aborted)."""
    with self._cv:
      self.inflight -= n
      self._cv.notify_all()

  def put(self, group: Group) -> None:
    with self._cv:
      group.enqueued = time.time()
      self.inflight -= 1
      self._q.append(group)
      self.enqueued_total += 1
      if len(self._q) > self.maxsize:
        raise RuntimeError(f"rollout queue exceeded its bound {self.maxsize}: admission bug")
      self.max_depth_seen = max(self.max_depth_seen, len(self._q))
      self._cv.notify_all()

  def get(self, timeout: float | None = None) -> Group | None:
    """Oldest group, or None after `timeout` seconds / when closed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cv:
      while not self._q and not self._closed:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
          return None
        self._cv.wait(remaining)
      if not self._q:
        return None
      self.dequeued_total += 1
      self.held += 1
      return self._q.popleft()

  def release(self, n: int = 1) -> None:
    """Groups the trainer has finished with (trained and published, or discarded)."""
    with self._cv:
      self.held -= n
      self._cv.notify_all()

  def close(self) -> None:
    with self._cv:
      self._closed = True
      self._cv.notify_all()

  def wait_changed(self, timeout: float) -> None:
    with self._cv:
      self._cv.wait(timeout)

  @property
  def depth(self) -> int:
    with self._cv:
      return len(self._q)

  def oldest_age(self) -> float:
    with self._cv:
      return time.time() - self._q[0].enqueued if self._q else 0.0

  def snapshot(self) -> dict:
    with self._cv:
      return dict(depth=len(self._q), inflight=self.inflight, held=self.held,
                  enqueued_total=self.enqueued_total, dequeued_total=self.dequeued_total,
                  oldest_age_s=(time.time() - self._q[0].enqueued) if self._q else 0.0)

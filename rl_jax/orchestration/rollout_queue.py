"""A bounded queue of verified groups, with the accounting that drives admission.

The sampler thread admits a group only when `can_admit()`; verifier callbacks `put`
completed groups; the trainer `get`s them and `release`s them when the staleness policy
returns their admission credit (rl_jax/orchestration/policy.py). Admission counts a group
from the moment it is admitted until that release, so the queue can never hold more than
its bound, a put never blocks, and a group admitted now is at most max_staleness versions
old when the trainer reaches it. The trainer takes groups in arrival order, or, with
rl.queue_order="oldest_version", those sampled by the oldest policy version first
(StalenessPolicy.next_index); each group's oldest version is kept beside it from `put`.
"""
from __future__ import annotations

import collections
import threading
import time

from rl_jax.orchestration.policy import StalenessPolicy
from rl_jax.types import Group


class RolloutQueue:
  """Eligible-group queue. Thread-safe; no lock is held across device work."""

  def __init__(self, policy: StalenessPolicy):
    self.policy = policy
    self._q: collections.deque[Group] = collections.deque()
    self._versions: collections.deque[int] = collections.deque()  # _q's min versions
    self._cv = threading.Condition()
    self.inflight = 0  # admitted, not yet in the queue (sampling or verifying)
    self.held = 0  # dequeued by the trainer, not yet released
    self.enqueued_total = 0
    self.dequeued_total = 0
    self.max_depth_seen = 0
    self._closed = False
    self.limit: int | None = None  # a live admission limit (rl.control); None: the policy's

  def can_admit(self, n: int = 1) -> bool:
    with self._cv:
      return self.policy.can_admit(inflight=self.inflight, queued=len(self._q),
                                   held=self.held, n=n, limit=self.limit)

  def set_limit(self, limit: int | None) -> None:
    """Sets the live admission limit (the policy clamps it to its admission_range)."""
    with self._cv:
      self.limit = limit
      self._cv.notify_all()

  def admitted(self, n: int = 1) -> None:
    with self._cv:
      self.inflight += n

  def put(self, group: Group) -> None:
    with self._cv:
      group.enqueued = time.time()
      self.inflight -= 1
      self._q.append(group)
      self._versions.append(self._version(group))
      self.enqueued_total += 1
      if len(self._q) > self.policy.queue_maxsize:
        raise RuntimeError(f"rollout queue exceeded its bound {self.policy.queue_maxsize}: "
                           f"admission bug")
      self.max_depth_seen = max(self.max_depth_seen, len(self._q))
      self._cv.notify_all()

  def get(self, timeout: float | None = None) -> Group | None:
    """The next group in the policy's order, or None after `timeout` seconds / when
    closed."""
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
      i = self.policy.next_index(self._versions)
      group = self._q[i]
      del self._q[i], self._versions[i]
      return group

  def _version(self, group: Group) -> int:
    """What next_index orders by: the group's oldest version (0, unread, under fifo)."""
    return group.min_version if self.policy.orders_by_version else 0

  def release(self, n: int = 1) -> None:
    """Groups the trainer has finished with (credit returned by the policy, or discarded)."""
    with self._cv:
      self.held -= n
      self._cv.notify_all()

  def drop(self) -> None:
    """An admitted group that will never be queued (verifier.on_error="drop"): its
    admission credit returns at once."""
    with self._cv:
      self.inflight -= 1
      self._cv.notify_all()

  def unget(self, groups: list[Group]) -> None:
    """Groups the trainer took but did not train (a batch cut short): back at the front,
    in order, no longer held."""
    with self._cv:
      self._q.extendleft(reversed(groups))
      self._versions.extendleft(reversed([self._version(g) for g in groups]))
      self.held -= len(groups)
      self.dequeued_total -= len(groups)
      self._cv.notify_all()

  def groups(self) -> list[Group]:
    """The queued groups in arrival order (a checkpoint carries them)."""
    with self._cv:
      return list(self._q)

  def close(self) -> None:
    with self._cv:
      self._closed = True
      self._cv.notify_all()

  def wait_changed(self, timeout: float) -> None:
    with self._cv:
      self._cv.wait(timeout)

  def snapshot(self) -> dict:
    """depth, inflight, held, enqueued_total, dequeued_total and oldest_age_s (seconds the
    oldest queued group has waited)."""
    with self._cv:
      return dict(depth=len(self._q), inflight=self.inflight, held=self.held,
                  enqueued_total=self.enqueued_total, dequeued_total=self.dequeued_total,
                  oldest_age_s=(time.time() - self._q[0].enqueued) if self._q else 0.0)

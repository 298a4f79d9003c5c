"""The staleness policy: admission, acceptance, publication and admission credit.

One object decides for the run loop (rl_jax.orchestration.sampler_worker and loop), the
rollout queue and the planner's simulation (rl_jax.planner.simulate), so a change here
changes the run and its prediction alike. It imports nothing but the standard library.

  staleness s of a group   trainer_version - min over its tokens' versions (the max over
                           its rollouts), counted in published versions
  accepts(s)               s <= bound; bound = rl.max_staleness (async), 0 (sync)
  can_admit                in-flight + queued + held + n <= max_inflight and
                           in-flight + queued + n <= queue_maxsize, where held counts the
                           groups the trainer dequeued and has not yet released;
                           max_inflight = rl.max_inflight_groups when >= 0, else
                           (max_staleness + 1) * groups_per_step; sync: groups_per_step.
                           A live `limit` (rl.control) replaces max_inflight only within
                           admission_range()
  admission_range()        (lo, hi) a live admission limit may take: hi = max_inflight
                           (the staleness rule's bound, or the configured one), or
                           queue_maxsize + groups_per_step * weight_sync_every when that is
                           smaller (held never exceeds the batches trained between two
                           publications, so a larger limit admits nothing more: the queue
                           bound binds first), lo = min(hi, groups_per_step *
                           weight_sync_every), the least that can still reach a
                           publication (stall_reason); sync: (hi, hi)
  barrier_allows           sync only: groups_per_step groups per optimizer step, admitted
                           once the previous step is done and the sampler runs the
                           trainer's version; async: always
  publishes(step)          the trainer publishes weights after optimizer step `step` iff
                           step % weight_sync_every == 0
  releases(step)           trained groups return their admission credit after step `step`:
                           every step in sync (each batch trains at the version that made
                           it), at publication in async (released at dequeue instead, the
                           sampler would refill the batch being trained with groups consumed
                           one version too late)
  stall_reason()           why a configuration can never publish, or "": async credit
                           returns only at publication, so the admission bound must hold
                           the weight_sync_every batches trained before one,
                           max_inflight >= groups_per_step * weight_sync_every
  next_index(versions)     which queued group the trainer takes next, given each queued
                           group's oldest token version in arrival order: the first
                           (rl.queue_order="fifo", and always in sync mode, where every
                           queued group has the trainer's version), or the first of those
                           sampled by the oldest policy version ("oldest_version"): a
                           group whose slowest verification ran long is trained before
                           the next version's groups that overtook it, instead of aging
                           past the bound behind them. The acceptance rule is unchanged
  a group dropped before the queue (verifier.on_error="drop") returns its credit at once
                           (RolloutQueue.drop), so drops can never stall admission
  filters(rewards, n)      rl.filter_groups="zero_variance": a verified group whose rewards
                           are all equal (zero GRPO advantage) is not queued; like a drop it
                           returns its credit at once and the sampler admits a replacement
                           (sync: in the same window, at the trainer's version). n = groups
                           already filtered for the optimizer step being filled; filtering
                           stops at n = (max_oversample - 1) * groups_per_step, i.e. at most
                           max_oversample x the batch sampled per step, after which uniform
                           groups are queued (and trained, with zero advantage). Staleness is
                           unchanged: a replacement is admitted later, so it is younger.
"""
from __future__ import annotations

import dataclasses


def admission_bound(*, max_staleness: int, groups_per_step: int,
                    max_inflight_groups: int) -> int:
  """Async max_inflight: rl.max_inflight_groups when >= 0, else the largest number of
  groups that can all still be consumed within the staleness bound,
  (max_staleness + 1) * groups_per_step."""
  if max_inflight_groups >= 0:
    return int(max_inflight_groups)
  return (max_staleness + 1) * groups_per_step


@dataclasses.dataclass(frozen=True)
class StalenessPolicy:
  sync: bool
  groups_per_step: int
  max_staleness: int
  max_inflight: int
  queue_maxsize: int
  weight_sync_every: int
  filter_zero_variance: bool = False
  max_oversample: int = 4
  queue_order: str = "fifo"

  @classmethod
  def from_config(cls, rl) -> StalenessPolicy:
    """From the `rl` config section (or anything with its field names)."""
    return cls.make(mode=rl.mode, groups_per_step=rl.groups_per_step,
                    max_staleness=rl.max_staleness, max_inflight_groups=rl.max_inflight_groups,
                    queue_maxsize=rl.queue_maxsize, weight_sync_every=rl.weight_sync_every,
                    filter_groups=getattr(rl, "filter_groups", "none"),
                    max_oversample=getattr(rl, "max_oversample", 4),
                    queue_order=getattr(rl, "queue_order", "fifo"))

  @classmethod
  def make(cls, *, mode: str, groups_per_step: int, max_staleness: int,
           max_inflight_groups: int, queue_maxsize: int, weight_sync_every: int,
           filter_groups: str = "none", max_oversample: int = 4,
           queue_order: str = "fifo"):
    """max_inflight_groups -1 means auto, (max_staleness + 1) * groups_per_step."""
    sync = mode == "sync"
    inflight = groups_per_step if sync else admission_bound(
        max_staleness=max_staleness, groups_per_step=groups_per_step,
        max_inflight_groups=max_inflight_groups)
    return cls(sync=sync, groups_per_step=int(groups_per_step),
               max_staleness=int(max_staleness), max_inflight=int(inflight),
               queue_maxsize=int(queue_maxsize), weight_sync_every=int(weight_sync_every),
               filter_zero_variance=filter_groups == "zero_variance",
               max_oversample=int(max_oversample), queue_order=str(queue_order))

  @property
  def bound(self) -> int:
    return 0 if self.sync else self.max_staleness

  def accepts(self, staleness: int) -> bool:
    return staleness <= self.bound

  def admission_range(self) -> tuple[int, int]:
    """(lo, hi) of a live admission limit (module docstring)."""
    hi = self.max_inflight
    if self.sync:
      return hi, hi
    per_publication = self.groups_per_step * self.weight_sync_every
    hi = min(hi, self.queue_maxsize + per_publication)
    return min(hi, per_publication), hi

  def clamp(self, limit: int) -> int:
    """A live admission limit moved into admission_range()."""
    lo, hi = self.admission_range()
    return int(min(max(limit, lo), hi))

  def can_admit(self, *, inflight: int, queued: int, held: int, n: int = 1,
                limit: int | None = None) -> bool:
    bound = self.max_inflight if limit is None else self.clamp(limit)
    outstanding = inflight + queued + n
    return outstanding + held <= bound and outstanding <= self.queue_maxsize

  def barrier_allows(self, *, admitted: int, steps_done: int, sampler_version: int,
                     trainer_version: int) -> bool:
    """Whether the sync barrier lets group number `admitted` (0-based) in."""
    if not self.sync:
      return True
    return (admitted < (steps_done + 1) * self.groups_per_step
            and sampler_version == trainer_version)

  @property
  def orders_by_version(self) -> bool:
    """Whether next_index looks at versions (async with rl.queue_order="oldest_version")."""
    return not self.sync and self.queue_order == "oldest_version"

  def next_index(self, versions) -> int:
    """Index of the group the trainer takes next; `versions` holds each queued group's
    oldest token version in arrival order (module docstring). Ties go to arrival."""
    if not self.orders_by_version or len(versions) == 0:
      return 0
    best = 0
    for i, v in enumerate(versions):
      if v < versions[best]:
        best = i
    return best

  @property
  def filter_budget(self) -> int:
    """Groups that may be filtered per optimizer step: (max_oversample - 1) x the batch."""
    return (self.max_oversample - 1) * self.groups_per_step if self.filter_zero_variance else 0

  def uniform(self, rewards) -> bool:
    """Whether a group's rewards are all equal (its GRPO advantages are all zero) and
    rl.filter_groups asks to filter such groups."""
    return self.filter_zero_variance and len(rewards) > 0 and max(rewards) == min(rewards)

  def filters(self, rewards, filtered: int) -> bool:
    """Whether a verified group with these rewards is filtered, `filtered` groups having
    been filtered already for the optimizer step being filled (module docstring)."""
    return self.uniform(rewards) and filtered < self.filter_budget

  def publishes(self, step: int) -> bool:
    return step % self.weight_sync_every == 0

  def releases(self, step: int) -> bool:
    return self.sync or self.publishes(step)

  def stall_reason(self) -> str:
    """"" when the trainer can always reach its next publication; else one sentence naming
    the fields. Async credit returns only at publication, so the weight_sync_every batches
    trained before it must all fit under the admission bound."""
    need = self.groups_per_step * self.weight_sync_every
    if self.sync or self.max_inflight >= need:
      return ""
    return (f"the async admission bound ({self.max_inflight} groups: rl.max_inflight_groups, "
            f"or (rl.max_staleness + 1) x rl.groups_per_step when -1) must be >= "
            f"rl.groups_per_step x rl.weight_sync_every = {need}, or the trainer can never "
            f"fill the batches before a publication and the run hangs")

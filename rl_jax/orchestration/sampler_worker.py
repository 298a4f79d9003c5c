"""The sampler worker: admission, generator stepping, verification and weight swaps.

It owns the sampler thread and one lock. The lock guards the admission cursor (the
prompt iterator, the next group id and the outstanding groups: admitted, not yet trained
or discarded), the groups awaiting verification and the staged weights; it is never held
across device work. Verifier callbacks score rollouts and put complete groups on the
RolloutQueue; the trainer reads the queue, calls `settle` for groups it is done with and
`stage` for weights it publishes.

One iteration of the thread (`step_once`), under the schedule's launch lock (multi-process
leader: the admitted group ids and the version swapped in are logged before launching):
  1. admit groups while the generator has free slots, the queue's admission control allows
     (StalenessPolicy.can_admit) and, in sync mode, the barrier lets them in;
  2. swap in the newest staged weights, between two decode calls: the trainer never waits
     for an in-flight decode call to publish;
  3. one Generator.step; finished rollouts go to the verifier pool (followers take rewards
     from the event log instead).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable

import numpy as np

from rl_jax.orchestration.errors import RunError
from rl_jax.types import Group


@dataclasses.dataclass
class Publication:
  """Weights of one version on the sampler mesh, from WeightSync.start."""
  version: int
  params: Any
  launched: float  # time.time() at launch
  staged: float = 0.0  # time.perf_counter() when handed to the sampler


class SamplerWorker:
  """Admits groups, steps the generator and routes finished rollouts to verification."""

  def __init__(self, *, cfg, task, prompts, tokenizer, queue, policy, accounting, schedule,
               pool, on_error: Callable[[BaseException], None]):
    self.cfg, self.task, self.prompts, self.tokenizer = cfg, task, prompts, tokenizer
    self.queue, self.policy, self.acc, self.schedule = queue, policy, accounting, schedule
    self.pool = pool  # None: rewards come from elsewhere (a multi-process follower)
    self.on_error = on_error
    self.generator = None
    self.steps_done = 0  # optimizer steps completed, set by the trainer
    self.trainer_version = 0  # set by the trainer
    self.lock = threading.Lock()
    self.next_group_id = 0
    self.sync_admitted = 0  # groups admitted so far in sync mode
    # Admitted groups not yet trained or discarded: id -> {"prompts": iterator state before
    # the group was drawn, "rollouts": finished so far}.
    self.outstanding: dict[int, dict] = {}
    self._groups: dict[int, Group] = {}  # admitted, not yet complete
    self._staged: dict[int, Publication] = {}
    self.requested_version = 0  # newest version handed to the generator
    self.published_at: dict[int, float] = {}  # version -> launch time (time.time())
    self.last_verified = time.time()
    self._stop = threading.Event()
    self._pause = threading.Event()
    self._paused = threading.Event()
    self._thread: threading.Thread | None = None

  # -- the thread --------------------------------------------------------------------

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
    self._thread.start()

  def request_stop(self) -> None:
    """Any thread, the sampler's own included."""
    self._stop.set()

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=30)

  @contextlib.contextmanager
  def paused(self):
    """The sampler thread idles between steps while the body runs (held-out evaluation)."""
    self._pause.set()
    while (self._thread is not None and self._thread.is_alive() and not self._paused.is_set()
           and not self._stop.is_set()):
      time.sleep(0.002)
    try:
      yield
    finally:
      self._pause.clear()

  def _run(self) -> None:
    try:
      last_version = -1
      while not self._stop.is_set():
        if self._pause.is_set():
          self._paused.set()
          while self._pause.is_set() and not self._stop.is_set():
            time.sleep(0.005)
          self._paused.clear()
          continue
        t0 = self.acc.clock.now()
        stepped = self.step_once()
        if stepped is None:  # multi-process leader with nothing to do
          self.queue.wait_changed(0.005)
          continue
        busy, finished = stepped
        if busy:
          self.acc.sampler_busy.add(t0, self.acc.clock.now())
        v = self.generator.version
        if v != last_version:
          with self.lock:
            published = self.published_at.get(v)
          if published is not None:
            self.acc.weight_sync("lag_s", time.time() - published)
          last_version = v
        for r in finished:
          self.on_rollout_finished(r)
        if not busy and not finished:
          self.queue.wait_changed(0.005)
    except BaseException as e:  # surfaced to the trainer thread, which stops the run
      self.on_error(e)

  def step_once(self):
    """Admission, a weight swap and one Generator.step: (busy, finished rollouts), or
    None when the multi-process leader had nothing to launch."""
    gen = self.generator
    with self.schedule.launch_lock():
      admitted = self.admit()
      busy = gen.num_active > 0 or gen.num_pending > 0
      version = self._newest_staged()
      if self.schedule.logging:
        if not admitted and version is None and not busy:
          return None
        self.schedule.put("sample", gids=admitted, version=version)
      if version is not None:
        self.swap_to(version)
      # An idle step still swaps in the weights (the sync barrier relies on it).
      finished = gen.step()
    return busy, finished

  # -- admission ---------------------------------------------------------------------

  def admit(self) -> list[int]:
    """Admits groups while the generator and the staleness policy allow; their ids."""
    gen = self.generator
    admitted = []
    while gen.has_capacity() and self.queue.can_admit():
      if not self.policy.barrier_allows(
          admitted=self.sync_admitted, steps_done=self.steps_done,
          sampler_version=gen.version, trainer_version=self.trainer_version):
        break
      self.sync_admitted += 1
      admitted.append(self.admit_one())
    return admitted

  def admit_one(self) -> int:
    """Draws the next prompt as group `next_group_id` and adds it to the generator."""
    with self.lock:
      # One critical section, so a checkpoint sees the iterator, the id cursor and the
      # outstanding groups of a single moment.
      before = self.prompts.get_state()
      record = next(self.prompts)
      gid = self.next_group_id
      self.next_group_id += 1
      self.outstanding[gid] = {"prompts": before, "rollouts": 0}
      self.acc.counts["groups_admitted"] += 1
      group = Group(group_id=gid, example=self.task.example(int(record["index"])),
                    prompt_tokens=np.asarray(record["prompt_tokens"], np.int32),
                    admitted=time.time())
      self._groups[gid] = group
    self.queue.admitted()
    self.generator.add_group(gid, group.prompt_tokens, self.cfg.rl.group_size,
                             seed=self.cfg.seed * 1_000_003 + gid)
    return gid

  def settle(self, gids) -> None:
    """Groups the trainer is done with (trained or discarded)."""
    with self.lock:
      for gid in gids:
        self.outstanding.pop(gid, None)

  def take_group(self, gid: int) -> Group | None:
    """A follower's group by id (its rewards come from the leader's event)."""
    with self.lock:
      return self._groups.pop(gid, None)

  def drop_groups(self, gids) -> None:
    with self.lock:
      for gid in gids:
        self._groups.pop(gid, None)
        self.outstanding.pop(gid, None)

  # -- rollouts and verification -----------------------------------------------------

  def on_rollout_finished(self, r) -> None:
    with self.lock:
      group = self._groups[r.group_id]
      group.rollouts.append(r)
      self.outstanding[r.group_id]["rollouts"] += 1
    self.acc.rollout_finished(r)
    r.completion_text = self.tokenizer.decode(r.completion_tokens)
    if self.pool is not None:
      self.pool.submit((r.group_id, r.sample_index), group.example, r.completion_text,
                       callback=self._on_verified)

  def _on_verified(self, key, result) -> None:
    # The pool only logs a callback's exception; the run must stop on it instead of
    # waiting for a group that can no longer complete.
    try:
      self._record_verified(key, result)
    except BaseException as e:
      self.on_error(e)

  def _record_verified(self, key, result) -> None:
    gid, idx = key
    with self.lock:
      group = self._groups.get(gid)
      if group is None:
        return
      r = next(x for x in group.rollouts if x.sample_index == idx)
      r.reward = float(result.reward.total)  # correctness + weighted format reward
      r.reward_info = dict(result.reward.components)
      r.verifier_status = result.status
      r.verified = result.t_finished
      if result.status == "ok":
        self.last_verified = time.time()
      complete = (len(group.rollouts) == self.cfg.rl.group_size and
                  all(x.verifier_status != "pending" for x in group.rollouts))
      if complete:
        del self._groups[gid]
    self.acc.verified(result)
    if complete:
      group.rollouts.sort(key=lambda x: x.sample_index)
      for x in group.rollouts:
        x.enqueued = time.time()
      self.queue.put(group)

  def check_verifier_outage(self) -> None:
    """A verifier that stops answering `ok` (all timeouts or errors) ends the run after
    rl.verifier_patience_s instead of training on zero rewards or waiting forever."""
    patience = self.cfg.rl.verifier_patience_s
    if time.time() - self.last_verified > patience:
      raise RunError(f"no completion was verified ok for {patience:g}s "
                     f"(rl.verifier_patience_s); verifier statuses so far: "
                     f"{self.acc.verifier_statuses()}")

  # -- weights -----------------------------------------------------------------------

  def stage(self, pub: Publication) -> None:
    """Hands published weights to the sampler; any thread. Swapped in between decode
    calls (multi-process: at the sample event that names the version)."""
    pub.staged = time.perf_counter()
    with self.lock:
      self._staged = {v: p for v, p in self._staged.items() if v >= self.requested_version}
      self._staged[pub.version] = pub

  def _newest_staged(self) -> int | None:
    with self.lock:
      newest = max(self._staged, default=None)
    return newest if newest is not None and newest > self.requested_version else None

  def swap_to(self, version: int) -> None:
    """Gives the generator the staged weights of `version` (sampler thread)."""
    t0 = time.perf_counter()
    with self.lock:
      pub = self._staged[version]
    self.generator.update_params(pub.params, version)
    self.requested_version = version
    self.acc.weight_sync("wait_inflight_s", t0 - pub.staged)
    self.acc.weight_sync("pause_s", time.perf_counter() - t0)

  def cut_state(self) -> tuple[dict, Any, int, Any]:
    """(outstanding groups, prompt iterator state, next group id, counts) of one moment."""
    with self.lock, self.acc.lock:
      return ({gid: dict(v) for gid, v in self.outstanding.items()}, self.prompts.get_state(),
              self.next_group_id, collections.Counter(self.acc.counts))

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
For a task with an environment (tool use), `episodes` (rl_jax/orchestration/episodes.py)
applies the tool results that arrived before the step, and turns the turns it parked
into tool calls after it; a parked sequence holds its KV pages but no decode slot, so
the slot serves other sequences while the tool runs.

A group whose verification ends in an error or timeout for any rollout is dropped when
verifier.on_error="drop" (the default): never queued, counted, and its admission credit
returned at once (RolloutQueue.drop); sync mode admits a replacement once every group of
its window is complete, so the set of groups generated together stays reproducible.

Dynamic sampling (rl.filter_groups="zero_variance", StalenessPolicy.filters): a verified
group whose rewards are all equal carries no GRPO signal. Async mode filters it at once
like a drop (counted, credit returned, the sampler admits a replacement and keeps
decoding). Sync mode holds the uniform groups of a round until every group of the round
is complete, then filters them in group-id order (reproducible) and admits replacements
at the same policy version. Past the policy's per-step budget ((rl.max_oversample - 1) x
rl.groups_per_step filtered) uniform groups are queued and trained (zero advantage),
counted as groups_uniform_capped. Multi-turn episodes are verified, and so filtered, the
same way. rl.overlong="penalty" adds grpo.overlong_penalty to each rollout's reward before
the group is judged.

Verifier outage (rl.verifier_patience_s): the patience clock runs only while the
pipeline waits on the verifier, i.e. while verifier calls are outstanding, or while the
trainer waits for a batch and the newest result was a failure; each ok result resets it.
A slow train step, a long compilation or admission paused by a full queue leaves no call
outstanding and the trainer not waiting, so it never counts.
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
from rl_jax.trainer import grpo
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
               pool, on_error: Callable[[BaseException], None], episodes=None):
    self.cfg, self.task, self.prompts, self.tokenizer = cfg, task, prompts, tokenizer
    self.queue, self.policy, self.acc, self.schedule = queue, policy, accounting, schedule
    self.pool = pool  # None: rewards come from elsewhere (a multi-process follower)
    self.episodes = episodes  # an EpisodeDriver for tasks with an environment, else None
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
    self._completing: dict[int, Group] = {}  # complete, verified, not yet queued
    self._staged: dict[int, Publication] = {}
    self.requested_version = 0  # newest version handed to the generator
    self.published_at: dict[int, float] = {}  # version -> launch time (time.time())
    self.verifying = 0  # verifier calls submitted, no result yet
    self._starved_s = 0.0  # outage seconds counted since the last ok result
    self._since: float | None = None  # monotonic start of the outstanding time not yet counted
    self._last_ok = True  # whether the newest verifier result was ok
    # Sync mode: the first group of the current window (steps done when it was admitted,
    # its id, the prompt state before it) and the window's dropped groups (id -> rollouts),
    # for the checkpoint cut; drops not yet replaced; drops not yet in a train event.
    self.sync_window: tuple[int, int, Any] | None = None
    self.dropped: dict[int, int] = {}
    self.filtered: dict[int, int] = {}  # the window's filtered groups (id -> rollouts)
    self._sync_uniform: list[Group] = []  # sync: uniform groups of the round, undecided
    self._filter_window = [0, 0]  # steps done, groups filtered while filling that step
    self._sync_dropped = 0
    self._new_drops: list[int] = []
    self._restored: list[tuple[Group, dict]] = []  # see restore_in_flight
    self._stop = threading.Event()
    self._pause = threading.Event()
    self._paused = threading.Event()
    self._thread: threading.Thread | None = None

  # -- the thread --------------------------------------------------------------------

  def start(self) -> None:
    self._continue_restored()
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
        if self.episodes is not None:
          self.acc.parked(self.generator.num_parked, self.generator.parked_pages)
        v = self.generator.version
        if v != last_version:
          with self.lock:
            published = self.published_at.get(v)
          if published is not None:
            self.acc.weight_sync("lag_s", time.time() - published)
          self._note_merges()
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
      if self.episodes is not None:
        self.episodes.drain(gen)
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
      if self.episodes is not None:
        finished += self.episodes.after_step(gen)
    return busy, finished

  # -- admission ---------------------------------------------------------------------

  def admit(self) -> list[int]:
    """Admits groups while the generator and the staleness policy allow; their ids."""
    gen = self.generator
    admitted = []
    if self.policy.sync:
      self._settle_uniform_round()
      with self.lock:
        if self._sync_dropped and not self._groups:
          # Replacements start once every group of the window is complete, so which
          # groups run together (and the verifier call order) never depends on when a
          # verifier callback ran: sync runs stay reproducible bit for bit.
          self.sync_admitted -= self._sync_dropped
          self._sync_dropped = 0
    # Sync mode admits nothing past the last step's window (async keeps its lead).
    last = self.policy.sync and self.steps_done >= self.cfg.rl.total_steps
    while not last and gen.has_capacity() and self.queue.can_admit():
      if not self.policy.barrier_allows(
          admitted=self.sync_admitted, steps_done=self.steps_done,
          sampler_version=gen.version, trainer_version=self.trainer_version):
        break
      self.sync_admitted += 1
      gid = self.admit_one()
      admitted.append(gid)
      if self.policy.sync and (self.sync_window is None or self.sync_window[0] != self.steps_done):
        with self.lock:
          self.sync_window = (self.steps_done, gid, self.outstanding[gid]["prompts"])
          self.dropped, self.filtered = {}, {}
    return admitted

  def _settle_uniform_round(self) -> None:
    """Sync: once every group of the round is complete, filters its uniform groups in id
    order while the budget lasts (each to be replaced) and queues the rest."""
    with self.lock:
      if self._groups or not self._sync_uniform:
        return
      uniform = sorted(self._sync_uniform, key=lambda g: g.group_id)
      self._sync_uniform = []
      verdicts = [self._judge_uniform(g) for g in uniform]
      for g, filtered in zip(uniform, verdicts):
        if filtered:
          self.filtered[g.group_id] = len(g.rollouts)
          self._sync_dropped += 1
    for g, filtered in zip(uniform, verdicts):
      self._filter_or_queue(g, filtered)

  def _judge_uniform(self, group: Group) -> bool:
    """Whether a uniform group is filtered (under self.lock); settles it if so."""
    if self._filter_window[0] != self.steps_done:
      self._filter_window = [self.steps_done, 0]
    if not self.policy.filters([r.reward for r in group.rollouts], self._filter_window[1]):
      return False
    self._filter_window[1] += 1
    self.outstanding.pop(group.group_id, None)
    self._new_drops.append(group.group_id)
    return True

  def _filter_or_queue(self, group: Group, filtered: bool) -> None:
    if filtered:
      self.acc.filtered(group)
      self.queue.drop()
      return
    if self.policy.uniform([r.reward for r in group.rollouts]):
      self.acc.count("groups_uniform_capped")
    group.rollouts.sort(key=lambda x: x.sample_index)
    for x in group.rollouts:
      x.enqueued = time.time()
    self.queue.put(group)
    with self.lock:
      self._completing.pop(group.group_id, None)

  def admit_one(self) -> int:
    """Draws the next prompt as group `next_group_id` and adds it to the generator."""
    with self.lock:
      # One critical section, so a checkpoint sees the iterator, the id cursor and the
      # outstanding groups of a single moment.
      before = self.prompts.get_state()
      record = next(self.prompts)
      gid = self.next_group_id
      self.next_group_id += 1
      self.outstanding[gid] = {"prompts": before, "rollouts": 0, "index": int(record["index"])}
      self.acc.counts["groups_admitted"] += 1
      group = Group(group_id=gid, example=self.task.example(int(record["index"])),
                    prompt_tokens=np.asarray(record["prompt_tokens"], np.int32),
                    admitted=time.time(), index=int(record["index"]))
      self._groups[gid] = group
    self.queue.admitted()
    seed = self.cfg.seed * 1_000_003 + gid
    if self.episodes is None:
      self.generator.add_group(gid, group.prompt_tokens, self.cfg.rl.group_size, seed=seed)
    else:
      self.episodes.add_group(gid, group.example, self.cfg.rl.group_size)
      self.generator.add_group(gid, group.prompt_tokens, self.cfg.rl.group_size, seed=seed,
                               **self.episodes.group_kwargs())
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

  def on_rollout_finished(self, r, verify: bool = True) -> None:
    """A finished rollout joins its group, is counted, and goes to the verifiers (not
    with `verify` False: a checkpoint after the pipeline stopped keeps it unverified)."""
    verify = verify and self.pool is not None
    with self.lock:
      group = self._groups[r.group_id]
      group.rollouts.append(r)
      self.outstanding[r.group_id]["rollouts"] += 1
      if verify:
        self._tick(time.monotonic())
        self._since = self._since if self.verifying else time.monotonic()
        self.verifying += 1
    calls = None if self.episodes is None else self.episodes.finished(r)
    self.acc.rollout_finished(r, tool_calls=calls)
    r.completion_text = self.tokenizer.decode(r.completion_tokens)
    if verify:
      self.pool.submit((r.group_id, r.sample_index), group.example, r.completion_text,
                       callback=self._on_verified)

  def _verify_again(self, group: Group, r) -> None:
    """A restored rollout whose verification the checkpoint cut short: submitted again
    (it was counted as generated before the checkpoint)."""
    with self.lock:
      self._tick(time.monotonic())
      self._since = self._since if self.verifying else time.monotonic()
      self.verifying += 1
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
      self._tick(time.monotonic())
      self.verifying -= 1
      self._since = self._since if self.verifying else None
      self._last_ok = result.status == "ok"
      if self._last_ok:
        self._starved_s = 0.0
      group = self._groups.get(gid)
      if group is None:
        return
      r = next(x for x in group.rollouts if x.sample_index == idx)
      # correctness + weighted format reward (+ the overlong penalty when asked)
      r.reward = float(result.reward.total) + self._overlong_penalty(r)
      r.reward_info = dict(result.reward.components)
      r.verifier_status = result.status
      r.verified = result.t_finished
      complete = (len(group.rollouts) == self.cfg.rl.group_size and
                  all(x.verifier_status != "pending" for x in group.rollouts))
      decision = self._decide(group) if complete else None
    self.acc.verified(result)
    if complete:
      self.acc.count("groups_completed")
      self._carry_out(group, *decision)

  def _decide(self, group: Group) -> tuple[bool, bool, bool]:
    """A verified group's fate (under self.lock): (dropped for a verifier error, held
    for the sync round's filtering, filtered); it leaves the groups being generated."""
    drop = self.cfg.verifier.on_error == "drop" and any(
        x.verifier_status != "ok" for x in group.rollouts)
    uniform = not drop and self.policy.uniform([x.reward for x in group.rollouts])
    hold = uniform and self.policy.sync  # decided when the round is complete
    filtered = uniform and not hold and self._judge_uniform(group)
    gid = group.group_id
    del self._groups[gid]
    if hold:
      self._sync_uniform.append(group)
    if drop:
      self.outstanding.pop(gid, None)
      self._new_drops.append(gid)
      if self.policy.sync:
        self.dropped[gid] = len(group.rollouts)
        self._sync_dropped += 1
    if not (drop or hold or filtered):
      self._completing[gid] = group  # until it is queued (a checkpoint's cut sees it)
    return drop, hold, filtered

  def _carry_out(self, group: Group, drop: bool, hold: bool, filtered: bool) -> None:
    if drop:
      self.acc.dropped(group)
      self.queue.drop()
    elif not hold:
      self._filter_or_queue(group, filtered)

  def _overlong_penalty(self, r) -> float:
    """rl.overlong="penalty": grpo.overlong_penalty of the completion's length against
    the episode's token limit (env.max_total_tokens, else sampler.max_new_tokens)."""
    rl = self.cfg.rl
    if rl.overlong != "penalty":
      return 0.0
    limit = self.cfg.sampler.max_new_tokens
    if self.episodes is not None and self.cfg.env.max_total_tokens:
      limit = self.cfg.env.max_total_tokens
    penalty = float(grpo.overlong_penalty(lengths_b=np.asarray([r.num_tokens]),
                                          max_len=limit, buffer=rl.overlong_buffer)[0])
    if penalty < 0:
      self.acc.count("rollouts_overlong_penalized")
    return penalty

  def _tick(self, now: float) -> None:
    """Counts the outstanding time up to `now` (under self.lock)."""
    if self._since is not None:
      self._starved_s += now - self._since
      self._since = now

  def reset_verifier_clock(self) -> None:
    with self.lock:
      self._starved_s, self._since = 0.0, (time.monotonic() if self.verifying else None)

  def check_verifier_outage(self, waited_s: float) -> None:
    """The trainer, after waiting `waited_s` for a group: a verifier that hangs or stops
    answering `ok` ends the run after rl.verifier_patience_s of waiting on it (module
    docstring) instead of waiting forever or starving the trainer."""
    patience = self.cfg.rl.verifier_patience_s
    with self.lock:
      self._tick(time.monotonic())
      if not self.verifying and not self._last_ok:
        self._starved_s += waited_s
      starved, outstanding = self._starved_s, self.verifying
    if starved > patience:
      raise RunError(f"the verifier returned no ok result in {patience:g}s of waiting on it "
                     f"(rl.verifier_patience_s): {outstanding} calls outstanding, results so "
                     f"far {self.acc.verifier_statuses()}")

  def take_drops(self) -> list[int]:
    """Groups dropped for verifier errors or filtered since the last call (for the
    train event: followers drop them too)."""
    with self.lock:
      drops, self._new_drops = self._new_drops, []
    return drops

  def restore_queued(self, groups: list[Group]) -> None:
    """Verified groups a checkpoint carried: queued again (followers keep them for the
    leader's train events); admitted and counted before the checkpoint."""
    with self.lock:
      for g in groups:
        self.outstanding[g.group_id] = {"prompts": None, "rollouts": len(g.rollouts),
                                        "index": g.index}
        if self.schedule.follower:
          self._groups[g.group_id] = g
    if not self.schedule.follower:
      for g in groups:
        self.queue.admitted()
        self.queue.put(g)

  def restore_in_flight(self, groups: list[Group], partial: dict[int, dict]) -> None:
    """Groups a checkpoint carried that were being verified or generated (admitted and
    counted before it), with the samples decoded partway (`partial`: group id ->
    {sample index: (tokens, logprobs, versions)}). They count as in flight now; start()
    submits their unverified rollouts to the verifiers again and gives the generator
    their unfinished samples, which continue from their tokens."""
    with self.lock:
      for g in groups:
        self.outstanding[g.group_id] = {"prompts": None, "rollouts": len(g.rollouts),
                                        "index": g.index}
        self._groups[g.group_id] = g
        self._restored.append((g, partial.get(g.group_id, {})))
    for _ in groups:
      self.queue.admitted()

  def _continue_restored(self) -> None:
    restored, self._restored = self._restored, []
    size = self.cfg.rl.group_size
    for g, partial in restored:
      for r in g.rollouts:
        if r.verifier_status == "pending":
          self._verify_again(g, r)
      done = {r.sample_index for r in g.rollouts}
      todo = [i for i in range(size) if i not in done]
      if not todo and all(r.verifier_status != "pending" for r in g.rollouts):
        # Verified before the cut, not yet queued: its fate is decided now.
        with self.lock:
          decision = self._decide(g)
        self._carry_out(g, *decision)
      elif todo:
        self.generator.add_group(g.group_id, g.prompt_tokens, size,
                                 seed=self.cfg.seed * 1_000_003 + g.group_id, samples=todo,
                                 restored={i: v for i, v in partial.items() if i in todo})

  def take_partial(self) -> dict[int, dict]:
    """For a checkpoint, with the sampler thread paused or stopped: the samples decoded
    partway (Generator.snapshot); rollouts that finished in the call on the device go on
    to verification as the sampler thread would send them (kept unverified once the
    pipeline has stopped: they are verified after the resume)."""
    if self.generator is None:
      return {}
    partial, finished = self.generator.snapshot()
    for r in finished:  # after the pipeline stopped, kept unverified (verified on resume)
      self.on_rollout_finished(r, verify=not self._stop.is_set())
    return partial

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

  def _note_merges(self) -> None:
    """weight_sync/merge_s of each LoRA merge since the last call (the sampler's, at its
    swaps, and the held-out evaluator's: Engine.merger.seconds)."""
    merger = getattr(self.generator.engine, "merger", None)
    while merger is not None and merger.seconds:
      self.acc.weight_sync("merge_s", merger.seconds.popleft())

  def cut_state(self) -> dict:
    """The admission state of one moment: outstanding groups, prompt iterator state, next
    group id, counts, the queued groups, the groups being generated or verified (copies),
    the sync window and its dropped groups."""
    with self.lock, self.acc.lock:
      # Copies: verifier callbacks go on scoring the live rollouts.
      generating = [dataclasses.replace(g, rollouts=[dataclasses.replace(r) for r in g.rollouts])
                    for g in [*self._groups.values(), *self._completing.values()]]
      return {"outstanding": {gid: dict(v) for gid, v in self.outstanding.items()},
              "prompts": self.prompts.get_state(), "next_gid": self.next_group_id,
              "counts": collections.Counter(self.acc.counts), "queued": self.queue.groups(),
              "generating": generating,
              "sync_window": self.sync_window, "dropped": dict(self.dropped),
              "filtered": dict(self.filtered)}

"""Synchronous and asynchronous GRPO on one code path.

Threads: the sampler thread admits groups and steps the generator; verifier workers
score finished rollouts and put complete groups on the bounded queue; the trainer (the
calling thread) consumes groups, trains, and publishes weights.

  sync:  the sampler admits exactly `groups_per_step` groups per policy version and then
         waits for the next publication (the barrier); every trained token is on-policy.
  async: the sampler admits while in-flight + queued groups <= max_inflight_groups
         (default (max_staleness + 1) * groups_per_step) and the queue has room; the
         trainer discards groups whose staleness exceeds max_staleness; new weights reach
         running sequences between decode steps when inflight_weight_updates is on.

Staleness of a group at consumption = trainer_version - min over its tokens' versions.
Held-out evaluation pauses the sampler and the clock, so wall_time_s compares modes on
the pipeline alone.

Checkpoints (checkpoint.every > 0, rl_jax.checkpoint) hold the trainer state and the loop
state at a cut in the stream of groups: every group id below `next_group_id` is settled
(trained, discarded as stale, or lost). Sync mode cuts before the first group not yet
trained, so a resumed run admits those groups again with the same ids, prompts and seeds
and, batches being ordered by group id, repeats the uninterrupted run bit for bit. Async
mode cuts at the last admission; the groups then in flight or queued are lost on resume
(counted in summary.json, never repeated). Faults: SIGTERM saves at the next step
boundary and raises Preempted; a failure in any thread stops every thread, saves when the
trainer state is consistent, and raises RunError.

Multi-process (jax.distributed): process 0 runs this pipeline and logs every piece of
device work with its decisions before launching it (sample: admitted group ids and the
weight version to swap in; train: the batch's group ids and rewards; evaluate; save);
the other processes run no sampler thread and no verifiers and replay the log in order
(`_follow`), so all processes launch the same computations in the same order. See
rl_jax/orchestration/multihost.py.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

from rl_jax import config as config_lib
from rl_jax import metrics as metrics_lib
from rl_jax.types import Group
from rl_jax.orchestration.rollout_queue import RolloutQueue


class RunError(RuntimeError):
  """A run that cannot continue: one sentence for the user."""


class Preempted(Exception):
  """The run stopped after SIGTERM; the message says which checkpoint holds its state."""


class _Clock:
  """Wall clock that can be paused (held-out evaluation is not pipeline time)."""

  def __init__(self, start_s: float = 0.0):
    self._start = time.perf_counter() - start_s  # a resumed run continues its clock
    self._paused_total = 0.0
    self._paused_at = None

  def pause(self):
    self._paused_at = time.perf_counter()

  def resume(self):
    self._paused_total += time.perf_counter() - self._paused_at
    self._paused_at = None

  def now(self) -> float:
    t = self._paused_at if self._paused_at is not None else time.perf_counter()
    return t - self._start - self._paused_total


class BusyTimer:
  """Accumulates busy seconds of one role; the fraction is busy / pipeline wall time."""

  def __init__(self):
    self.busy_s = 0.0
    self.intervals: list[tuple[float, float]] = []

  def add(self, start: float, end: float):
    self.busy_s += end - start
    if len(self.intervals) < 20000:
      self.intervals.append((start, end))


class Reservoir:
  """A uniform sample of at most `cap` of the values seen (for the planner's fits)."""

  def __init__(self, cap: int = 20000, seed: int = 0):
    self.cap, self.seen, self.values = cap, 0, []
    self._rng = np.random.default_rng(seed)

  def extend(self, values) -> None:
    for v in values:
      self.seen += 1
      if len(self.values) < self.cap:
        self.values.append(v)
      else:
        j = int(self._rng.integers(0, self.seen))
        if j < self.cap:
          self.values[j] = v


class Pipeline:
  """Builds every part from a validated config and runs the chosen mode."""

  def __init__(self, cfg, workdir: str):
    import jax
    from rl_jax import model as model_lib
    from rl_jax import sharding
    from rl_jax.data import prompts as prompts_lib
    from rl_jax.sampler.engine import Engine, Sampling
    from rl_jax.tasks import make_task
    from rl_jax.tasks.verifier_pool import VerifierPool
    from rl_jax.trainer.train_step import Trainer
    from rl_jax.orchestration.weight_sync import WeightSync

    self.cfg = cfg
    self.workdir = workdir
    self.mode = cfg.rl.mode
    self.sync = self.mode == "sync"
    from rl_jax.orchestration import multihost
    self.multi_process = multihost.multi_process()
    # Multi-process: process 0 leads (logs its scheduling decisions before launching
    # device work), the others replay its log (rl_jax/orchestration/multihost.py).
    self.events = multihost.EventLog() if self.multi_process else None
    self.follower = self.events is not None and not self.events.leader
    self._log_events = False  # the leader logs only while the RL loop runs
    self._published_params: dict[int, Any] = {}  # multi-process: sampler weights by version
    self._requested_version = 0  # newest version handed to the generator
    # Multi-process: sub-meshes take devices from every process, and every process
    # makes the same host-side decisions (rl_jax/orchestration/multihost.py).
    self.meshes = sharding.make_meshes(
        cfg.mesh, multihost.role_devices() if self.multi_process else None)
    if cfg.model.path:
      model_cfg, init_params = model_lib.from_pretrained(cfg.model.path)
      model_cfg = model_cfg.replace(dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
          remat=cfg.model.remat, attention=cfg.model.attention)
    else:
      model_cfg = model_lib.get_preset(cfg.model.preset).replace(
          dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
          remat=cfg.model.remat, attention=cfg.model.attention)
      init_params = None
    self.model_cfg = model_cfg
    self.tokenizer = model_lib.load_tokenizer(cfg.model.preset, path=cfg.model.path)
    self.task = make_task(cfg.task, seed=cfg.seed, on_bad_line=cfg.data.on_bad_line)
    shard = (multihost.prompt_shard() if self.multi_process
             else (jax.process_index(), jax.process_count()))
    self.prompts = prompts_lib.make_prompt_source(
        self.task, cfg.data, self.tokenizer, seed=cfg.seed,
        process_index=shard[0], process_count=shard[1])
    heldout_examples = self.task.heldout_examples()
    records = prompts_lib.heldout_records(self.task, cfg.data, self.tokenizer)
    self.heldout = [heldout_examples[r["index"]] for r in records]
    self.heldout_prompts = [r["prompt_tokens"] for r in records]

    self.trainer = Trainer(model_cfg, cfg.trainer, self.meshes.trainer,
                           total_steps=cfg.rl.total_steps,
                           sft_learning_rate=cfg.warmstart.learning_rate,
                           loss_norm_len=cfg.trainer.loss_norm_len or cfg.sampler.max_new_tokens)
    rng = jax.random.PRNGKey(cfg.seed)
    self.state = self.trainer.init_state(params=init_params, rng=rng)
    from rl_jax.orchestration.weight_sync import LayoutError
    try:
      self.weight_sync = WeightSync(
          logical_axes=model_lib.param_logical_axes(model_cfg),
          param_shapes=jax.eval_shape(lambda: self.state.params),
          trainer_shardings=self.trainer.param_shardings,
          sampler_mesh=self.meshes.sampler, sampler_dtype=cfg.sampler.dtype,
          colocated=self.meshes.colocated)
    except LayoutError as e:
      raise RunError(str(e)) from None
    self.engine = Engine.from_config(cfg.sampler, model_cfg, mesh=self.meshes.sampler,
                                     tokenizer=self.tokenizer)
    if self.multi_process:
      self.engine = multihost.ReplicatedOutputs(self.engine)
    self.sampling = Sampling(temperature=cfg.sampler.temperature, top_k=cfg.sampler.top_k,
                             top_p=cfg.sampler.top_p)
    # Generators are made once the first weights are published (see run()).
    self.generator = None
    self.evaluator = None
    # Followers take process 0's rewards from the event log and verify nothing.
    self.pool = None if self.follower else VerifierPool(self.task, cfg.verifier, seed=cfg.seed)

    max_inflight = config_lib.max_inflight_groups(cfg)
    if self.sync:
      max_inflight = cfg.rl.groups_per_step
    self.queue = RolloutQueue(cfg.rl.queue_maxsize, max_inflight)
    self.writer = metrics_lib.MetricWriter(workdir, cfg.metrics.tensorboard,
                                           enabled=jax.process_index() == 0)
    self.console = metrics_lib.Console(cfg.metrics.console and jax.process_index() == 0)

    self.version = 0  # trainer-owned policy version
    self._published_at: dict[int, float] = {}
    self._lock = threading.Lock()  # guards the counters below, never held across device work
    self._stop = threading.Event()
    self._pause = threading.Event()
    self._paused = threading.Event()
    self._error: BaseException | None = None
    self._discarded_ids: list[int] = []  # stale groups dropped since the last train event
    self._steps_done = 0  # optimizer steps completed (read by the sampler thread)
    self._sync_admitted = 0  # groups admitted so far in sync mode
    self._groups: dict[int, Group] = {}
    self._next_group_id = 0
    self.clock = _Clock()
    self.sampler_busy = BusyTimer()
    self.trainer_busy = BusyTimer()
    self.counts = collections.Counter()
    self.trained_log: list[tuple[int, int, int]] = []  # (trainer version, group id, staleness)
    self.staleness_hist: collections.Counter = collections.Counter()
    self.discarded_by_version: collections.Counter = collections.Counter()
    self.finished_rollouts: list = []  # since the last log line
    self.verifier_latencies: list[float] = []  # submitted -> scored (includes waiting)
    self.verifier_service: list[float] = []  # started -> scored
    self.all_lengths = Reservoir(seed=1)  # completion lengths, for the planner
    self.all_service = Reservoir(seed=2)
    self.prompt_tokens_total = 0
    self.step_times: list[float] = []
    self.padded_tokens = 0
    self.sampler_tokens = 0
    self.trainer_tokens = 0
    self.sync_durations: list[float] = []
    self.sync_lags: list[float] = []
    self.last_verified = time.time()
    # Admitted groups not yet trained or discarded: id -> {"prompts": iterator state before
    # the group was drawn, "rollouts": finished so far}. Guarded by _lock with admission.
    self._outstanding: dict[int, dict] = {}
    self._resumes: list[dict] = []  # one entry per resume in this run's lineage
    # [sum, count] of weight-sync durations and lags before the last resume.
    self._carried: dict[str, list[float]] = {"weight_sync_s": [0.0, 0],
                                             "weight_sync_lag_s": [0.0, 0]}
    self._heldout_initial: float | None = None
    self._curve: list | None = None  # the held-out curve so far; set once RL starts
    self._consistent = True  # False while a train step owns (donates) self.state
    self._preempt = threading.Event()
    self._metric_marks = collections.Counter()  # counters at the last metrics row
    self.checkpoint_blocking_s = 0.0
    self.last_checkpoint_step: int | None = None
    self.checkpointer = None
    if cfg.checkpoint.every > 0:
      from rl_jax import checkpoint as checkpoint_lib
      self.checkpointer = checkpoint_lib.Checkpointer(workdir, cfg.checkpoint)

  def _make_generators(self, sampler_params) -> None:
    from rl_jax.sampler.generator import Generator
    self.generator = Generator(self.engine, sampler_params, version=self.version,
                               inflight_weight_updates=self.cfg.rl.inflight_weight_updates,
                               sampling=self.sampling)
    # The held-out evaluator has its own decode state (same engine and compiled code), so
    # evaluation never disturbs the sequences the RL sampler has in flight.
    self.evaluator = Generator(self.engine, sampler_params, version=self.version,
                               sampling=self.sampling)

  def _start_publish(self, params, version: int):
    """Launches the weight sync of `version`; returns the function that waits for it and
    hands the weights to the sampler. Multi-process, the sampler takes them at the
    sample event that names the version instead (see _sample_once)."""
    sampler_params, finish = self.weight_sync.start(params, version)
    with self._lock:
      self._published_at[version] = time.time()
      if self.events is not None:
        self._published_params = {v: p for v, p in self._published_params.items()
                                  if v >= self._requested_version}
        self._published_params[version] = sampler_params

    def done() -> None:
      stats = finish()
      if self.generator is None:
        self._make_generators(sampler_params)
        self._requested_version = version
      elif self.events is None:
        self.generator.update_params(sampler_params, version)
      self.sync_durations.append(stats.duration_s)
      self.last_sync = stats
    return done

  def _publish(self, params, version: int) -> None:
    self._start_publish(params, version)()

  def _event(self, kind: str, **payload):
    """The leader's event context (multi-process, while the RL loop runs); else none."""
    if self.events is None or self.follower or not self._log_events:
      return contextlib.nullcontext()
    return self.events.event(kind, **payload)

  def _newer_version(self) -> int | None:
    """Multi-process: the newest published version the generator has not been given."""
    with self._lock:
      newest = max(self._published_params, default=None)
    return newest if newest is not None and newest > self._requested_version else None

  def _swap_to(self, version: int) -> None:
    self.generator.update_params(self._published_params[version], version)
    self._requested_version = version

  def _sampler_loop(self) -> None:
    try:
      gen = self.generator
      last_version = -1
      while not self._stop.is_set():
        if self._pause.is_set():
          self._paused.set()
          while self._pause.is_set() and not self._stop.is_set():
            time.sleep(0.005)
          self._paused.clear()
          continue
        t0 = self.clock.now()
        stepped = self._sample_once()
        if stepped is None:  # multi-process leader with nothing to do
          self.queue.wait_changed(0.005)
          continue
        busy, finished = stepped
        if busy:
          self.sampler_busy.add(t0, self.clock.now())
        v = gen.version
        if v != last_version:
          with self._lock:
            published = self._published_at.get(v)
          if published is not None:
            self.sync_lags.append(time.time() - published)
          last_version = v
        for r in finished:
          self._on_rollout_finished(r)
        if not busy and not finished:
          self.queue.wait_changed(0.005)
    except BaseException as e:  # surfaced to the trainer thread, which stops the run
      self._fail(e)

  def _sample_once(self):
    """Admission and one Generator.step: (busy, finished rollouts), or None when the
    multi-process leader had nothing to launch. The leader logs the admitted group ids
    and the weight version to swap in before launching (under the event lock)."""
    gen = self.generator
    logging = self.events is not None and self._log_events
    with self.events.lock if logging else contextlib.nullcontext():
      admitted = self._admit()
      busy = gen.num_active > 0 or gen.num_pending > 0
      if logging:
        version = self._newer_version()
        if not admitted and version is None and not busy:
          return None
        self.events.put("sample", gids=admitted, version=version)
        if version is not None:
          self._swap_to(version)
      # An idle step still swaps in published weights (the sync barrier relies on it).
      finished = gen.step()
    return busy, finished

  def _admit(self) -> list[int]:
    """Admits groups while admission control allows; their ids."""
    cfg = self.cfg
    gen = self.generator
    admitted = []
    while gen.has_capacity() and self.queue.can_admit():
      if self.sync:
        # The barrier: one batch of groups_per_step groups per optimizer step, admitted
        # only once the previous step is done and its weights (if published) are in use.
        if (self._sync_admitted >= (self._steps_done + 1) * cfg.rl.groups_per_step
            or gen.version != self.version):
          break
        self._sync_admitted += 1
      admitted.append(self._admit_one())
    return admitted

  def _admit_one(self) -> int:
    """Draws the next prompt as group `_next_group_id` and adds it to the generator."""
    cfg = self.cfg
    gen = self.generator
    with self._lock:
      # One critical section, so a checkpoint sees the iterator, the id cursor and the
      # outstanding groups of a single moment.
      before = self.prompts.get_state()
      record = next(self.prompts)
      gid = self._next_group_id
      self._next_group_id += 1
      self._outstanding[gid] = {"prompts": before, "rollouts": 0}
      self.counts["groups_admitted"] += 1
    example = self.task.example(int(record["index"]))
    now = time.time()
    group = Group(group_id=gid, example=example,
                  prompt_tokens=np.asarray(record["prompt_tokens"], np.int32), admitted=now)
    with self._lock:
      self._groups[gid] = group
    if not self.follower:
      self.queue.admitted()
    gen.add_group(gid, group.prompt_tokens, cfg.rl.group_size,
                  seed=cfg.seed * 1_000_003 + gid)
    return gid

  def _on_rollout_finished(self, r) -> None:
    with self._lock:
      group = self._groups[r.group_id]
      group.rollouts.append(r)
      self._outstanding[r.group_id]["rollouts"] += 1
      if not self.follower:  # the leader's log lines drain it
        self.finished_rollouts.append(r)
      self.counts["rollouts_generated"] += 1
      self.sampler_tokens += r.num_tokens
      self.prompt_tokens_total += len(r.prompt_tokens)
    r.completion_text = self.tokenizer.decode(r.completion_tokens)
    if self.follower:
      return  # rewards come with the train event
    self.pool.submit((r.group_id, r.sample_index), group.example, r.completion_text,
                     callback=self._on_verified)

  def _on_verified(self, key, result) -> None:
    # The pool only logs a callback's exception; the run must stop on it instead of
    # waiting for a group that can no longer complete.
    try:
      self._record_verified(key, result)
    except BaseException as e:
      self._fail(e)

  def _record_verified(self, key, result) -> None:
    gid, idx = key
    with self._lock:
      group = self._groups.get(gid)
      if group is None:
        return
      r = next(x for x in group.rollouts if x.sample_index == idx)
      r.reward = float(result.reward.total)  # correctness + weighted format reward
      r.reward_info = dict(result.reward.components)
      r.verifier_status = result.status
      r.verified = result.t_finished
      self.verifier_latencies.append(result.latency_s)
      self.verifier_service.append(result.t_finished - result.t_started)
      self.counts[f"verifier_{result.status}"] += 1
      if result.status == "ok":
        self.last_verified = time.time()
      complete = (len(group.rollouts) == self.cfg.rl.group_size and
                  all(x.verifier_status != "pending" for x in group.rollouts))
      if complete:
        del self._groups[gid]
    if complete:
      group.rollouts.sort(key=lambda x: x.sample_index)
      for x in group.rollouts:
        x.enqueued = time.time()
      self.queue.put(group)

  def _fail(self, e: BaseException) -> None:
    with self._lock:
      if self._error is None:
        self._error = e
    self._stop.set()
    self.queue.close()

  def _check(self) -> None:
    if self._error is not None:
      e = self._error
      if isinstance(e, (RunError, config_lib.ConfigError)):
        raise e
      detail = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[-1]
      raise RunError(f"a worker thread failed: {detail}") from e

  def _check_verifier_outage(self) -> None:
    """A verifier that stops answering `ok` (all timeouts or errors) ends the run after
    rl.verifier_patience_s instead of training on zero rewards or waiting forever."""
    patience = self.cfg.rl.verifier_patience_s
    if time.time() - self.last_verified > patience:
      statuses = {k[9:]: v for k, v in self.counts.items() if k.startswith("verifier_")}
      raise RunError(f"no completion was verified ok for {patience:g}s "
                     f"(rl.verifier_patience_s); verifier statuses so far: {statuses}")

  def _next_batch(self) -> list[Group]:
    """Pulls eligible groups, discarding those past the staleness bound."""
    cfg = self.cfg
    batch: list[Group] = []
    bound = 0 if self.sync else cfg.rl.max_staleness
    while len(batch) < cfg.rl.groups_per_step:
      self._check()
      if self._preempt.is_set():
        raise Preempted()
      group = self.queue.get(timeout=0.2)
      if group is None:
        self._check_verifier_outage()
        continue
      self._check_verifier_outage()
      s = group.staleness(self.version)
      if s > bound:
        self.queue.release()
        self.counts["groups_discarded_stale"] += 1
        self.counts["rollouts_discarded_stale"] += len(group.rollouts)
        self.discarded_by_version[min(r.min_version for r in group.rollouts)] += 1
        self._discarded_ids.append(group.group_id)
        with self._lock:
          self._outstanding.pop(group.group_id, None)
        continue
      self.staleness_hist[s] += 1
      self.trained_log.append((self.version, group.group_id, s))
      batch.append(group)
    if self.sync:
      # Verifier completion order must not reach the update: summation order in the
      # loss follows the rows, and sync runs are reproducible bit for bit.
      batch.sort(key=lambda g: g.group_id)
    self._batch_staleness = [g.staleness(self.version) for g in batch]
    return batch

  def evaluate(self) -> float:
    """Greedy held-out reward with the current trainer params; pauses the sampler."""
    from rl_jax.tasks import evaluate as evaluate_task
    self.clock.pause()
    self._pause.set()
    while self._sampler_thread is not None and self._sampler_thread.is_alive() \
        and not self._paused.is_set() and not self._stop.is_set():
      time.sleep(0.002)
    try:
      with self._event("evaluate"):
        params, _ = self.weight_sync.transfer(self.state.params, self.version)
        self.evaluator.update_params(params, self.version)
        completions = self.evaluator.generate(self.heldout_prompts, greedy=True,
                                              max_new_tokens=self.cfg.sampler.max_new_tokens)
      texts = [self.tokenizer.decode(c) for c in completions]
      result = evaluate_task(self.task, self.heldout, texts)
    finally:
      self._pause.clear()
      self.clock.resume()
    return float(result["reward_mean"])

  def warmstart(self) -> None:
    from rl_jax.data.prompts import encode_prompt
    w = self.cfg.warmstart
    if w.steps <= 0:
      return
    rng = np.random.default_rng(self.cfg.seed + 7)
    n = self.task.num_train
    sft = self.trainer.init_sft_state(params=self.state.params)
    for step in range(w.steps):
      if self._preempt.is_set():
        raise Preempted()
      idx = rng.integers(0, n, size=w.batch_size)
      examples = [self.task.example(int(i)) for i in idx]
      prompts = [encode_prompt(e.prompt, tokenizer=self.tokenizer,
                               max_length=self.cfg.data.max_prompt_length)[0] for e in examples]
      completions = [self.tokenizer.encode(self.task.demonstration(e)) + [self.tokenizer.eos_id]
                     for e in examples]
      sft, m = self.trainer.sft_step(sft, self.trainer.make_sft_batch(prompts, completions))
      if step % 50 == 0 or step == w.steps - 1:
        self.console.message(f"warm-up step {step}: loss {m['loss']:.3f} "
                             f"token accuracy {m['token_accuracy']:.3f}")
    # RL starts from the warmed-up params with fresh optimizer moments; with kl_beta > 0
    # they are also the reference policy.
    self.state = self.trainer.init_state(params=sft.params)

  def run(self) -> dict:
    """Warm-up (or resume from the newest checkpoint), train, evaluate; the summary.

    Raises Preempted after SIGTERM and RunError when any thread fails; both save a
    checkpoint first when checkpointing is on and the trainer state is consistent.
    """
    self._sampler_thread = None
    restore_sigterm = self._catch_sigterm()
    try:
      return self._run()
    finally:
      restore_sigterm()
      self.writer.close()  # also on failure: metrics.jsonl keeps what was written
      self._close_checkpointer(failing=sys.exc_info()[0] is not None)

  def _close_checkpointer(self, failing: bool) -> None:
    """Waits for background saves; a failed write is a RunError unless the run is
    already failing with another error (then it is a warning line)."""
    if self.checkpointer is None:
      return
    try:
      self.checkpointer.close()
    except Exception as e:  # noqa: BLE001  (whatever the storage layer raises)
      text = (f"writing a checkpoint to {self.checkpointer.directory} failed: "
              f"{type(e).__name__}: {e}")
      if not failing:
        raise RunError(text) from e
      print(f"warning: {text}", file=sys.stderr, flush=True)

  def _run(self) -> dict:
    cfg = self.cfg
    resumed = self._restore()
    step = 0 if resumed is None else resumed["step"]
    self._steps_done = step
    self._sync_admitted = step * cfg.rl.groups_per_step
    try:
      if resumed is None:
        self.warmstart()
        self._publish(self.state.params, self.version)
        heldout_initial = self.evaluate()
        self.console.message(f"{self.mode} GRPO: held-out reward at start {heldout_initial:.3f}")
        self.clock = _Clock()
        curve = [[0.0, 0, heldout_initial]]
      else:
        self._publish(self.state.params, self.version)
        self.clock = _Clock(start_s=resumed["wall_time_s"])
        heldout_initial, curve = resumed["heldout_initial"], resumed["heldout_curve"]
      self._heldout_initial, self._curve = heldout_initial, curve
      if resumed is None:
        self._save(step, heldout=heldout_initial)
      self.last_verified = time.time()  # verifier patience counts from the pipeline's start
      if step < cfg.rl.total_steps and self.follower:  # (a resumed run may be done)
        step = self._follow(step)
      elif step < cfg.rl.total_steps:
        self._log_events = self.events is not None
        self._sampler_thread = threading.Thread(target=self._sampler_loop, name="sampler",
                                                daemon=True)
        self._sampler_thread.start()
      self._held_groups = 0  # trained but not yet published
      heldout = curve[-1][2]
      last_log_t = self.clock.now()
      last_log_tokens = (self.sampler_tokens, self.trainer_tokens)
      while step < cfg.rl.total_steps:
        groups = self._next_batch()
        t0 = self.clock.now()
        batch = self.trainer.make_train_batch(groups)
        publish = (step + 1) % cfg.rl.weight_sync_every == 0
        t_step = time.perf_counter()
        self._consistent = False  # the step donates self.state; version and counters follow
        discarded, self._discarded_ids = self._discarded_ids, []
        with self._event("train", gids=[g.group_id for g in groups],
                         rewards=[[r.reward for r in g.rollouts] for g in groups],
                         discarded=discarded, publish=publish):
          # The step's params are exactly version self.version's only right after a
          # publication; otherwise no token measures the train/inference mismatch.
          exact = step % cfg.rl.weight_sync_every == 0
          self.state, result = self.trainer.dispatch_step(
              self.state, batch, policy_version=self.version if exact else -1)
          if publish:
            self.version += 1
            published = self._start_publish(self.state.params, self.version)
        tm = result()
        self.step_times.append(time.perf_counter() - t_step)
        self.padded_tokens += int(batch.tokens_bt.size)
        step += 1
        trained = sum(len(g.rollouts) for g in groups)
        self.counts["rollouts_trained"] += trained
        self.trainer_tokens += int(tm.get("tokens", 0))
        with self._lock:
          for g in groups:
            self._outstanding.pop(g.group_id, None)
        if publish:
          published()
        # Async releases trained groups from the admission count only once their version
        # is published; sync trains every batch at the version that generated it.
        self._held_groups += len(groups)
        if self.sync or step % cfg.rl.weight_sync_every == 0:
          self.queue.release(self._held_groups)
          self._held_groups = 0
        self._steps_done = step
        self._consistent = True
        self.trainer_busy.add(t0, self.clock.now())
        evaluated = False
        if cfg.rl.eval_every and step % cfg.rl.eval_every == 0 and step < cfg.rl.total_steps:
          heldout = self.evaluate()
          curve.append([self.clock.now(), step, heldout])
          evaluated = True
        # The last step is saved after the final evaluation, below. With keep_best every
        # evaluated step is saved, so the best one can be kept.
        every = cfg.checkpoint.every
        if every and step < cfg.rl.total_steps and (
            step % every == 0 or (evaluated and cfg.checkpoint.keep_best)):
          self._save(step, heldout=heldout if evaluated else None)
        if step % cfg.metrics.log_every == 0 or step == cfg.rl.total_steps:
          now = self.clock.now()
          row = self._step_metrics(step, groups, tm, heldout, now - last_log_t, last_log_tokens)
          row.update(self._fault_metrics())
          last_log_t, last_log_tokens = now, (self.sampler_tokens, self.trainer_tokens)
          self.writer.write(step, row)
          self.console.line(row)
        if self._preempt.is_set():
          raise Preempted()
      wall = self.clock.now()
      if self._log_events:
        self._stop_workers()  # the sampler logs nothing after the end event
        with self.events.lock:
          self.events.put("end")
        self._log_events = False
    except BaseException as e:
      self._stop_workers()
      if self._log_events:
        self._log_events = False
        line = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
        # Best effort: a sampler stuck in a collective (a follower died) keeps the lock.
        if self.events.lock.acquire(timeout=60):
          try:
            self.events.put("abort", message=line[-1] if line else type(e).__name__,
                            save=self._consistent)
          finally:
            self.events.lock.release()
      error = self._abort(e, step)
      if error is e:
        raise
      raise error from e
    finally:
      self._stop_workers()
    self._check()
    heldout_final = self.evaluate()
    # Saved before the final point joins the curve: resuming a finished run evaluates
    # again and appends it once.
    self._save(step, heldout=heldout_final, wait=True)
    if self.follower:  # process 0 writes the summary
      return {"process_index": self.events_index, "optimizer_steps": step,
              "policy_version": self.version, "heldout_reward_final": heldout_final}
    curve.append([wall, step, heldout_final])
    summary = self._summary(wall, step, heldout_initial, heldout_final, curve)
    self.writer.write(step, {"reward/heldout": heldout_final})
    self.writer.close()
    return summary

  def _follow(self, step: int) -> int:
    """Followers: performs process 0's events in its order until the loop's end event;
    the optimizer steps done by then."""
    from rl_jax.orchestration.multihost import MultiHostError
    while True:
      try:
        kind, p = self.events.next()
      except MultiHostError as e:
        raise RunError(str(e)) from None
      if kind == "sample":
        for gid in p["gids"]:
          got = self._admit_one()
          if got != gid:
            raise RunError(f"process {self.events_index} admitted group {got} where process "
                           f"0 admitted {gid}; the processes have diverged")
        if p["version"] is not None:
          self._swap_to(p["version"])
        for r in self.generator.step():
          self._on_rollout_finished(r)
      elif kind == "train":
        step = self._replay_train(p, step)
      elif kind == "evaluate":
        self.evaluate()
      elif kind == "save":
        self._save(p["step"], heldout=p["heldout"], wait=p["wait"])
      elif kind == "end":
        return step
      elif kind == "abort":
        self._consistent = bool(p["save"])  # save collectively iff process 0 saves
        raise RunError(f"process 0 stopped the run: {p['message']}")
      else:
        raise RunError(f"unknown event {kind!r} from process 0 (different rl_jax versions?)")

  @property
  def events_index(self) -> int:
    import jax
    return jax.process_index()

  def _replay_train(self, p: dict, step: int) -> int:
    """A follower's train event: the leader's groups with its rewards; no waiting."""
    with self._lock:
      for gid in p["discarded"]:
        self._groups.pop(gid, None)
        self._outstanding.pop(gid, None)
    groups = []
    for gid, rewards in zip(p["gids"], p["rewards"]):
      with self._lock:
        group = self._groups.pop(gid, None)
      if group is None or len(group.rollouts) != len(rewards):
        raise RunError(f"process {self.events_index} lacks the rollouts of group {gid} that "
                       f"process 0 trains on; the processes have diverged")
      group.rollouts.sort(key=lambda x: x.sample_index)
      for r, reward in zip(group.rollouts, rewards):
        r.reward = float(reward)
      groups.append(group)
    batch = self.trainer.make_train_batch(groups)
    self._consistent = False
    exact = step % self.cfg.rl.weight_sync_every == 0  # as in the leader's loop
    self.state, _ = self.trainer.dispatch_step(
        self.state, batch, policy_version=self.version if exact else -1)
    if p["publish"]:
      self.version += 1
      self._start_publish(self.state.params, self.version)  # taken at a sample event
    with self._lock:
      for g in groups:
        self._outstanding.pop(g.group_id, None)
    step += 1
    self._steps_done = step
    self._consistent = True
    return step

  def _stop_workers(self) -> None:
    self._stop.set()
    self.queue.close()
    if self._sampler_thread is not None:
      self._sampler_thread.join(timeout=30)
    if self.pool is not None:
      self.pool.close()

  def _catch_sigterm(self):
    """Routes SIGTERM to a stop at the next step boundary (see _abort); past
    checkpoint.grace_period_s the process exits without waiting for the save. Returns
    the function that puts the previous handler back and disarms that deadline."""
    if threading.current_thread() is not threading.main_thread():
      return lambda: None  # signal handlers can only be set from the main thread
    grace = float(self.cfg.checkpoint.grace_period_s)
    timers = []

    def give_up():
      sys.stderr.write(f"error: SIGTERM: the checkpoint could not be saved within "
                       f"checkpoint.grace_period_s={grace:g}s; exiting without it\n")
      sys.stderr.flush()
      os._exit(1)  # pylint: disable=protected-access

    def on_sigterm(signum, frame):
      del signum, frame
      if not self._preempt.is_set():
        self._preempt.set()
        timers.append(threading.Timer(grace, give_up))
        timers[0].daemon = True
        timers[0].start()

    previous = signal.signal(signal.SIGTERM, on_sigterm)

    def restore():
      signal.signal(signal.SIGTERM, previous)
      for timer in timers:
        timer.cancel()
    return restore

  def _abort(self, e: BaseException, step: int) -> BaseException:
    """The exception run() raises after `e` stopped training at `step` optimizer steps;
    saves the state first when it is consistent (no train step was cut short)."""
    if isinstance(e, KeyboardInterrupt):
      return e
    save_error = ""
    if self._consistent:
      try:
        self._save(step, wait=True)
      except Exception as err:  # noqa: BLE001  (the original failure matters more)
        save_error = f"; saving failed: {type(err).__name__}: {err}"
    latest = self.last_checkpoint_step
    if self.checkpointer is None:
      where = "checkpointing is off (checkpoint.every=0)"
    elif latest is None:
      where = "no checkpoint was saved yet"
    else:
      where = (f"{'saved' if latest == step else 'the newest is'} checkpoint step {latest} in "
               f"{self.checkpointer.directory}; rerun the same command to resume")
    where += save_error
    if isinstance(e, Preempted):
      return Preempted(f"preempted (SIGTERM) after {step} optimizer steps: {where}")
    if isinstance(e, config_lib.ConfigError):
      return e
    if isinstance(e, RunError) and not isinstance(e.__cause__, Exception):
      return RunError(f"{e} ({where})" if self.checkpointer is not None else str(e))
    # An unexpected exception: one line for the user, the traceback in the workdir.
    log = os.path.join(self.workdir, "error.log")
    with open(log, "a") as f:
      f.write("".join(traceback.format_exception(e)))
    detail = str(e) if isinstance(e, RunError) else (
        "the trainer failed: " +
        "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[-1])
    return RunError(f"{detail} (traceback in {log}; {where})")

  def _save(self, step: int, *, heldout: float | None = None, wait: bool = False) -> bool:
    """Checkpoints the state after `step` optimizer steps; False when checkpointing is
    off, RL has not started, or the step exists. Arrays are copied before it returns;
    the write finishes in the background unless `wait`."""
    if self.checkpointer is None or self._curve is None:
      return False
    t0 = time.perf_counter()
    with self._event("save", step=step, heldout=heldout, wait=wait):
      saved = self.checkpointer.save(
          step, params=self.state.params, opt_state=self.state.opt_state,
          ref_params=self.trainer.ref_params if self.cfg.trainer.kl_beta > 0 else None,
          loop=self._loop_state(step), heldout=heldout, wait=wait,
          config={"run": self.cfg.to_dict(), "model": dataclasses.asdict(self.model_cfg)})
    self.checkpoint_blocking_s += time.perf_counter() - t0
    if saved:
      self.last_checkpoint_step = step
    return saved

  def _loop_state(self, step: int) -> dict:
    """The JSON half of a checkpoint: the cut (module docstring), the trainer-side
    counters and everything summary.json accumulates."""
    import jax
    with self._lock:
      outstanding = {gid: dict(v) for gid, v in self._outstanding.items()}
      prompts_now = self.prompts.get_state()
      next_gid = self._next_group_id
      counts = collections.Counter(self.counts)
    if self.sync and outstanding:
      # Sync groups not yet trained all belong to the next version and were admitted in
      # id order: cut before the first; they are generated again after a resume.
      cut = min(outstanding)
      prompts, lost = outstanding[cut]["prompts"], []
      counts["groups_admitted"] -= next_gid - cut
      counts["rollouts_generated"] -= sum(v["rollouts"] for v in outstanding.values())
    else:
      cut, prompts, lost = next_gid, prompts_now, sorted(outstanding)
    train_step, skipped = jax.device_get((self.state.step, self.state.skipped))
    sync_s, lag_s = self._carried["weight_sync_s"], self._carried["weight_sync_lag_s"]
    return {
        "step": step, "train_step": int(train_step), "skipped": int(skipped),
        "version": self.version, "wall_time_s": self.clock.now(),
        "heldout_initial": self._heldout_initial, "heldout_curve": list(self._curve),
        "prompts": prompts, "next_group_id": cut,
        # Every group yields group_size verifier calls, so in sync mode this is the call
        # index the uninterrupted run reaches at the cut; in async mode it is unused yet.
        "verifier_calls": cut * self.cfg.rl.group_size,
        "lost_group_ids": lost, "lost_rollouts": sum(outstanding[g]["rollouts"] for g in lost),
        "counts": dict(counts),
        "staleness_hist": {str(k): v for k, v in self.staleness_hist.items()},
        "discarded_by_version": {str(k): v for k, v in self.discarded_by_version.items()},
        "sampler_tokens": self.sampler_tokens, "trainer_tokens": self.trainer_tokens,
        "prompt_tokens_total": self.prompt_tokens_total,
        "sampler_busy_s": self.sampler_busy.busy_s, "trainer_busy_s": self.trainer_busy.busy_s,
        "weight_sync_s": [sync_s[0] + sum(self.sync_durations),
                          sync_s[1] + len(self.sync_durations)],
        "weight_sync_lag_s": [lag_s[0] + sum(self.sync_lags), lag_s[1] + len(self.sync_lags)],
        "resumes": self._resumes,
    }

  def _restore(self) -> dict | None:
    """Loads the newest usable checkpoint into the pipeline; its loop state, or None for
    a fresh start. metrics.jsonl keeps only the rows up to the restored step."""
    import jax
    from rl_jax import checkpoint as checkpoint_lib
    from rl_jax.trainer.train_step import TrainState
    ck = self.checkpointer
    if ck is None:
      return None
    if ck.latest_step() is None:
      self._truncate_metrics(0)
      return None
    changed: list[str] = []

    def check(saved, where):
      changed[:] = checkpoint_lib.check_compatible(saved, self.cfg, self.model_cfg, where=where)

    def warn(text):
      print(text, file=sys.stderr, flush=True)

    kl = self.cfg.trainer.kl_beta > 0
    try:
      r = ck.restore(
          abstract_params=checkpoint_lib.abstract(self.state.params),
          abstract_opt_state=checkpoint_lib.abstract(self.state.opt_state),
          abstract_ref=(checkpoint_lib.abstract(self.state.params, self.trainer.compute_dtype)
                        if kl else None),
          check=check, warn=warn)
    except checkpoint_lib.RestoreError as e:
      raise RunError(str(e)) from None
    loop = r.loop
    sh = self.trainer.state_shardings
    self.state = TrainState(
        params=r.params, opt_state=r.opt_state,
        step=jax.device_put(np.int32(loop["train_step"]), sh.step),
        skipped=jax.device_put(np.int32(loop["skipped"]), sh.skipped))
    if kl:
      self.trainer.ref_params = r.ref_params
    self.version = int(loop["version"])
    self.prompts.set_state(loop["prompts"])
    self._next_group_id = int(loop["next_group_id"])
    # The pool draws each call's injected latency and failure from (seed, call index);
    # continuing the index keeps sync-mode rewards identical to an uninterrupted run.
    if self.pool is not None:
      self.pool._submitted = int(loop["verifier_calls"])  # pylint: disable=protected-access
    self.counts.update(loop["counts"])
    self.staleness_hist.update({int(k): v for k, v in loop["staleness_hist"].items()})
    self.discarded_by_version.update(
        {int(k): v for k, v in loop["discarded_by_version"].items()})
    self.sampler_tokens, self.trainer_tokens = loop["sampler_tokens"], loop["trainer_tokens"]
    self.prompt_tokens_total = loop["prompt_tokens_total"]
    self.sampler_busy.busy_s, self.trainer_busy.busy_s = (loop["sampler_busy_s"],
                                                          loop["trainer_busy_s"])
    self._carried = {k: list(loop[k]) for k in ("weight_sync_s", "weight_sync_lag_s")}
    lost = len(loop["lost_group_ids"])
    self.counts["groups_lost_on_resume"] += lost
    self.counts["rollouts_lost_on_resume"] += loop["lost_rollouts"]
    self._resumes = loop["resumes"] + [{"step": r.step, "groups_lost": lost,
                                        "skipped_steps": r.skipped_steps}]
    self.last_checkpoint_step = r.step
    self._truncate_metrics(r.step)
    self.console.message(
        f"resumed from {ck.where(r.step)} (policy version {self.version}); "
        f"{lost} groups in flight there are lost on resume")
    if changed:
      warn("warning: config fields changed since the checkpoint: " + "; ".join(changed))
    return loop

  def _truncate_metrics(self, step: int) -> None:
    """Drops metrics.jsonl rows after `step` (work a crash threw away) and the final
    held-out row of a finished run (written again at its end), in place: the writer
    holds the file open for appending."""
    path = os.path.join(self.workdir, "metrics.jsonl")
    if not self.writer.enabled or not os.path.exists(path):
      return

    def keep(line):
      try:
        row = json.loads(line)
      except json.JSONDecodeError:  # the half-written last line of a killed run
        return False
      return row["step"] < step or (row["step"] == step and "optim/loss" in row)
    with open(path, "r+") as f:
      kept = [line for line in f if keep(line)]
      f.seek(0)
      f.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
      f.truncate()

  def _fault_metrics(self) -> dict:
    """Verifier health and checkpoint/resume counters for the metrics row."""
    statuses = {s: self.counts[f"verifier_{s}"] for s in ("ok", "timeout", "error")}
    delta = {s: n - self._metric_marks[s] for s, n in statuses.items()}
    self._metric_marks.update(delta)
    results = sum(delta.values())
    blocking, self.checkpoint_blocking_s = self.checkpoint_blocking_s, 0.0
    return {
        "verifier/error_rate": (delta["timeout"] + delta["error"]) / results if results else 0.0,
        "verifier/timeouts_total": statuses["timeout"],
        "verifier/errors_total": statuses["error"],
        "data/groups_admitted": self.counts["groups_admitted"],
        "data/groups_lost_on_resume": self.counts["groups_lost_on_resume"],
        "checkpoint/blocking_s": blocking,
        "checkpoint/last_step": -1 if self.last_checkpoint_step is None
                                else self.last_checkpoint_step,
    }

  def _resume_summary(self) -> dict:
    """summary.json fields on group accounting and resumes:
    groups_admitted = trained + discarded_stale + lost_on_resume + in_flight_at_end."""
    c = self.counts
    with self._lock:
      in_flight = len(self._outstanding)
    means = {}
    for key, values in (("weight_sync_s", self.sync_durations),
                        ("weight_sync_lag_s", self.sync_lags)):
      total, n = self._carried[key]
      means[key + "_mean"] = (total + sum(values)) / max(n + len(values), 1)
    return {
        **means,
        "groups_admitted": c["groups_admitted"],
        "groups_trained": sum(self.staleness_hist.values()),
        "groups_discarded_stale": c["groups_discarded_stale"],
        "groups_lost_on_resume": c["groups_lost_on_resume"],
        "groups_in_flight_at_end": in_flight,
        "rollouts_lost_on_resume": c["rollouts_lost_on_resume"],
        "rollouts_in_flight_at_end": (c["rollouts_generated"] - c["rollouts_trained"] -
                                      c["rollouts_discarded_stale"] -
                                      c["rollouts_lost_on_resume"]),
        "resumes": self._resumes,
        "last_checkpoint_step": self.last_checkpoint_step,
    }

  def _step_metrics(self, step, groups, tm, heldout, dt, last_tokens) -> dict:
    with self._lock:
      finished, self.finished_rollouts = self.finished_rollouts, []
      vlat, self.verifier_latencies = self.verifier_latencies, []
      vserv, self.verifier_service = self.verifier_service, []
    lengths = [r.num_tokens for r in finished]
    self.all_lengths.extend(lengths)
    self.all_service.extend(vserv)
    step_times, self.step_times = self.step_times, []
    padded, self.padded_tokens = self.padded_tokens, 0
    rollout_lat = [r.finished - r.admitted for r in finished if r.admitted]
    q = self.queue.snapshot()
    dt = max(dt, 1e-9)
    row: dict[str, Any] = {
        "step": step,
        "time_s": self.clock.now(),
        "sampler/tokens_per_s": (self.sampler_tokens - last_tokens[0]) / dt,
        "sampler/rollouts_per_s": len(finished) / dt,
        "sampler/active_slots": self.generator.num_active,
        "sampler/kv_pages_used": self.generator.kv_pages_used,
        "sampler/busy_frac": self.sampler_busy.busy_s / max(self.clock.now(), 1e-9),
        "trainer/tokens_per_s": (self.trainer_tokens - last_tokens[1]) / dt,
        "trainer/busy_frac": self.trainer_busy.busy_s / max(self.clock.now(), 1e-9),
        "queue/depth": q["depth"], "queue/inflight_groups": q["inflight"],
        "queue/enqueued_total": q["enqueued_total"], "queue/dequeued_total": q["dequeued_total"],
        "queue/oldest_age_s": q["oldest_age_s"],
        "weight_sync/version": self.version,
        "weight_sync/duration_s": self.sync_durations[-1] if self.sync_durations else 0.0,
        "weight_sync/bytes": self.weight_sync.bytes,
        "weight_sync/lag_s": self.sync_lags[-1] if self.sync_lags else 0.0,
        "reward/train": float(np.mean([r.reward for g in groups for r in g.rollouts])),
        "reward/heldout": heldout,
        "staleness/accepted": sum(self.staleness_hist.values()),
        "staleness/discarded": self.counts["groups_discarded_stale"],
        "cost/sampler_device_s": self.sampler_busy.busy_s * self.meshes.sampler.devices.size,
        "cost/trainer_device_s": self.trainer_busy.busy_s * self.meshes.trainer.devices.size,
    }
    st = self._batch_staleness
    row["staleness/mean"] = float(np.mean(st))
    row["staleness/max"] = int(np.max(st))
    for k, v in sorted(self.staleness_hist.items()):
      row[f"staleness/hist_{k}"] = v
    for v, n in sorted(self.discarded_by_version.items()):
      row[f"staleness/discarded_v{v}"] = n
    for k, v in metrics_lib.percentiles(lengths).items():
      row[f"lengths/{k}"] = v
    row["lengths/truncation_rate"] = (
        float(np.mean([r.finish_reason == "length" for r in finished])) if finished else 0.0)
    for k, v in metrics_lib.percentiles(rollout_lat, (50, 95, 99)).items():
      row[f"latency/rollout_{k}"] = v
    for k, v in metrics_lib.percentiles(vlat, (50, 95, 99)).items():
      row[f"latency/verifier_{k}"] = v
    for k, v in metrics_lib.percentiles(vserv, (50, 95, 99)).items():
      row[f"latency/verifier_service_{k}"] = v
    row["latency/verifier_mean"] = float(np.mean(vlat)) if vlat else 0.0
    row["lengths/prompt_mean"] = (float(np.mean([len(r.prompt_tokens) for r in finished]))
                                  if finished else 0.0)
    row["sampler/generate_calls"] = self.generator.generate_calls
    row["sampler/preemptions"] = self.generator.preemptions
    row["trainer/step_time_s"] = float(np.mean(step_times)) if step_times else 0.0
    row["trainer/padded_tokens"] = padded
    policy_keys = ("kl", "entropy", "clip_frac_low", "clip_frac_high", "ratio_p1", "ratio_p50",
                   "ratio_p99", "tis_weight_mean", "tis_truncated_frac",
                   "behavior_prox_logp_gap", "logprob_mismatch_mean", "logprob_mismatch_max",
                   "logprob_mismatch_tokens")
    for k, v in tm.items():
      row[("policy/" if k in policy_keys else "optim/") + k] = v
    return row

  def _summary(self, wall, step, h0, h1, curve) -> dict:
    device_hours = (self.sampler_busy.busy_s * self.meshes.sampler.devices.size +
                    self.trainer_busy.busy_s * self.meshes.trainer.devices.size) / 3600
    total_devices = len({d.id for d in self.meshes.sampler.devices.flat} |
                        {d.id for d in self.meshes.trainer.devices.flat})
    summary = {
        "mode": self.mode,
        "wall_time_s": wall,
        "optimizer_steps": step,
        "policy_version": self.version,
        "heldout_reward_initial": h0,
        "heldout_reward_final": h1,
        "heldout_curve": curve,
        "rollouts_generated": self.counts["rollouts_generated"],
        "rollouts_trained": self.counts["rollouts_trained"],
        "rollouts_discarded_stale": self.counts["rollouts_discarded_stale"],
        "rollouts_in_flight_at_end": (self.counts["rollouts_generated"] -
                                      self.counts["rollouts_trained"] -
                                      self.counts["rollouts_discarded_stale"]),
        "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_hist.items())},
        "discarded_by_version": {str(k): v for k, v in sorted(self.discarded_by_version.items())},
        "sampler_tokens_per_s": self.sampler_tokens / max(wall, 1e-9),
        "trainer_tokens_per_s": self.trainer_tokens / max(wall, 1e-9),
        "weight_sync_s_mean": float(np.mean(self.sync_durations)) if self.sync_durations else 0.0,
        "weight_sync_lag_s_mean": float(np.mean(self.sync_lags)) if self.sync_lags else 0.0,
        "sampler_busy_frac": self.sampler_busy.busy_s / max(wall, 1e-9),
        "trainer_busy_frac": self.trainer_busy.busy_s / max(wall, 1e-9),
        "verifier_status": {k[9:]: v for k, v in self.counts.items() if k.startswith("verifier_")},
        "max_queue_depth": self.queue.max_depth_seen,
        "device_hours": device_hours,
        "reward_gain_per_device_hour": (h1 - h0) / device_hours if device_hours > 0 else 0.0,
        "devices": total_devices,
        "timeline": {"sampler": self.sampler_busy.intervals[-5000:],
                     "trainer": self.trainer_busy.intervals[-5000:]},
        "staleness_definition": metrics_lib.DESCRIPTIONS["staleness"],
        "completion_lengths": self.all_lengths.values,
        "verifier_service_s": self.all_service.values,
        "prompt_tokens_mean": self.prompt_tokens_total / max(self.counts["rollouts_generated"], 1),
    }
    summary.update(self._resume_summary())
    if self.writer.enabled:
      with open(os.path.join(self.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def run(cfg, workdir: str) -> dict:
  """Validates `cfg`, builds the pipeline and runs it; writes `<workdir>/summary.json`."""
  from rl_jax import distributed
  try:
    distributed.initialize()
    distributed.check_same_config(cfg.to_json())
  except distributed.DistributedError as e:
    raise RunError(str(e)) from None
  config_lib.validate(cfg)
  from rl_jax.orchestration import multihost
  from rl_jax import checkpoint as checkpoint_lib
  checkpoint_lib.validate_config(cfg)
  if cfg.checkpoint.every > 0:
    try:
      checkpoint_lib.check_workdir(cfg, workdir)
    except checkpoint_lib.RestoreError as e:
      raise RunError(str(e)) from None
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(cfg.to_json(indent=1))
  pipeline = Pipeline(cfg, workdir)
  summary = pipeline.run()
  multihost.write_digest(pipeline, summary)
  return summary


def evaluate_params(cfg, model_cfg, params, tokenizer) -> dict:
  """Greedy held-out evaluation of `params` (host or device arrays) with the pieces
  Pipeline.evaluate uses: the same held-out prompts, engine, Generator.generate and
  rl_jax.tasks.evaluate. Returns that dict (reward_mean, accuracy, n)."""
  from rl_jax import sharding
  from rl_jax.data import prompts as prompts_lib
  from rl_jax.sampler.engine import Engine
  from rl_jax.sampler.generator import Generator
  from rl_jax.tasks import evaluate as evaluate_task
  from rl_jax.tasks import make_task
  meshes = sharding.make_meshes(cfg.mesh)
  task = make_task(cfg.task, seed=cfg.seed, on_bad_line=cfg.data.on_bad_line)
  examples = task.heldout_examples()
  records = prompts_lib.heldout_records(task, cfg.data, tokenizer)
  engine = Engine.from_config(cfg.sampler, model_cfg, mesh=meshes.sampler, tokenizer=tokenizer)
  completions = Generator(engine, params).generate(
      [r["prompt_tokens"] for r in records], greedy=True,
      max_new_tokens=cfg.sampler.max_new_tokens)
  texts = [tokenizer.decode(c) for c in completions]
  return evaluate_task(task, [examples[r["index"]] for r in records], texts)

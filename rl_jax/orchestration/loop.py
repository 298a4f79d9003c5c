"""Synchronous and asynchronous GRPO on one code path.

  prompts -> sampler worker -> verifiers -> rollout queue -> trainer -> weight sync
             (admission,       (pool)       (bounded,        (staleness   (trainer mesh ->
              generation)                    backpressure)    filter,      sampler mesh,
                 ^                                            GRPO step)   staged)
                 +------------------------ new policy version <-----------------+

Threads: the sampler thread (rl_jax/orchestration/sampler_worker.py) admits groups and
steps the generator; verifier workers score finished rollouts and put complete groups on
the bounded queue; the trainer (the calling thread, `Pipeline.run`) consumes groups,
trains and publishes weights. With rl.filter_groups="zero_variance" the sampler worker
filters groups whose rewards are all equal and admits replacements, so every trained
batch is groups_per_step informative groups (up to rl.max_oversample). Every admission,
acceptance, publication and credit-release decision is the StalenessPolicy's
(rl_jax/orchestration/policy.py):

  sync:  the sampler admits exactly `groups_per_step` groups per optimizer step and then
         waits for the next publication (the barrier); every trained token is on-policy.
  async: the sampler admits while in-flight + queued groups <= max_inflight_groups
         (default (max_staleness + 1) * groups_per_step) and the queue has room; the
         trainer discards groups whose staleness exceeds max_staleness; new weights reach
         running sequences between decode steps when inflight_weight_updates is on.

Tool use: for a task with an environment (rl_jax/envs) every rollout is an episode of
model turns and tool observations; the sampler thread parks a sequence at each tool call
(its slot serves others, its pages stay), runs the call in the tool pool and resumes the
sequence with the observation (rl_jax/orchestration/episodes.py, whose ToolUse holds the
run's tool pool and held-out tool-call rates). Held-out evaluation runs whole greedy
episodes and also records the held-out tool-call rate.

Staleness of a group at consumption = trainer_version - min over its tokens' versions.
Held-out evaluation pauses the sampler and the clock, so wall_time_s compares modes on
the pipeline alone; its generator borrows the paused sampler's KV pool (no second
pool). Counters, the metrics row and summary.json: accounting.py. Checkpoints, resume,
SIGTERM and failures: checkpointing.py. Supervised warm-up: warmstart.py. The parts, built
from the config: build.py.

Live capacity control (rl.control, async): every rl.control_every steps the planner
refits its models from the run's own rows, on a background thread, and sets the admission
bound and decode slots (control.py).

Multi-process (jax.distributed): process 0 runs this pipeline and logs every piece of
device work with its decisions before launching it; the other processes run no sampler
thread and no verifiers and replay the log through the same `train_step`, admission and
evaluation code (`multihost.follow`, rl_jax/orchestration/multihost.py).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

from rl_jax import config as config_lib
from rl_jax import metrics as metrics_lib
from rl_jax.errors import UserError
from rl_jax.orchestration import build, checkpointing, control, warmstart
from rl_jax.orchestration.accounting import Clock
from rl_jax.orchestration.errors import Preempted, RunError
from rl_jax.orchestration.policy import StalenessPolicy
from rl_jax.orchestration.rollout_queue import RolloutQueue
from rl_jax.orchestration.sampler_worker import Publication
from rl_jax.types import Group

__all__ = ["Pipeline", "Preempted", "RunError", "run"]


class Pipeline:
  """Builds every part from a validated config and runs the chosen mode."""

  def __init__(self, cfg, workdir: str):
    import jax
    from rl_jax import sharding
    from rl_jax.orchestration import multihost
    self.cfg, self.workdir = cfg, workdir
    self.policy = StalenessPolicy.from_config(cfg.rl)
    multi = multihost.multi_process()
    # Multi-process: process 0 leads, the others replay its log; sub-meshes take devices
    # from every process and every process reads the one global prompt stream.
    self.schedule = multihost.Schedule(multihost.EventLog() if multi else None)
    self.meshes = sharding.make_meshes(cfg.mesh, multihost.role_devices() if multi else None)
    process0 = jax.process_index() == 0
    self.console = metrics_lib.Console(cfg.metrics.console and process0)
    init_params = build.make_data(self, multi)
    build.make_models(self, init_params, multi)
    self.queue = RolloutQueue(self.policy)
    self.writer = metrics_lib.MetricWriter(workdir, cfg.metrics.tensorboard, enabled=process0)
    build.make_workers(self)
    self.control = self._controls = None
    if control.active(cfg, jax.process_count()):
      # The controller's refit, decision and advice run in a process of their own.
      self._controls = control.make_executor(cfg)
      self.control = control.Controller(
          cfg, policy=self.policy, queue=self.queue, worker=self.worker, accounting=self.acc,
          console=self.console, executor=self._controls)
    note = control.inactive_note(cfg, jax.process_count())
    if note:
      self.console.message(note)
    self.version = 0  # trainer-owned policy version
    self.heldout_initial: float | None = None
    self.curve: list | None = None  # the held-out curve so far; set once RL starts
    self._error: BaseException | None = None
    self._error_lock = threading.Lock()
    self._consistent = True  # False while a train step owns (donates) self.state
    self._credit = 0  # trained groups whose admission credit is not yet released
    self._discarded: list[int] = []  # stale group ids since the last train event
    self._warned_oversample = False
    self._preempt = threading.Event()
    self.checkpoints = checkpointing.RunCheckpoints(self)
    self.acc.committed_step = self.checkpoints.last_step
    self.acc.data_counters = lambda: {
        **{f"prompts_{k}": v for k, v in self.prompts.counters.items()},
        **self.heldout.counters}

  def run(self) -> dict:
    """Warm-up (or resume from the newest checkpoint), train, evaluate; the summary.

    Raises Preempted after SIGTERM and RunError when any thread fails; both save a
    checkpoint first when checkpointing is on and the trainer state is consistent.
    """
    restore_sigterm = checkpointing.catch_sigterm(
        self._preempt, float(self.cfg.checkpoint.grace_period_s),
        saves=self.checkpoints.checkpointer is not None)
    try:
      return self._run()
    finally:
      restore_sigterm()
      if self._compiler is not None:  # after the final evaluation, which may compile
        self._compiler.shutdown(wait=False, cancel_futures=True)
      if self._controls is not None:
        self._controls.shutdown(wait=False, cancel_futures=True)
      self.writer.close()  # also on failure: metrics.jsonl keeps what was written
      self.checkpoints.close(failing=sys.exc_info()[0] is not None)

  def _run(self) -> dict:
    from rl_jax.orchestration import multihost
    resumed = self.checkpoints.restore()
    step = 0 if resumed is None else resumed["step"]
    total = self.cfg.rl.total_steps
    try:
      self._start(resumed)
      if step < total and self.schedule.follower:  # (a resumed run may be done)
        step = multihost.follow(self, step)
      elif step < total:
        self.schedule.start()
        self.worker.start()
      heldout = self.curve[-1][2]
      with self.console.heartbeat(self._progress):
        while step < total:
          groups = self._next_batch()
          t0 = self.acc.clock.now()
          tm = self.train_step(groups, publish=self.policy.publishes(step + 1))
          step += 1
          self.acc.trainer_busy.add(t0, self.acc.clock.now())
          heldout = self._after_step(step, groups, tm, heldout)
      wall = self.acc.clock.now()
      self._stop_workers()  # the sampler logs nothing after the end event
      self.schedule.end()
    except BaseException as e:
      self._stop_workers()
      self.schedule.abort(checkpointing.last_line(e), save=self._consistent)
      step = self.worker.steps_done  # a follower's steps are those it replayed
      error = self.checkpoints.abort(e, step, self._consistent)
      if error is e:
        raise
      raise error from e
    self._check()
    return self._finish(step, wall)

  def _start(self, resumed: dict | None) -> None:
    """Warms up and measures the initial held-out reward (or continues a restored
    checkpoint's loop state); publishes the first weights."""
    step = 0 if resumed is None else resumed["step"]
    self.worker.steps_done = step
    self.worker.sync_admitted = step * self.cfg.rl.groups_per_step
    if resumed is None:
      warmstart.run(self)
    self._publish_first()
    # Background compiles: the programs covering every sampler call compile before the
    # clock starts, so no call of the run waits for one (programs.compile_covers).
    self.worker.generator.compile_covers()
    if resumed is None:
      self.heldout_initial = self.evaluate()
      self.console.message(f"{self.cfg.rl.mode} GRPO: held-out reward at start "
                           f"{self.heldout_initial:.3f}")
      self.acc.clock = Clock()
      self.curve = [[0.0, 0, self.heldout_initial]]
      self._note_tool_rate(0.0, 0)
      self.checkpoints.save(step, heldout=self.heldout_initial)
    else:
      self.acc.clock = Clock(start_s=resumed["wall_time_s"])
      self.heldout_initial, self.curve = resumed["heldout_initial"], resumed["heldout_curve"]
    self.worker.reset_verifier_clock()

  def _progress(self) -> str:
    gen = self.worker.generator
    return (f"optimizer step {self.worker.steps_done + 1}/{self.cfg.rl.total_steps}: "
            f"{self.queue.snapshot()['depth']} groups queued, sampler at "
            f"{gen.tokens_generated:,} tokens and {gen.rollouts_finished:,} rollouts")

  def _after_step(self, step: int, groups, tm: dict, heldout):
    """Evaluation, checkpoint and the metrics row after optimizer step `step`."""
    cfg = self.cfg
    total = cfg.rl.total_steps
    evaluated = bool(cfg.rl.eval_every and step % cfg.rl.eval_every == 0 and step < total)
    if evaluated:
      heldout = self.evaluate()
      self.curve.append([self.acc.clock.now(), step, heldout])
      self._note_tool_rate(self.acc.clock.now(), step)
    # The last step is saved after the final evaluation, in _finish. With keep_best every
    # evaluated step is saved, so the best one can be kept.
    every = cfg.checkpoint.every
    if every and step < total and (step % every == 0 or (evaluated and cfg.checkpoint.keep_best)):
      self.checkpoints.save(step, heldout=heldout if evaluated else None)
    self._log_row(step, groups, tm, heldout)
    if self.acc.counts["groups_uniform_capped"] and not self._warned_oversample:
      self._warned_oversample = True
      self.console.message(
          f"warning: uniform-reward groups were trained (zero advantage) because filtering "
          f"reached rl.max_oversample={self.cfg.rl.max_oversample} x the batch in one step; "
          f"data/groups_uniform_capped counts them (warned once per run)")
    if self._preempt.is_set():
      raise Preempted()
    return heldout

  def _log_row(self, step: int, groups, tm: dict, heldout) -> None:
    if step % self.cfg.metrics.log_every and step != self.cfg.rl.total_steps:
      return
    row = self.acc.row(step=step, version=self.version, groups=groups, tm=tm,
                       heldout=(self.heldout_initial, heldout),
                       generator=self.worker.generator, queue=self.queue.snapshot(),
                       sync_bytes=self.weight_sync.bytes)
    attn = self.trainer.attention.record()
    row.update({"trainer/attention_kernel": attn["attention_kernel"],
                "trainer/attention_fallback": float(bool(attn["attention_fallback"]))})
    if self.control is not None:
      row.update(self.control.after_row(step, row))
    self.writer.write(step, row)
    self.console.line(row)

  def _finish(self, step: int, wall: float) -> dict:
    """The final evaluation and save; summary.json (process 0)."""
    heldout_final = self.evaluate()
    # Saved before the final point joins the curve: resuming a finished run evaluates
    # again and appends it once.
    self.checkpoints.save(step, heldout=heldout_final, wait=True)
    if self.schedule.follower:  # process 0 writes the summary
      import jax
      return {"process_index": jax.process_index(), "optimizer_steps": step,
              "policy_version": self.version, "heldout_reward_final": heldout_final}
    self.curve.append([wall, step, heldout_final])
    with self.worker.lock:
      in_flight = len(self.worker.outstanding)
    summary = self.acc.summary(
        wall=wall, step=step, version=self.version,
        heldout=(self.heldout_initial, heldout_final), curve=self.curve,
        max_queue_depth=self.queue.max_depth_seen, groups_in_flight=in_flight)
    summary.update(self.trainer.attention.record())
    programs = getattr(self.engine, "programs", None)
    if programs is not None:
      summary.update(sampler_programs_compiled_ahead=programs.compiled_ahead,
                     sampler_programs_compiled_inline=programs.compiled_inline,
                     sampler_programs_compiled_background=programs.compiled_background,
                     sampler_calls_covered=programs.covered_calls)
    summary.update(self.control.summary() if self.control is not None else {})
    if self.tools is not None:
      self.tools.note(wall, step)
      summary.update(self.tools.summary())
    if self.writer.enabled:
      with open(os.path.join(self.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    final_row = {"reward/heldout": heldout_final}
    if self.tools is not None:
      final_row["env/heldout_tool_call_rate"] = self.acc.heldout_tool_call_rate
    self.writer.write(step, final_row)
    self.writer.close()
    return summary

  def _next_batch(self) -> list[Group]:
    """Pulls groups_per_step groups the staleness policy accepts; the rest are discarded."""
    batch: list[Group] = []
    try:
      while len(batch) < self.cfg.rl.groups_per_step:
        self._check()
        if self._preempt.is_set():
          raise Preempted()
        t0 = time.monotonic()
        group = self.queue.get(timeout=0.2)
        waited = time.monotonic() - t0
        self.acc.data_wait_s += waited  # (microseconds when a group was queued)
        self.worker.check_verifier_outage(waited)
        if group is None:
          continue
        if not self.policy.accepts(group.staleness(self.version)):
          self.queue.release()
          self.acc.discarded(group)
          self._discarded.append(group.group_id)
          self.worker.settle([group.group_id])
          continue
        batch.append(group)
    except BaseException:
      # A batch cut short is not trained: its groups go back to the queue (a checkpoint
      # carries them), counted neither as trained nor as lost.
      self.queue.unget(batch)
      raise
    for group in batch:
      self.acc.accepted(self.version, group.group_id, group.staleness(self.version))
    if self.policy.sync:
      # Verifier completion order must not reach the update: summation order in the
      # loss follows the rows, and sync runs are reproducible bit for bit.
      batch.sort(key=lambda g: g.group_id)
    self.acc.batch_staleness = [g.staleness(self.version) for g in batch]
    return batch

  def train_step(self, groups: list[Group], *, publish: bool) -> dict:
    """One optimizer step on `groups`, the same on the leader and on followers: train,
    publish the next version when `publish`, settle the groups and release admission
    credit as the policy says. The step's metrics."""
    mask = self.cfg.rl.overlong == "mask"
    batch = self.trainer.make_train_batch(groups, mask_truncated=mask)
    if mask:
      self.acc.count("rollouts_overlong_masked", sum(
          r.finish_reason == "length" for g in groups for r in g.rollouts))
    t_step = time.perf_counter()
    self._consistent = False  # the step donates self.state; version and counters follow
    discarded, self._discarded = self._discarded + self.worker.take_drops(), []
    with self.schedule.event("train", gids=[g.group_id for g in groups],
                             rewards=[[r.reward for r in g.rollouts] for g in groups],
                             discarded=discarded, publish=publish):
      # The step's params are exactly the published version only right after a
      # publication; otherwise no token measures the train/inference mismatch.
      exact = self.policy.publishes(self.worker.steps_done)
      self.state, result = self.trainer.dispatch_step(
          self.state, batch, policy_version=self.version if exact else -1)
      if publish:
        self.version += 1
        self.worker.trainer_version = self.version
        pub, finish = self._launch_publication()
    tm = result()
    self.acc.trained(groups, tm, padded=int(tm["train/positions"]),
                     step_s=time.perf_counter() - t_step)
    self.worker.settle(g.group_id for g in groups)
    if publish:
      # The step is done, so what follows is the copy alone; the sampler takes the
      # weights at its next decode-call boundary without the trainer waiting for it.
      t_done = time.perf_counter()
      self.worker.stage(pub)
      finish()
      self.acc.weight_sync("transfer_s", time.perf_counter() - t_done)
    step = self.worker.steps_done + 1
    self._credit += len(groups)
    if self.policy.releases(step):
      self.queue.release(self._credit)
      self._credit = 0
    self.worker.steps_done = step
    self._consistent = True
    return tm

  def _launch_publication(self) -> tuple[Publication, callable]:
    """Launches the weight sync of the current version (no waiting)."""
    params, finish = self.weight_sync.start(self.state.params, self.version)
    pub = Publication(version=self.version, params=params, launched=time.time())
    with self.worker.lock:
      self.worker.published_at[self.version] = pub.launched
    return pub, finish

  def _publish_first(self) -> None:
    """The weights the generators start from (before the RL loop: no event)."""
    from rl_jax.sampler.generator import Generator
    if self.trainer.lora:
      # The frozen base reaches the sampler once (a resume has restored it by now); every
      # publication then merges the adapters into it on the sampler's devices.
      self.engine.set_base(self.trainer.base_params)
    pub, finish = self._launch_publication()
    t0 = time.perf_counter()
    finish()
    self.acc.weight_sync("transfer_s", time.perf_counter() - t0)
    self.worker.generator = Generator(
        self.engine, pub.params, version=self.version, sampling=self.sampling,
        inflight_weight_updates=self.cfg.rl.inflight_weight_updates)
    if self.control is not None:  # a resumed controller's slots (restored before this)
      self.worker.generator.set_slot_limit(self.control.slots)
    self.worker.requested_version = self.version
    # The held-out evaluator has its own slot registers but borrows the sampler's K/V
    # pool while the sampler is paused (Generator.lend_pool): same engine and compiled
    # code, no second pool, and the RL sequences in flight keep their pages.
    self.evaluator = Generator(self.engine, pub.params, version=self.version,
                               sampling=self.sampling, borrows_pool=True)

  def evaluate(self) -> float:
    """Greedy held-out reward with the current trainer params; pauses the sampler."""
    self.acc.clock.pause()
    try:
      with self.worker.paused():
        with self.schedule.event("evaluate"):
          params, _ = self.weight_sync.transfer(self.state.params, self.version)
          self.evaluator.update_params(params, self.version)
          completions = self.heldout.generate_beside(self.evaluator, self.worker.generator,
                                                     self.console)
        result = self.heldout.score(completions)
    finally:
      self.acc.clock.resume()
    if self.tools is not None:
      self.console.message(self.tools.heldout(result))
    return float(result["reward_mean"])

  def _note_tool_rate(self, wall: float, step: int) -> None:
    if self.tools is not None:
      self.tools.note(wall, step)

  def _fail(self, e: BaseException) -> None:
    """Any thread: records the first failure and stops the pipeline's threads."""
    with self._error_lock:
      if self._error is None:
        self._error = e
    self.worker.request_stop()
    self.queue.close()

  def _check(self) -> None:
    if self._error is not None:
      e = self._error
      if isinstance(e, (RunError, UserError)):
        raise e
      raise RunError(f"a worker thread failed: {checkpointing.last_line(e)}") from e

  def _stop_workers(self) -> None:
    self.worker.stop()
    self.queue.close()
    for pool in (self.pool, self.tools and self.tools.pool):
      if pool is not None:
        pool.close()


def run(cfg, workdir: str) -> dict:
  """Validates `cfg`, builds the pipeline and runs it; writes `<workdir>/summary.json`."""
  from rl_jax import checkpoint as checkpoint_lib
  from rl_jax import distributed
  from rl_jax.orchestration import multihost
  try:
    distributed.initialize()
    distributed.check_same_config(cfg.to_json())
  except distributed.DistributedError as e:
    raise RunError(str(e)) from None
  config_lib.validate(cfg)
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

"""Checkpoints of a run, and how a run that stops early leaves its state.

A checkpoint (checkpoint.every > 0, rl_jax.checkpoint) holds the trainer state and the
loop state at a cut in the stream of groups: every group id below `next_group_id` is
settled (trained, discarded as stale, or lost). Sync mode cuts before the first group not
yet trained, so a resumed run admits those groups again with the same ids, prompts and
seeds and, batches being ordered by group id, repeats the uninterrupted run bit for bit.
Async mode cuts at the last admission; the groups then in flight or queued are lost on
resume (counted in summary.json, never repeated).

Faults: SIGTERM saves at the next step boundary and raises Preempted (past
checkpoint.grace_period_s the process exits without waiting for the save); a failure in
any thread stops every thread, saves when the trainer state is consistent, and raises
RunError with one line (the traceback goes to <workdir>/error.log).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np

from rl_jax import config as config_lib
from rl_jax.orchestration.errors import Preempted, RunError


def _warn(text: str) -> None:
  print(text, file=sys.stderr, flush=True)


class RunCheckpoints:
  """Saves and restores a Pipeline (rl_jax/orchestration/loop.py) at the cut."""

  def __init__(self, pipeline):
    self.p = pipeline
    self.checkpointer = None
    if pipeline.cfg.checkpoint.every > 0:
      from rl_jax import checkpoint as checkpoint_lib
      self.checkpointer = checkpoint_lib.Checkpointer(pipeline.workdir, pipeline.cfg.checkpoint)

  def save(self, step: int, *, heldout: float | None = None, wait: bool = False) -> bool:
    """Checkpoints the state after `step` optimizer steps; False when checkpointing is
    off, RL has not started, or the step exists. Arrays are copied before it returns;
    the write finishes in the background unless `wait`."""
    p = self.p
    if self.checkpointer is None or p.curve is None:
      return False
    t0 = time.perf_counter()
    with p.schedule.event("save", step=step, heldout=heldout, wait=wait):
      saved = self.checkpointer.save(
          step, params=p.state.params, opt_state=p.state.opt_state,
          ref_params=p.trainer.ref_params if p.cfg.trainer.kl_beta > 0 else None,
          loop=self.loop_state(step), heldout=heldout, wait=wait,
          config={"run": p.cfg.to_dict(), "model": dataclasses.asdict(p.model_cfg)})
    p.acc.checkpoint_blocking_s += time.perf_counter() - t0
    if saved:
      p.acc.last_checkpoint_step = step
    return saved

  def loop_state(self, step: int) -> dict:
    """The JSON half of a checkpoint: the cut (module docstring), the trainer-side
    counters and everything summary.json accumulates."""
    import jax
    p = self.p
    outstanding, prompts_now, next_gid, counts = p.worker.cut_state()
    if p.policy.sync and outstanding:
      # Sync groups not yet trained all belong to the next version and were admitted in
      # id order: cut before the first; they are generated again after a resume.
      cut = min(outstanding)
      prompts, lost = outstanding[cut]["prompts"], []
      counts["groups_admitted"] -= next_gid - cut
      counts["rollouts_generated"] -= sum(v["rollouts"] for v in outstanding.values())
    else:
      cut, prompts, lost = next_gid, prompts_now, sorted(outstanding)
    train_step, skipped = jax.device_get((p.state.step, p.state.skipped))
    return {
        "step": step, "train_step": int(train_step), "skipped": int(skipped),
        "version": p.version, "wall_time_s": p.acc.clock.now(),
        "heldout_initial": p.heldout_initial, "heldout_curve": list(p.curve),
        "prompts": prompts, "next_group_id": cut,
        # Every group yields group_size verifier calls, so in sync mode this is the call
        # index the uninterrupted run reaches at the cut; in async mode it is unused yet.
        "verifier_calls": cut * p.cfg.rl.group_size,
        "lost_group_ids": lost, "lost_rollouts": sum(outstanding[g]["rollouts"] for g in lost),
        **p.acc.state(counts),
    }

  def restore(self) -> dict | None:
    """Loads the newest usable checkpoint into the pipeline; its loop state, or None for
    a fresh start. metrics.jsonl keeps only the rows up to the restored step."""
    import jax
    from rl_jax import checkpoint as checkpoint_lib
    from rl_jax.trainer.train_step import TrainState
    p, ck = self.p, self.checkpointer
    if ck is None:
      return None
    if ck.latest_step() is None:
      self.truncate_metrics(0)
      return None
    changed: list[str] = []

    def check(saved, where):
      changed[:] = checkpoint_lib.check_compatible(saved, p.cfg, p.model_cfg, where=where)

    kl = p.cfg.trainer.kl_beta > 0
    try:
      r = ck.restore(
          abstract_params=checkpoint_lib.abstract(p.state.params),
          abstract_opt_state=checkpoint_lib.abstract(p.state.opt_state),
          abstract_ref=(checkpoint_lib.abstract(p.state.params, p.trainer.compute_dtype)
                        if kl else None),
          check=check, warn=_warn)
    except checkpoint_lib.RestoreError as e:
      raise RunError(str(e)) from None
    loop = r.loop
    sh = p.trainer.state_shardings
    p.state = TrainState(
        params=r.params, opt_state=r.opt_state,
        step=jax.device_put(np.int32(loop["train_step"]), sh.step),
        skipped=jax.device_put(np.int32(loop["skipped"]), sh.skipped))
    if kl:
      p.trainer.ref_params = r.ref_params
    p.version = p.worker.trainer_version = int(loop["version"])
    p.prompts.set_state(loop["prompts"])
    p.worker.next_group_id = int(loop["next_group_id"])
    # The pool draws each call's injected latency and failure from (seed, call index);
    # continuing the index keeps sync-mode rewards identical to an uninterrupted run.
    if p.pool is not None:
      p.pool.continue_from(int(loop["verifier_calls"]))
    lost = p.acc.load(loop, step=r.step, skipped_steps=r.skipped_steps)
    self.truncate_metrics(r.step)
    p.console.message(
        f"resumed from {ck.where(r.step)} (policy version {p.version}); "
        f"{lost} groups in flight there are lost on resume")
    if changed:
      _warn("warning: config fields changed since the checkpoint: " + "; ".join(changed))
    return loop

  def truncate_metrics(self, step: int) -> None:
    """Drops metrics.jsonl rows after `step` (work a crash threw away) and the final
    held-out row of a finished run (written again at its end), in place: the writer
    holds the file open for appending."""
    path = os.path.join(self.p.workdir, "metrics.jsonl")
    if not self.p.writer.enabled or not os.path.exists(path):
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

  def close(self, failing: bool) -> None:
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
      _warn(f"warning: {text}")

  def abort(self, e: BaseException, step: int, consistent: bool) -> BaseException:
    """The exception run() raises after `e` stopped training at `step` optimizer steps;
    saves the state first when it is `consistent` (no train step was cut short)."""
    if isinstance(e, KeyboardInterrupt):
      return e
    save_error = ""
    if consistent:
      try:
        self.save(step, wait=True)
      except Exception as err:  # noqa: BLE001  (the original failure matters more)
        save_error = f"; saving failed: {type(err).__name__}: {err}"
    latest = self.p.acc.last_checkpoint_step
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
    log = os.path.join(self.p.workdir, "error.log")
    with open(log, "a") as f:
      f.write("".join(traceback.format_exception(e)))
    detail = str(e) if isinstance(e, RunError) else (
        "the trainer failed: " + last_line(e))
    return RunError(f"{detail} (traceback in {log}; {where})")


def last_line(e: BaseException) -> str:
  """The last line of the exception's own text (type: message)."""
  lines = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
  return lines[-1] if lines else type(e).__name__


def catch_sigterm(preempt: threading.Event, grace: float):
  """Routes SIGTERM to `preempt` (a stop at the next step boundary); past `grace` seconds
  the process exits without waiting for the save. Returns the function that puts the
  previous handler back and disarms that deadline."""
  if threading.current_thread() is not threading.main_thread():
    return lambda: None  # signal handlers can only be set from the main thread
  timers = []

  def give_up():
    sys.stderr.write(f"error: SIGTERM: the checkpoint could not be saved within "
                     f"checkpoint.grace_period_s={grace:g}s; exiting without it\n")
    sys.stderr.flush()
    os._exit(1)  # pylint: disable=protected-access

  def on_sigterm(signum, frame):
    del signum, frame
    if not preempt.is_set():
      preempt.set()
      timers.append(threading.Timer(grace, give_up))
      timers[0].daemon = True
      timers[0].start()

  previous = signal.signal(signal.SIGTERM, on_sigterm)

  def restore():
    signal.signal(signal.SIGTERM, previous)
    for timer in timers:
      timer.cancel()
  return restore

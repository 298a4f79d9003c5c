"""Live capacity control (rl.control): the capacity planner inside the run.

A window is rl.control_every optimizer steps; the first starts after the run's first
logged step (which holds the compilations), each later one at the step its predecessor's
decision was applied, so that a window is measured under the decision made for it.
`Controller.after_row` runs on the trainer thread after each step's metrics row; at a
window's end it only takes the window's measurement (its metrics rows with the row
before it, the increase of the filter-rate counters, the sampler/trainer busy
intervals) and submits the work to the loop's executor (make_executor: one process of
its own, so the computation never holds the run's GIL), which:
  1. checks the window's prediction against this measurement
     (rl_jax.planner.live.errors -> control/*_error);
  2. refits the planner's models from the window with rl_jax.planner.capacity.refit, the
     fit plan.py --profile / --validate use, with the lengths the next window starts
     from (planner.live.refit);
  3. decides the next window's admission bound and decode slots (planner.live.decide),
     never below the run's floor (planner.live.Floor, the feedback: a window whose
     trainer waited on an empty queue for more than 1% of its wall time, measured here
     from trainer/data_wait_frac before the submission, lifts it above the settings that
     window ran under; a window that held a stall does not count);
  4. advises what only a restart can change (planner.live.advise; another split must fit
     the memory the run's devices report, device_memory_gib), or reuses the last advice
     while the window's inputs stay within 10% of those it was computed on, for 3
     windows at most (planner.live.advice_current: most of a computation's time is the
     advice's simulations; control/advice_computed says which).
The first after_row that finds the work done applies it on the trainer thread:
RolloutQueue.set_limit (StalenessPolicy clamps it into its admission_range, never above
the staleness rule) and Generator.slot_limit; it writes the control/* metrics on that
row, prints each distinct advice once as --config overrides (kept for summary.json,
control_advice), and starts the next window at that step. One computation is in flight
at most: no window is measured while one is (its rows ran under the old decision), so a
window end cannot find one running. control/seconds is the computation's own time, in
its process; control/apply_lag_steps the steps from the window's end to the
application (0 when the work was done before the window's own row was written). A
computation still in flight when the run ends is not applied (summary.json: skipped,
"the run ended first").

Active when rl.control is "admission", or "auto" in async mode, with one process. Sync
mode admits one batch per step at its barrier, so the controller never acts there and a
sync run stays reproducible bit for bit; a multi-process run keeps its settings (the
followers replay the leader's admissions, not its slot limit).
A window whose refit fails (e.g. no trainer time in it; any other error in the
window's computation is logged with its traceback, by the executor's process), or that
held a stall (a step taking over STALL x the window's median step time: an XLA
compilation of a new shape, minutes on a loaded CPU), keeps the settings and makes no
prediction; noted once.
"""
from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import logging
import multiprocessing
import os
import time

import numpy as np

from rl_jax.errors import UserError


def active(cfg, processes: int = 1) -> bool:
  """Whether rl.control runs the controller in this run (module docstring)."""
  rl = cfg.rl
  wanted = rl.control == "admission" or (rl.control == "auto" and rl.mode == "async")
  return wanted and rl.mode == "async" and processes == 1


def inactive_note(cfg, processes: int = 1) -> str:
  """Why rl.control=admission, asked for explicitly, does not act in this run ("" when
  it does, or when it was not asked for)."""
  if cfg.rl.control != "admission" or active(cfg, processes):
    return ""
  why = ("sync mode admits one batch per step at its barrier" if cfg.rl.mode == "sync" else
         f"a run of {processes} processes keeps its settings (followers replay the leader)")
  return f"note: rl.control=admission does nothing here: {why}"


def device_memory_gib() -> float | None:
  """The memory of this run's first device as its runtime reports it (GPU, TPU); None
  where it reports none (CPU): the planner's device spec is used then."""
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return limit / 2**30 if limit else None


STALL = 10.0


def _child_init() -> None:
  # The computation needs no accelerator: a JAX imported by the planner stays on the CPU
  # (a TPU or GPU is the run's; a second process must not open it).
  os.environ["JAX_PLATFORMS"] = "cpu"


def _warm() -> None:
  # The imports of the first computation (JAX among them), made while the first window
  # runs: they took 4-5 s of that computation's 6-8 s on the 2-core CPU.
  from rl_jax.planner import live  # noqa: F401
  from rl_jax.sampler import engine  # noqa: F401


def _pool() -> concurrent.futures.Executor:
  return concurrent.futures.ProcessPoolExecutor(
      1, mp_context=multiprocessing.get_context("spawn"), initializer=_child_init)


class _Lazy:
  """An executor whose process is spawned at its first submit."""

  def __init__(self):
    self._pool = None

  def submit(self, fn, *args):
    if self._pool is None:
      self._pool = _pool()
    return self._pool.submit(fn, *args)

  def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def make_executor(cfg) -> concurrent.futures.Executor:
  """The loop's executor for the window computations: one spawned process. A thread of
  the run's own process would share its GIL: on the 2-core CPU a window's computation
  (about 1 s alone) made the pipeline's steps 23% slower for the 7 steps it took. It is
  spawned, and imports what the computation needs, at the start of a run long enough for
  a window (rl.total_steps > rl.control_every + 1); a shorter one (a test, a smoke run)
  spawns nothing unless a window ends after all (a resumed count)."""
  if int(cfg.rl.total_steps) <= int(cfg.rl.control_every) + 1:
    return _Lazy()
  pool = _pool()
  pool.submit(_warm)
  return pool


def compute(cfg, policy, every: int, memory_gib: float | None, step: int, rows: list[dict],
            counts: dict, predicted, floor=None, advised=None) -> dict:
  """A window's computation, on the executor (module docstring): the check of
  `predicted` against the window, the refit, the decision (no lower than `floor`,
  planner.live.Floor) and the advice, or the last advice (`advised`: {"inputs",
  "advice", "windows"}) while planner.live.advice_current holds; "advised" in the
  result is that state after this window. Any error becomes "reason". Reads only its
  arguments (picklable: a process runs it)."""
  from rl_jax.planner import live, profile as profile_lib
  t0 = time.perf_counter()
  res = {"measured": None, "errors": None, "decision": None, "advice": None, "reason": "",
         "advised": advised}
  try:
    res["measured"] = measured = profile_lib.steady_state(rows, skip_frac=0.0)
    if predicted is not None:
      res["errors"] = live.errors(predicted, measured)
    stall = stalled(rows)
    if stall:
      res["reason"] = f"a {stall:.0f}s step (an XLA compilation?)"
    else:
      profile = live.refit(cfg, rows, counts)
      res["decision"] = live.decide(cfg, profile, policy, window_steps=every,
                                    min_active=live.observed_active(cfg, rows), floor=floor)
      inputs = live.advice_inputs(rows, counts, measured)
      if live.advice_current(advised, inputs):
        res["advice"] = advised["advice"]
        res["advised"] = dict(advised, windows=advised["windows"] + 1)
      else:
        res["advice"] = live.advise(cfg, profile, num_steps=max(every // 2, 3),
                                    memory_gib=memory_gib)
        res["advised"] = {"inputs": inputs, "advice": res["advice"], "windows": 1}
  except UserError as e:
    res["reason"] = f"no refit: {e}"
  except Exception as e:  # noqa: BLE001  (the controller only tunes: the run goes on)
    res["reason"] = f"a controller error ({type(e).__name__}: {e})"
    logging.exception("control: the window ending at step %d failed", step)
  res["seconds"] = time.perf_counter() - t0
  return res


def stalled(rows: list[dict]) -> float:
  """The longest step time of the window's rows when it exceeds STALL x their median,
  else 0 (rows[0] is the row before the window)."""
  t = np.asarray([r["time_s"] for r in rows], np.float64)
  steps = np.asarray([r["step"] for r in rows], np.float64)
  per_step = np.diff(t) / np.maximum(np.diff(steps), 1)
  if len(per_step) < 3 or per_step.max() <= STALL * np.median(per_step):
    return 0.0
  return float(per_step.max())


class Controller:
  """Owns the window's rows and the decisions; called by the trainer thread only. Its
  `executor` (concurrent.futures.Executor-like: submit(fn, *args) -> Future; the loop's
  is make_executor()) runs each window's computation (`compute`) on its arguments."""

  def __init__(self, cfg, *, policy, queue, worker, accounting, console, executor):
    self.cfg, self.policy, self.queue = cfg, policy, queue
    self.worker, self.acc, self.console = worker, accounting, console
    self.executor = executor
    self.every = int(cfg.rl.control_every)
    self.bound = policy.max_inflight
    self.slots = int(cfg.sampler.max_concurrent_decodes)
    self.memory_gib = device_memory_gib()  # restart advice must fit the run's devices
    # The config the computation reads: steps_per_call resolved here, so that it never
    # asks JAX for a backend.
    from rl_jax.sampler.engine import resolve_steps_per_call
    self._plan_cfg = copy.deepcopy(cfg)
    self._plan_cfg.sampler.steps_per_call = resolve_steps_per_call(cfg.sampler.steps_per_call)
    self._rows: list[dict] = []  # the row before the window, then the window's rows
    self._start: int | None = None  # the step the window starts after
    self._counts: dict[str, int] = collections.Counter()
    self._pending = None  # (the window's end step, the Future of its computation)
    self._predicted: dict | None = None
    self._advised: set[tuple] = set()  # override sets already printed
    self._advice_state: dict | None = None  # the last advice computed and its inputs
    from rl_jax.planner import live
    self.floor = live.Floor()  # the least settings the trainer's starvation allows
    self._share: float | None = None  # the submitted window's data-wait share
    self._noted = False
    self.decisions: list[dict] = []
    self.advice: list[dict] = []

  def after_row(self, step: int, row: dict) -> dict:
    """The control/* metrics of the row after optimizer step `step`; at the end of a
    window it submits the window's computation, and on the first row that finds one
    done it applies it and starts the next window."""
    out = {}
    if self._start is None:  # the run's first row is the row before the first window
      self._begin(step, row)
    elif self._pending is None:
      self._rows.append(row)
      # A refit needs 3 rows after the one before the window (fit_sampler_direct).
      if step - self._start >= self.every and len(self._rows) >= 4:
        self._submit(step)
    if self._pending is not None and self._pending[1].done():
      end, future = self._pending
      out.update(self._take(end, step, future.result()))
      self._begin(step, row)
    out["control/admission_bound"] = self.bound
    out["control/decode_slots"] = self.slots
    return out

  def _begin(self, step: int, row: dict) -> None:
    from rl_jax.planner import live
    self._start, self._rows, self._pending = step, [row], None
    # Counters restored by a resume are not the first window's.
    self._counts = {k: self.acc.counts[k] for k in live.FILTER_COUNTS}

  def _submit(self, step: int) -> None:
    """The window's measurement, taken now; its computation goes to the executor."""
    from rl_jax.planner import live
    rows = [dict(r) for r in self._rows]  # the loop adds control/* to the last row after
    counts = {k: self.acc.counts[k] - self._counts[k] for k in live.FILTER_COUNTS}
    start = rows[0]["time_s"]
    counts["timeline"] = {"sampler": self.acc.sampler_busy.recent(5000, since=start),
                          "trainer": self.acc.trainer_busy.recent(5000, since=start)}
    # The feedback: a window that starved the trainer raises the floor (live.Floor); one
    # that held a stall does not count (a sampler compile empties the queue).
    self._share = live.data_wait_share(rows)
    if not stalled(rows):
      self.floor = self.floor.after(self._share, bound=self.bound,
                                    hi=self.policy.admission_range()[1],
                                    slots_max=int(self.cfg.sampler.max_concurrent_decodes),
                                    step=live.search_step(self.policy))
    self._pending = (step, self.executor.submit(
        compute, self._plan_cfg, self.policy, self.every, self.memory_gib, step, rows, counts,
        self._predicted, self.floor, self._advice_state))

  def _take(self, end: int, step: int, res: dict) -> dict:
    """Applies the computation of the window that ended at step `end`, at step `step`:
    the row's control/* metrics."""
    from rl_jax.planner import live
    out = {"control/seconds": res["seconds"], "control/apply_lag_steps": step - end,
           "control/admission_floor": self.floor.bound}
    entry = {"step": end, "applied_step": step, "floor": dataclasses.asdict(self.floor)}
    if self._share is not None:
      out["control/data_wait_share"] = entry["data_wait_share"] = self._share
    measured, err = res["measured"], res["errors"]
    if err is not None:
      entry["errors"] = err
      entry["measured"] = {k: measured[k] for k in live.CHECKED}
      out.update({"control/steps_per_hour_error": err["steps_per_hour"],
                  "control/queue_depth_error": err["queue_depth_mean"],
                  "control/staleness_error": err["staleness_mean"]})
    if res["reason"]:
      self._note(f"control: the window ending at step {end} held {res['reason']}; settings "
                 f"kept, no prediction")
      self._predicted = None
      if self.floor.bound > self.bound or self.floor.slots > self.slots:
        self._apply(live.Decision(admission_bound=max(self.bound, self.floor.bound),
                                  decode_slots=max(self.slots, self.floor.slots),
                                  predicted={}, simulations=0))
      self.decisions.append({**entry, "skipped": res["reason"]})
      return out
    decision = res["decision"]
    computed = res["advised"]["windows"] == 1  # else the last advice, reused
    self._advice_state = res["advised"]
    out["control/advice_computed"] = float(computed)
    entry["advice_computed"] = computed
    self._apply(decision)
    self._predicted = p = decision.predicted
    out.update({"control/predicted_steps_per_hour": p["steps_per_hour"],
                "control/predicted_queue_depth": p["queue_depth_mean"],
                "control/predicted_staleness": p["staleness_mean"],
                "control/predicted_discard_rate": p["discard_rate"],
                "control/measured_steps_per_hour": measured["steps_per_hour"],
                "control/simulations": decision.simulations})
    entry.update(admission_bound=self.bound, decode_slots=self.slots,
                 predicted={k: p[k] for k in (*live.CHECKED, "discard_rate")})
    self.decisions.append(entry)
    self._advise(end, res["advice"])
    return out

  def _apply(self, decision) -> None:
    self.bound = self.policy.clamp(decision.admission_bound)
    self.slots = int(min(max(decision.decode_slots, self.cfg.rl.group_size),
                         self.cfg.sampler.max_concurrent_decodes))
    self.queue.set_limit(self.bound)
    if self.worker.generator is not None:  # a resume loads before the generator exists:
      self.worker.generator.set_slot_limit(self.slots)  # the loop applies it on creation

  def _advise(self, step: int, advice: dict | None) -> None:
    key = None if advice is None else tuple(advice["overrides"])
    if key is not None and key not in self._advised:
      self._advised.add(key)
      self.advice.append({"step": step, **advice})
      self.console.message(
          f"control advice: {advice['change']} predicts {100 * advice['gain']:+.0f}% "
          f"optimizer steps/hour ({advice['current_steps_per_hour']:.0f} -> "
          f"{advice['steps_per_hour']:.0f}); restart with: {' '.join(advice['overrides'])}")

  def _note(self, text: str) -> None:
    if not self._noted:
      self._noted = True
      self.console.message(text + " (noted once per run)")

  def state(self) -> dict:
    """What a checkpoint keeps (JSON): the settings in force, the decisions and advice so
    far. A window in flight is not kept: after a resume the first row starts a new one."""
    return {"admission_bound": self.bound, "decode_slots": self.slots,
            "floor": dataclasses.asdict(self.floor),
            "decisions": list(self.decisions), "advice": list(self.advice)}

  def load(self, state: dict) -> None:
    """Continues a checkpoint's controller: its settings apply at once (within this
    config's limits, which may have changed), its decisions and advice stay in
    summary.json, and advice printed before is not printed again."""
    from rl_jax.planner import live
    self._apply(live.Decision(admission_bound=int(state["admission_bound"]),
                              decode_slots=int(state["decode_slots"]), predicted={},
                              simulations=0))
    self.floor = live.Floor(**state.get("floor", {}))  # (older checkpoints lack it)
    self.decisions = list(state.get("decisions", []))
    self.advice = list(state.get("advice", []))
    self._advised = {tuple(a["overrides"]) for a in self.advice}

  def summary(self) -> dict:
    """control_decisions (the window's end "step" and the "applied_step"; windows
    without a decision have "skipped": why, a window still in flight "the run ended
    first"), control_advice and control_error_mean (mean |relative error| of each
    checked prediction) for summary.json."""
    errs = [d["errors"] for d in self.decisions if "errors" in d]
    keys = errs[0].keys() if errs else ()
    unapplied = ([] if self._pending is None else
                 [{"step": self._pending[0], "skipped": "the run ended first"}])
    return {"control_decisions": self.decisions + unapplied, "control_advice": self.advice,
            "control_error_mean": {k: float(np.mean([abs(e[k]) for e in errs])) for k in keys}}

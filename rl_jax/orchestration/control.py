"""Live capacity control (rl.control): the capacity planner inside the run.

Every rl.control_every optimizer steps (a window; the first starts after the run's first
logged step, which holds the compilations), on the trainer thread right after the
step's metrics row, `Controller.after_row`:
  1. measures the window: its metrics rows (with the row before it) and the increase of
     the filter-rate counters, and the sampler/trainer busy intervals;
  2. checks the previous window's prediction against this measurement
     (rl_jax.planner.live.errors -> control/*_error);
  3. refits the planner's models from the window with rl_jax.planner.capacity.refit, the
     fit plan.py --profile / --validate use;
  4. decides the next window's admission bound and decode slots (planner.live.decide)
     and applies them: RolloutQueue.set_limit (StalenessPolicy clamps it into its
     admission_range, never above the staleness rule) and Generator.slot_limit;
  5. advises what only a restart can change (planner.live.advise; another split must fit
     the memory the run's devices report, device_memory_gib): each distinct advice
     is printed once, as --config overrides, and kept for summary.json (control_advice).
The controller's own seconds are pipeline time (the trainer waits for it): control/seconds.

Active when rl.control is "admission", or "auto" in async mode, with one process. Sync
mode admits one batch per step at its barrier, so the controller never acts there and a
sync run stays reproducible bit for bit; a multi-process run keeps its settings (the
followers replay the leader's admissions, not its slot limit).
A window whose refit fails (e.g. no trainer time in it; any other error in the refit,
the decision or the advice is logged with its traceback), or that held a stall (a step
taking over STALL x the window's median step time: an XLA compilation of a new shape,
minutes on a loaded CPU), keeps the settings and makes no prediction; noted once.
"""
from __future__ import annotations

import collections
import logging
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
  """Owns the window's rows and the decisions; called by the trainer thread only."""

  def __init__(self, cfg, *, policy, queue, worker, accounting, console):
    self.cfg, self.policy, self.queue = cfg, policy, queue
    self.worker, self.acc, self.console = worker, accounting, console
    self.every = int(cfg.rl.control_every)
    self.bound = policy.max_inflight
    self.slots = int(cfg.sampler.max_concurrent_decodes)
    self.memory_gib = device_memory_gib()  # restart advice must fit the run's devices
    self._rows: list[dict] = []  # the row before the window, then the window's rows
    self._start: int | None = None  # the step the window starts after
    self._counts: dict[str, int] = collections.Counter()
    self._predicted: dict | None = None
    self._advised: set[tuple] = set()  # override sets already printed
    self._noted = False
    self.decisions: list[dict] = []
    self.advice: list[dict] = []

  def after_row(self, step: int, row: dict) -> dict:
    """The control/* metrics of the row after optimizer step `step`; at the end of a
    window, after deciding the next one."""
    self._rows.append(row)
    if self._start is None:  # the run's first row is the row before the first window
      from rl_jax.planner import live
      self._start = step
      # Counters restored by a resume are not the first window's.
      self._counts = {k: self.acc.counts[k] for k in live.FILTER_COUNTS}
    out = {}
    # A refit needs 3 rows after the one before the window (fit_sampler_direct).
    if step - self._start >= self.every and len(self._rows) >= 4:
      self._start = step
      t0 = time.perf_counter()
      out.update(self._window(step))
      out["control/seconds"] = time.perf_counter() - t0
    out["control/admission_bound"] = self.bound
    out["control/decode_slots"] = self.slots
    return out

  def _window(self, step: int) -> dict:
    from rl_jax.planner import capacity, live, profile as profile_lib
    rows, self._rows = self._rows, self._rows[-1:]
    counts = {k: self.acc.counts[k] - self._counts[k] for k in live.FILTER_COUNTS}
    self._counts = {k: self.acc.counts[k] for k in live.FILTER_COUNTS}
    start = rows[0]["time_s"]
    counts["timeline"] = {"sampler": self.acc.sampler_busy.recent(5000, since=start),
                          "trainer": self.acc.trainer_busy.recent(5000, since=start)}
    out, entry = {}, {"step": step}
    measured = profile_lib.steady_state(rows, skip_frac=0.0)
    if self._predicted is not None:
      err = live.errors(self._predicted, measured)
      entry["errors"] = err
      entry["measured"] = {k: measured[k] for k in live.CHECKED}
      out.update({"control/steps_per_hour_error": err["steps_per_hour"],
                  "control/queue_depth_error": err["queue_depth_mean"],
                  "control/staleness_error": err["staleness_mean"]})
    stall = stalled(rows)
    reason = f"a {stall:.0f}s step (an XLA compilation?)" if stall else ""
    if not reason:
      try:
        profile = capacity.refit(live.window_pilot(self.cfg, rows, counts))
        decision = live.decide(self.cfg, profile, self.policy, window_steps=self.every)
        advice = live.advise(self.cfg, profile, num_steps=max(self.every // 2, 3),
                             memory_gib=self.memory_gib)
      except UserError as e:
        reason = f"no refit: {e}"
      except Exception as e:  # noqa: BLE001  (the controller only tunes: the run goes on)
        reason = f"a controller error ({type(e).__name__}: {e})"
        logging.exception("control: the window ending at step %d failed", step)
    if reason:
      self._note(f"control: the window ending at step {step} held {reason}; settings kept, "
                 f"no prediction")
      self._predicted = None
      self.decisions.append({**entry, "skipped": reason})
      return out
    self._apply(decision)
    self._predicted = decision.predicted
    p = decision.predicted
    out.update({"control/predicted_steps_per_hour": p["steps_per_hour"],
                "control/predicted_queue_depth": p["queue_depth_mean"],
                "control/predicted_staleness": p["staleness_mean"],
                "control/predicted_discard_rate": p["discard_rate"],
                "control/measured_steps_per_hour": measured["steps_per_hour"],
                "control/simulations": decision.simulations})
    entry.update(admission_bound=self.bound, decode_slots=self.slots,
                 predicted={k: p[k] for k in (*live.CHECKED, "discard_rate")})
    self.decisions.append(entry)
    self._advise(step, advice)
    return out

  def _apply(self, decision) -> None:
    self.bound = self.policy.clamp(decision.admission_bound)
    self.slots = int(min(max(decision.decode_slots, self.cfg.rl.group_size),
                         self.cfg.sampler.max_concurrent_decodes))
    self.queue.set_limit(self.bound)
    self.worker.generator.set_slot_limit(self.slots)

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

  def summary(self) -> dict:
    """control_decisions (windows without a decision have "skipped": why),
    control_advice and control_error_mean (mean |relative error| of each checked
    prediction) for summary.json."""
    errs = [d["errors"] for d in self.decisions if "errors" in d]
    keys = errs[0].keys() if errs else ()
    return {"control_decisions": self.decisions, "control_advice": self.advice,
            "control_error_mean": {k: float(np.mean([abs(e[k]) for e in errs])) for k in keys}}

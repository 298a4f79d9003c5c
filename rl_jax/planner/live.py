"""Planning inside a run (rl.control): the next window's admission bound and decode slots,
the window-ahead check of the prediction, and advice for what only a restart can change.

A window is the metrics rows of the last rl.control_every optimizer steps plus the row
before them (`window_pilot`); `capacity.refit` fits the planner's models from it, the
same fit as plan.py --profile / --validate, and `lengths_ahead` starts the next window's
completion lengths where the window's last half left them (`refit` does both). A
prediction simulates the run's own configuration (capacity.scenario on its layout) from
an empty pipeline for `warm-up + window` steps, warm-up = max_staleness + 2 (the steps a
pipeline takes to fill), and reads the steady state of the window
(`profile.steady_state` of its rows), which is what the next window of the warm run
measures. The simulations are the controller's cost
(control/seconds, in a process of its own that shares the run's CPU cores), so they are
few: about 7 for a decision; for the advice, the configuration and each alternative over
half a window (0.45 s in all on a window of configs/length_drift.py, one core).

  decide   the admission bound b in admission_range() = [lo, hi] (StalenessPolicy: never
           above the staleness rule, nor where the queue's bound binds first), at every
           decode slot, found by bisection (search_bound: hi, lo, then halving to 1/16
           of the range, about 6 simulations); then the slot limit k in {S, S/2}
           (S = sampler.max_concurrent_decodes, k >= group_size; S/2 only when the
           window saw the sampler decode that few sequences per step: below that the
           fitted decode model would be extrapolated) at the chosen b. Each
           pick is the smallest value whose predicted steps/hour is within `tolerance`
           (TOLERANCE, 1%) of the best evaluated: the fewest groups in flight (least staleness,
           fewest discards) that keeps the trainer as busy, i.e. sampling rate
           lambda ~= training rate mu at the configured bound. Both stay at or above the
           run's Floor: the feedback half. A window whose trainer waited on an empty
           queue for more than STARVED (1%) of its wall time (data_wait_share) lifts the
           least bound one search step above the one it ran under, and the slots to all
           of them; RELAX (3) windows in a row that did not starve it lower the bound's
           floor a step.
  errors   (predicted - measured) / max(measured, floor) of steps/hour, queue depth and
           staleness, floor 1 for the last two (means that can be 0), else 1e-9.
  advise   the run's configuration against other sampler/trainer splits of the same
           devices, weight_sync_every in {1, 2, 4} and group sizes G/2 and 2G at the same
           rollouts per step (groups_per_step x G), all at the same max_staleness: the
           best one when it predicts >= min_gain more optimizer steps per hour, as the
           --config overrides to restart with; else None. A run's controller reuses
           the last advice while the window's inputs (advice_inputs: steps/hour,
           median completion length, verifier latency, filtered share) stay within
           ADVICE_MOVED (10%) of those it was computed on, for ADVICE_EVERY (3) windows
           at most (advice_current).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from rl_jax.planner import capacity
from rl_jax.planner import profile as profile_lib
from rl_jax.planner.models import DEVICES, DeviceSpec
from rl_jax.planner.simulate import simulate

CHECKED = ("steps_per_hour", "queue_depth_mean", "staleness_mean")
FILTER_COUNTS = ("groups_completed", "groups_filtered_zero_variance", "groups_uniform_capped")


@dataclasses.dataclass(frozen=True)
class Decision:
  """Settings for the next window and what the planner predicts for it."""
  admission_bound: int
  decode_slots: int
  predicted: dict  # profile.steady_state keys of the simulated window
  simulations: int


def window_pilot(cfg, rows: list[dict], counts: dict | None = None) -> profile_lib.Pilot:
  """A Pilot of one window: rows[0] is the row before the window. `counts`: the
  window's increase of groups_completed, groups_filtered_zero_variance and
  groups_uniform_capped (the filter rate's inputs)."""
  return profile_lib.Pilot(workdir="(this run's last window)", cfg=cfg, rows=list(rows),
                           summary=dict(counts or {}))


def lengths_ahead(profile, rows: list[dict]):
  """`profile` with the completion lengths a next window starts from (lognormal fits
  only): the mean lengths/p50 of the window's last half, growing at that half's drift
  (profile.length_drift: 0 unless significant). The whole window's trend is not
  extrapolated: on configs/length_drift.py the median jumps from 4 to 16 tokens by step 5
  and then stays near 18, and the first window's trend (+7 to +9% a step), compounded
  over the next window, sent every simulated completion to the cap."""
  recent = [r for r in rows[len(rows) // 2:] if r.get("lengths/p50")]
  if profile.lengths.kind != "lognormal" or len(recent) < 3:
    return profile
  median = float(np.mean([r["lengths/p50"] for r in recent]))
  drift = profile_lib.length_drift(recent)
  profile.lengths = dataclasses.replace(profile.lengths, median=median, drift_per_step=drift)
  profile.notes.append(f"lengths ahead: median {median:.3g} (the window's last half), "
                       f"drift {100 * drift:+.2f}% per optimizer step")
  return profile


def refit(cfg, rows: list[dict], counts: dict | None = None):
  """The window's refit (capacity.refit of window_pilot) with its lengths ahead."""
  return lengths_ahead(capacity.refit(window_pilot(cfg, rows, counts)), rows)


def _tensor(sub) -> int:
  return int(sub.get("tensor", 1))


def predict(cfg, profile, *, num_steps: int, layout=None, max_inflight_groups=None,
            decode_slots: int | None = None, device: DeviceSpec = DEVICES["h200"]) -> dict:
  """profile.steady_state of `num_steps` simulated steps after the warm-up ones."""
  model_cfg, params = capacity.model_shape(cfg)
  warmup = int(cfg.rl.max_staleness) + 2
  sc = capacity.scenario(cfg, layout=layout or capacity.pilot_layout(cfg), profile=profile,
                         model_cfg=model_cfg, params=params, device=device,
                         num_steps=warmup + num_steps, max_inflight_groups=max_inflight_groups)
  if decode_slots is not None:
    sc = dataclasses.replace(sc, decode_slots=min(int(decode_slots), sc.decode_slots))
  rows = simulate(sc).rows
  return profile_lib.steady_state(rows[warmup - 1:], skip_frac=0.0)


RESOLUTION = 16  # the admission bound's search stops at 1/16 of its range (or 1 group)


def search_step(policy) -> int:
  """The admission bound's search resolution: 1/RESOLUTION of admission_range(), at
  least 1 group (also the step the Floor moves by)."""
  lo, hi = policy.admission_range()
  return max(1, (hi - lo) // RESOLUTION)


def _smallest_near_best(options: list[int], preds: list[dict], tolerance: float) -> int:
  best = max(p["steps_per_hour"] for p in preds)
  return min(o for o, p in zip(options, preds) if p["steps_per_hour"] >= (1 - tolerance) * best)


def search_bound(lo: int, hi: int, steps_per_hour, *, tolerance: float,
                 resolution: int) -> tuple[int, dict[int, float]]:
  """The smallest bound in [lo, hi] whose steps/hour is within `tolerance` of the best
  evaluated, by bisection (steps/hour grows with the bound until the trainer is busy):
  (bound, {evaluated bound: steps/hour}). Bisection stops at `resolution` groups."""
  seen: dict[int, float] = {}

  def ok(b: int) -> bool:
    if b not in seen:
      seen[b] = float(steps_per_hour(b))
    return seen[b] >= (1 - tolerance) * seen[hi]

  ok(hi)
  if not ok(lo):
    a, z = lo, hi  # a: below the target; z: at it
    while z - a > resolution:
      m = (a + z) // 2
      a, z = (a, m) if ok(m) else (m, z)
  best = max(seen.values())
  return min(b for b, v in seen.items() if v >= (1 - tolerance) * best), seen


def observed_active(cfg, rows: list[dict]) -> float | None:
  """The fewest sequences per decode step the window's sampler ran with (10th percentile
  of its rows, profile.active_per_decode_step); None when the rows do not say."""
  from rl_jax.sampler.engine import resolve_steps_per_call
  active = profile_lib.active_per_decode_step(
      rows, resolve_steps_per_call(cfg.sampler.steps_per_call))
  return float(np.percentile(active, 10)) if len(active) else None


# A window whose trainer waited on an empty queue for more than this share of its wall
# time was starved by the settings in force (notes/TUNING.md, session 14).
STARVED = 0.01


def data_wait_share(rows: list[dict]) -> float | None:
  """The share of the window's wall time the trainer spent waiting on an empty queue for
  its batches (trainer/data_wait_frac, cumulative like busy_frac; rows[0] is the row
  before the window); None when the rows do not record it."""
  a, b = rows[0], rows[-1]
  if "trainer/data_wait_frac" not in a or "trainer/data_wait_frac" not in b:
    return None
  dt = b["time_s"] - a["time_s"]
  if dt <= 0:
    return None
  return (b["trainer/data_wait_frac"] * b["time_s"] - a["trainer/data_wait_frac"] * a["time_s"]) / dt


@dataclasses.dataclass(frozen=True)
class Floor:
  """The least admission bound and decode slots a decision may take: the feedback half of
  live control. The simulation's queue is smoother than a run's (measured on
  configs/length_drift.py: at bound 168 it predicts the trainer as busy as at 192, the run
  loses 1-2% of its busy time to an empty queue), so the run's own measurement of its
  trainer's wait corrects it. A window that starved the trainer (data_wait_share >
  STARVED) raises the floor above the settings it ran under: the bound by one search
  step, the slots to all of them. After RELAX windows in a row that did not starve it,
  the bound's floor comes down one step (the slots' stays): a window's share is noisy
  (0.0-1.2% per 20-step window at a bound that keeps the trainer as busy as the fixed
  one), and a floor that only rose would reach the top of the range in a long run."""
  bound: int = 0
  slots: int = 0
  clean: int = 0  # windows in a row since the floor last moved that did not starve

  def after(self, share: float | None, *, bound: int, slots_max: int, step: int,
            hi: int) -> Floor:
    if share is None:
      return self
    if share > STARVED:
      return Floor(bound=max(self.bound, min(hi, bound + step)), slots=slots_max)
    if self.bound == 0:
      return self
    if self.clean + 1 >= RELAX:
      return Floor(bound=max(0, self.bound - step), slots=self.slots)
    return dataclasses.replace(self, clean=self.clean + 1)


RELAX = 3

# The steps/hour a decision may give up for fewer groups in flight. Small: the goal is a
# trainer as busy as at the largest bound (a 3% tolerance lost 2-8% of the trainer's busy
# time where the refit's knee was optimistic; notes/TUNING.md, session 12).
TOLERANCE = 0.01


def decide(cfg, profile, policy, *, window_steps: int, tolerance: float = TOLERANCE,
           device: DeviceSpec = DEVICES["h200"], min_active: float | None = None,
           floor: Floor | None = None) -> Decision:
  """The admission bound and decode slots for the next window (module docstring).
  `min_active` (observed_active): half the slots is an option only when the window saw
  the sampler run with that few sequences per decode step, so that the fitted decode
  model is not extrapolated below what it was fitted on. `floor` (Floor.after): the
  least bound and slots the run's own starvation measurements allow."""
  lo, hi = policy.admission_range()
  resolution = search_step(policy)
  slots_max = int(cfg.sampler.max_concurrent_decodes)
  if floor is not None:
    lo = min(max(lo, floor.bound), hi)
  g = int(cfg.rl.group_size)
  half = slots_max // 2
  observed = min_active is None or half >= min_active
  allowed = floor is None or half >= floor.slots
  slot_options = sorted({slots_max} | ({half} if half >= g and observed and allowed else set()))
  steps = window_steps
  at_bound: dict[int, dict] = {}

  def steps_per_hour(b: int) -> float:
    at_bound[b] = predict(cfg, profile, num_steps=steps, max_inflight_groups=b, device=device)
    return at_bound[b]["steps_per_hour"]

  bound, _ = search_bound(lo, hi, steps_per_hour, tolerance=tolerance, resolution=resolution)
  preds = {slots_max: at_bound[bound]}
  for k in slot_options[:-1]:
    preds[k] = predict(cfg, profile, num_steps=steps, max_inflight_groups=bound,
                       decode_slots=k, device=device)
  slots = _smallest_near_best(slot_options, [preds[k] for k in slot_options], tolerance)
  return Decision(admission_bound=bound, decode_slots=slots, predicted=preds[slots],
                  simulations=len(at_bound) + len(slot_options) - 1)


def errors(predicted: dict, measured: dict) -> dict[str, float]:
  """Relative error of each CHECKED prediction against the next window's measurement."""
  out = {}
  for key in CHECKED:
    floor = 1e-9 if key == "steps_per_hour" else 1.0
    out[key] = (predicted[key] - measured[key]) / max(measured[key], floor)
  return out


def _alternatives(cfg) -> list[tuple[str, list[str], object]]:
  """(label, overrides, config) of every restart-only change advise compares."""
  from rl_jax import sharding
  rl = cfg.rl
  out = []
  s_dev, t_dev, _ = sharding.mesh_devices(cfg.mesh)
  here = capacity.pilot_layout(cfg)
  devices = s_dev if cfg.mesh.colocated else s_dev + t_dev
  for lay in capacity.layouts(devices=devices, sampler_tensor=_tensor(cfg.mesh.sampler),
                              trainer_tensor=_tensor(cfg.mesh.trainer)):
    if lay != here:
      cand = capacity.Candidate(layout=lay, max_staleness=rl.max_staleness,
                                max_inflight_groups=rl.max_inflight_groups, memory=None)
      flags = capacity.overrides(cfg, cand)
      out.append((f"split {lay.label}", flags, (lay, {})))
  for every in (1, 2, 4):
    if every != rl.weight_sync_every:
      out.append((f"weight_sync_every {every}", [f"--config.rl.weight_sync_every={every}"],
                  (None, {"weight_sync_every": every})))
  batch = rl.groups_per_step * rl.group_size
  for g in (rl.group_size // 2, rl.group_size * 2):
    if g >= 2 and batch % g == 0 and g != rl.group_size:
      out.append((f"group_size {g}", [f"--config.rl.group_size={g}",
                                      f"--config.rl.groups_per_step={batch // g}"],
                  (None, {"group_size": g, "groups_per_step": batch // g})))
  return out


def advise(cfg, profile, *, num_steps: int, min_gain: float = 0.15,
           device: DeviceSpec = DEVICES["h200"],
           memory_gib: float | None = None) -> dict | None:
  """The best restart-only change predicted to give >= min_gain more optimizer steps per
  hour at the same staleness bound: {"change", "overrides", "gain", "steps_per_hour",
  "current_steps_per_hour"}; None when nothing does. Another split must fit memory_gib
  per device (default: the device spec's)."""
  from rl_jax.orchestration.policy import StalenessPolicy
  current = predict(cfg, profile, num_steps=num_steps, device=device)["steps_per_hour"]
  best = None
  for label, flags, (layout, rl_changes) in _alternatives(cfg):
    alt = cfg.copy_and_resolve_references()
    for k, v in rl_changes.items():
      alt.rl[k] = v
    if StalenessPolicy.from_config(alt.rl).stall_reason():
      continue
    if layout is not None:
      model_cfg, params = capacity.model_shape(cfg)
      _, reason = capacity.check_layout(cfg, layout=layout, model_cfg=model_cfg,
                                        params=params,
                                        memory_gib=memory_gib or device.memory_gib)
      if reason:
        continue
    sph = predict(alt, profile, num_steps=num_steps, layout=layout,
                  device=device)["steps_per_hour"]
    if best is None or sph > best["steps_per_hour"]:
      best = {"change": label, "overrides": flags, "steps_per_hour": sph}
  if best is None or best["steps_per_hour"] < (1 + min_gain) * current:
    return None
  best.update(gain=best["steps_per_hour"] / current - 1, current_steps_per_hour=current)
  return best


# The advice is recomputed when the window's inputs moved by more than ADVICE_MOVED
# (relative) from those of the window it was last computed on, and at least every
# ADVICE_EVERY windows: most of a window's computation is the advice's simulations.
ADVICE_MOVED = 0.10
ADVICE_EVERY = 3


def advice_inputs(rows: list[dict], counts: dict | None, measured: dict) -> dict[str, float]:
  """What the advice's prediction follows, measured over a window: its optimizer steps
  per hour, median completion length, mean verifier latency and filtered share."""
  win = rows[1:] or rows
  counts = counts or {}
  completed = counts.get(FILTER_COUNTS[0], 0)
  return {"steps_per_hour": float(measured["steps_per_hour"]),
          "completion_p50": float(np.mean([r.get("lengths/p50", 0.0) for r in win])),
          "verifier_mean_s": float(np.mean([r.get("latency/verifier_mean", 0.0) for r in win])),
          "filtered_share": counts.get(FILTER_COUNTS[1], 0) / completed if completed else 0.0}


def advice_current(last: dict | None, inputs: dict[str, float]) -> bool:
  """Whether the advice computed last (`last`: {"inputs", "advice", "windows"}, the
  windows it has served) still holds for a window with these inputs: it was computed
  fewer than ADVICE_EVERY windows ago and no input moved by more than ADVICE_MOVED."""
  if last is None or last["windows"] >= ADVICE_EVERY:
    return False
  return all(abs(inputs[k] - v) <= ADVICE_MOVED * max(abs(v), 1e-9)
             for k, v in last["inputs"].items())


def last_window(pilot: profile_lib.Pilot, steps: int) -> profile_lib.Pilot:
  """The pilot cut to its last window of `steps` optimizer steps (with the row before
  it) and the summary's busy timelines and filter counts (whole-run counts: a finished
  run's summary keeps no per-window ones)."""
  rows = pilot.rows
  first = rows[-1]["step"] - steps
  start = max([i for i, r in enumerate(rows) if r["step"] <= first], default=0)
  keep = {k: pilot.summary[k] for k in ("timeline", *FILTER_COUNTS) if k in pilot.summary}
  return profile_lib.Pilot(workdir=pilot.workdir, cfg=pilot.cfg, rows=rows[start:],
                           summary=keep)


def from_run(pilot: profile_lib.Pilot, *, steps: int, min_gain: float = 0.15,
             device: DeviceSpec = DEVICES["h200"]):
  """plan.py --from-run: (refitted Profile, table, advice) of a finished run's last
  window; table rows as capacity.validate's (metric, predicted, observed, rel_err), the
  prediction being what live control would predict for a next window."""
  win = last_window(pilot, steps)
  profile = lengths_ahead(capacity.refit(win, device=device), win.rows)
  predicted = predict(pilot.cfg, profile, num_steps=steps, device=device)
  observed = profile_lib.steady_state(win.rows, skip_frac=0.0)
  table = [{"metric": k, "predicted": predicted[k], "observed": observed[k],
            "rel_err": (predicted[k] - observed[k]) / observed[k] if observed[k] else None}
           for k in (*CHECKED, "sampler_busy_frac", "trainer_busy_frac", "discard_rate")]
  advice = advise(pilot.cfg, profile, num_steps=max(steps // 2, 3), min_gain=min_gain,
                  device=device)
  return profile, table, advice


def format_from_run(pilot: profile_lib.Pilot, *, steps: int | None = None) -> str:
  """plan.py --from-run's text: the refit notes and table of the run's last window of
  `steps` (default its rl.control_every) optimizer steps, then the advice line."""
  from rl_jax.planner.render import format_validation
  steps = steps or int(getattr(pilot.cfg.rl, "control_every", 20))
  if steps < 3:
    raise capacity.PlanError(f"--window must be >= 3 steps, got {steps}")
  profile, table, advice = from_run(pilot, steps=steps)
  lines = [f"refit from the last {steps} optimizer steps of {pilot.workdir}:"]
  lines += [f"  {n}" for n in profile.notes] + [format_validation(table)]
  if advice is None:
    lines.append("advice: no split, weight-sync cadence or group size predicts >= 15% more "
                 "optimizer steps per hour at this staleness bound")
  else:
    lines.append(f"advice: {advice['change']} predicts {100 * advice['gain']:+.0f}% optimizer "
                 f"steps/hour; restart with: {' '.join(advice['overrides'])}")
  return "\n".join(lines)

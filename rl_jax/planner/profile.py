"""Fit the planner's models from a pilot run, and read a run's steady state.

A pilot workdir (written by rl_jax.orchestration.loop) holds metrics.jsonl (one row per
logged step), summary.json and config.json. Rows are cumulative-friendly: time_s and the
busy fractions let any window be measured, so the first rows (compilation, empty
queue) are left out: the window is every row after the first `skip` = max(1, 10%).

Fits (row i of the window, dt_i = time_s_i - time_s_{i-1}, busy_i = the busy seconds
of a role in that interval = busy_frac_i * time_s_i - busy_frac_{i-1} * time_s_{i-1}):

  sampler   with sampler/generate_calls (cumulative, as loop.py logs it): decode steps
            k_i = its increase * sampler.steps_per_call, step_i = busy_i / k_i,
            active_i = tokens_i / k_i (tokens_i = sampler/tokens_per_s * dt_i) times
            slot_occupancy (a sequence also holds its slot one call after its tokens),
            then non-negative least squares of step_i on [1, active_i / R,
            active_i * context_i / R], weighted by k_i (so the fit keeps the total busy
            seconds), kept when it explains 20% more than a constant.
            Without decode steps the active count is unknown, so a constant step time is
            calibrated instead: simulate the pilot and rescale until the simulated sampler
            busy time matches the observed one.
  trainer   train_i = trainer/step_time_s * steps, or trainer busy_i - weight-sync seconds
            of the interval's publications (StalenessPolicy.publishes); non-negative
            least squares of train_i on
            [steps_i, padded_tokens_i] gives fixed_s and 1 / rate; padded tokens are
            trainer/padded_tokens when logged, else rows x bucket(prompt + lengths/p99).
            The rate is divided by D_eff of the pilot's trainer devices. Rows at a batch
            shape (padded tokens per step) not seen in any earlier row hold that shape's
            XLA compilation: they are left out, and their mean excess over the fitted
            step time is compile_s, which the simulation charges once per new shape.
            loop_s = median of dt_i - busy_i over the one-step rows whose row before
            shows a whole batch queued (queue/depth >= groups_per_step): the loop's
            host time between steps, not waiting for data (needs MIN_READY_STEPS such
            rows, else 0).
  lengths   summary completion_lengths when present (empirical), else a lognormal:
            median = mean of lengths/p50, sigma = ln(p90 / p50) / 1.2816, or from the
            truncation rate when p90 sits at the cap; drift = exp(slope) - 1 of
            ln(p50) against step, kept when the slope exceeds two standard errors.
  verifier  the service time of a call (start of its first attempt -> result; the
            latency/verifier_* percentiles loop.py logs also hold pool queueing, which
            the simulation adds itself). In order: summary verifier_service_s (raw,
            empirical); a lognormal from latency/verifier_service_p50/p95/p99 (median
            p50, sigma = sqrt(2 ln(mean / p50)) with a logged _mean, else the
            least-squares sigma of ln(p_q / p50) = sigma z_q, means over the window);
            the pilot's injected verifier.latency; last, the same lognormal fit of
            latency/verifier_* as an upper bound.
  sync      summary weight_sync_s_mean.
  turns     a tool-using pilot (summary turns_per_rollout_mean): a geometric TurnModel
            with that mean, observation tokens = tokens_env / tool_calls, tool latency
            empirical from summary tool_latency_s (submitted -> result: pool queueing
            included, an upper bound of the service time), the pilot's env.tool pool;
            the completion lengths are scaled by tokens_model / (tokens_model +
            tokens_env), since the simulation adds the observations itself.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics

import numpy as np

from rl_jax.errors import UserError
from rl_jax.planner import contention as contention_lib
from rl_jax.planner.models import LengthModel, SamplerModel, TrainerModel, TurnModel, VerifierModel
from rl_jax.tasks.latency import Latency

MIN_READY_STEPS = 3  # rows with a whole batch queued needed to fit TrainerModel.loop_s


class ProfileError(UserError, ValueError):
  """A pilot workdir that cannot be read or fitted: one sentence naming the file."""


@dataclasses.dataclass
class Pilot:
  """A finished run: its config, per-step rows (sorted by step) and summary."""
  workdir: str
  cfg: object
  rows: list[dict]
  summary: dict


@dataclasses.dataclass
class Profile:
  """Models fitted from a pilot, in the units of rl_jax.planner.models."""
  sampler: SamplerModel
  trainer: TrainerModel
  lengths: LengthModel
  verifier_latency: Latency
  weight_sync_s: float
  prompt_tokens: int
  sampler_tensor: int  # the sampler's tensor-parallel size in the pilot
  notes: list[str]
  # True when the pilot logged no decode-step counts: `sampler` is a first guess that
  # rl_jax.planner.capacity.load_profile calibrates by simulating the pilot.
  needs_calibration: bool = False
  turns: TurnModel | None = None  # a tool-using pilot's episodes
  # Speed of each role while the other is busy (rl_jax.planner.contention); the
  # sampler and trainer models above are alone speeds.
  sampler_share: float = 1.0
  trainer_share: float = 1.0
  uniform_rate: float = 0.0  # share of verified groups whose rewards were all equal


def load_pilot(workdir: str, *, flag: str = "--profile", cfg=None) -> Pilot:
  """Reads a workdir; `cfg` is used when it has no config.json."""
  from rl_jax import config as config_lib
  import ml_collections

  if not os.path.isdir(workdir):
    raise ProfileError(f"{flag}: directory {workdir!r} does not exist")
  metrics = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(metrics):
    raise ProfileError(f"{flag}: {metrics} is missing; pass the --workdir of a finished "
                       f"launch/train.py run")
  rows = []
  with open(metrics) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        raise ProfileError(f"{flag}: {metrics}:{n} is not a JSON object") from None
      if "time_s" in row:  # the final held-out row carries no pipeline metrics
        rows.append(row)
  rows.sort(key=lambda r: r["step"])
  if len(rows) < 3:
    raise ProfileError(f"{flag}: {metrics} has {len(rows)} step rows; a pilot needs at least 3")
  summary_path = os.path.join(workdir, "summary.json")
  summary = {}
  if os.path.isfile(summary_path):
    with open(summary_path) as f:
      summary = json.load(f)
  config_path = os.path.join(workdir, "config.json")
  if os.path.isfile(config_path):
    with open(config_path) as f:
      cfg = ml_collections.ConfigDict(json.load(f))
    try:
      config_lib.check_fields(cfg, config_lib.base_config())
    except config_lib.ConfigError as e:
      raise ProfileError(f"{flag}: {config_path}: {e}") from None
  elif cfg is None:
    raise ProfileError(f"{flag}: {config_path} is missing and no --config was given")
  return Pilot(workdir=workdir, cfg=cfg, rows=rows, summary=summary)


def window(rows: list[dict], skip_frac: float = 0.1) -> tuple[dict, list[dict]]:
  """(base row, window rows): the rows after the first max(1, skip_frac * n)."""
  skip = max(1, int(len(rows) * skip_frac))
  return rows[skip - 1], rows[skip:]


def _busy_s(row: dict, key: str) -> float:
  return row.get(key, 0.0) * row["time_s"]


def steady_state(rows: list[dict], *, skip_frac: float = 0.1) -> dict[str, float]:
  """Rates and means over the window; the same for a pilot's and a simulated run's rows.

    steps_per_hour     = (step_last - step_base) / (time_last - time_base) * 3600
    <role>_busy_frac   = (busy_s_last - busy_s_base) / (time_last - time_base)
    queue_depth_mean   = mean of queue/depth (sampled after each step, as loop.py logs it)
    staleness_mean     = mean of staleness/mean (each row: mean over its trained batch)
    discard_rate       = discarded / (discarded + accepted) groups in the window
  """
  base, win = window(rows, skip_frac)
  last = win[-1]
  span = max(last["time_s"] - base["time_s"], 1e-12)
  discarded = last.get("staleness/discarded", 0) - base.get("staleness/discarded", 0)
  accepted = last.get("staleness/accepted", 0) - base.get("staleness/accepted", 0)
  return {
      "steps_per_hour": (last["step"] - base["step"]) / span * 3600,
      "sampler_busy_frac": (_busy_s(last, "sampler/busy_frac") -
                            _busy_s(base, "sampler/busy_frac")) / span,
      "trainer_busy_frac": (_busy_s(last, "trainer/busy_frac") -
                            _busy_s(base, "trainer/busy_frac")) / span,
      "queue_depth_mean": float(np.mean([r.get("queue/depth", 0) for r in win])),
      "staleness_mean": float(np.mean([r.get("staleness/mean", 0.0) for r in win])),
      "discard_rate": discarded / max(discarded + accepted, 1),
  }


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
  """argmin ||a x - y|| subject to x >= 0, by trying every column subset (few columns).

  Subsets go from fewest columns up and a larger one must fit clearly better, so
  collinear columns (e.g. a context length that never varied) stay at zero.
  """
  n = a.shape[1]
  best, best_err = np.zeros(n), float(np.sum(y * y))
  for mask in sorted(range(1, 2**n), key=lambda m: (bin(m).count("1"), m)):
    cols = [j for j in range(n) if mask >> j & 1]
    x, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
    if np.any(x < 0):
      continue
    err = float(np.sum((a[:, cols] @ x - y) ** 2))
    if err < best_err - 1e-9 * max(best_err, float(np.sum(y * y))):
      best = np.zeros(n)
      best[cols] = x
      best_err = err
  return best


def _mean(rows, key) -> float | None:
  """Mean over rows of a logged value. For per-row percentiles the mean is the better
  pool: a tail percentile of a small interval sample is skewed low, its median more so."""
  values = [r[key] for r in rows if r.get(key) is not None]
  return float(np.mean(values)) if values else None


def length_drift(rows: list[dict]) -> float:
  """The median completion length's growth per optimizer step over `rows`: exp(slope) - 1
  of the least-squares line through (step, ln lengths/p50), when the slope exceeds twice
  its standard error (and 1e-9: flat rows fit with no error) with >= 5 rows; else 0."""
  steps = np.asarray([r["step"] for r in rows if r.get("lengths/p50")], np.float64)
  logs = np.log([r["lengths/p50"] for r in rows if r.get("lengths/p50")])
  if len(steps) < 5 or not np.ptp(steps) > 0:
    return 0.0
  slope, intercept = np.polyfit(steps, logs, 1)
  resid = logs - (slope * steps + intercept)
  se = math.sqrt(float(np.sum(resid**2)) / (len(steps) - 2) /
                 float(np.sum((steps - steps.mean())**2)))
  return math.exp(slope) - 1 if abs(slope) > max(2 * se, 1e-9) else 0.0


def fit_lengths(pilot: Pilot, notes: list[str]) -> LengthModel:
  """Completion-length model (module docstring)."""
  cap = int(pilot.cfg.sampler.max_new_tokens)
  raw = pilot.summary.get("completion_lengths")
  if raw:
    notes.append(f"lengths: empirical, {len(raw)} completions from summary.json")
    return LengthModel(kind="empirical", max_tokens=cap, values=tuple(float(v) for v in raw))
  _, win = window(pilot.rows)
  p50 = _mean(win, "lengths/p50")
  p90 = _mean(win, "lengths/p90")
  if not p50:
    raise ProfileError(f"{pilot.workdir}/metrics.jsonl has no lengths/p50 values")
  if p90 and p90 < cap and p90 > p50:
    sigma = math.log(p90 / p50) / 1.2816
  else:
    trunc = min(max(_mean(win, "lengths/truncation_rate") or 0.0, 1e-3), 0.5)
    z = statistics.NormalDist().inv_cdf(1 - trunc)
    sigma = max(math.log(cap / p50), 1e-3) / max(z, 1e-3)
  drift = length_drift(pilot.rows)
  if drift:
    notes.append(f"lengths: median drifts {100 * drift:+.2f}% per optimizer step")
  notes.append(f"lengths: lognormal median {p50:.3g} sigma {sigma:.2f} (from percentiles; "
               f"summary.json has no completion_lengths)")
  return LengthModel(kind="lognormal", max_tokens=cap, median=p50, sigma=sigma,
                     drift_per_step=drift)


def _lognormal_from_rows(win: list[dict], prefix: str) -> Latency | None:
  """Lognormal with median = mean of <prefix>_p50; sigma from <prefix>_mean when logged,
  else the least-squares sigma of ln(p_q / p50) = sigma z_q over p95 and p99."""
  p50 = _mean(win, f"{prefix}_p50")
  if not p50 or p50 <= 0:
    return None
  mean = _mean(win, f"{prefix}_mean")
  if mean and mean > p50:
    sigma = math.sqrt(2 * math.log(mean / p50))
  else:
    pairs = [(z, _mean(win, f"{prefix}_{q}")) for z, q in ((1.645, "p95"), (2.326, "p99"))]
    pairs = [(z, p) for z, p in pairs if p and p > p50]
    sigma = (sum(z * math.log(p / p50) for z, p in pairs) / sum(z * z for z, _ in pairs)
             if pairs else 1e-3)
  return Latency(kind="lognormal", mean_s=p50 * math.exp(sigma**2 / 2), sigma=sigma)


def fit_verifier(pilot: Pilot, notes: list[str]) -> Latency:
  """Service time of one verifier call (module docstring), in order of preference."""
  from rl_jax.tasks.base import TaskError
  from rl_jax.tasks.latency import make_latency

  raw = pilot.summary.get("verifier_service_s")
  if raw:
    notes.append(f"verifier: empirical service times of {len(raw)} calls from summary.json")
    return Latency(kind="empirical", values=tuple(float(v) for v in raw))
  _, win = window(pilot.rows)
  fitted = _lognormal_from_rows(win, "latency/verifier_service")
  if fitted is not None:
    notes.append(f"verifier: lognormal service time, mean {fitted.mean_s:.3g}s "
                 f"sigma {fitted.sigma:.2f}")
    return fitted
  if pilot.cfg.verifier.latency != "none":
    try:
      configured = make_latency(pilot.cfg.verifier)
    except TaskError as e:
      raise ProfileError(f"{pilot.workdir}/config.json: {e}") from None
    notes.append("verifier: latency/verifier_* include pool queueing, so the service time "
                 f"is the pilot's injected {configured.kind} latency (mean {configured.mean_s:.3g}s)")
    return configured
  fitted = _lognormal_from_rows(win, "latency/verifier")
  if fitted is None:
    notes.append("verifier: no latency/verifier_p50 in metrics.jsonl; verification taken as instant")
    return Latency(kind="none")
  notes.append(f"verifier: lognormal from latency/verifier_* (mean {fitted.mean_s:.3g}s), "
               f"which include pool queueing: an upper bound on service time")
  return fitted


def fit_trainer(pilot: Pilot, *, prompt_tokens: int, trainer_devices: int,
                scaling_efficiency: float, notes: list[str],
                contention: contention_lib.Contention | None = None) -> TrainerModel:
  """Optimizer-step time model (module docstring)."""
  contention = contention or contention_lib.Contention()
  from rl_jax.orchestration.policy import StalenessPolicy
  from rl_jax.trainer.buckets import pick_bucket
  cfg = pilot.cfg
  policy = StalenessPolicy.from_config(cfg.rl)
  base, win = window(pilot.rows)
  batch = cfg.rl.groups_per_step * cfg.rl.group_size
  # A row whose per-step padded tokens (the batch shape) were never seen before holds
  # the XLA compilation of that shape: it is left out of the fit and sets compile_s.
  seen, first = set(), set()
  for p, r in zip([{"step": 0}] + pilot.rows[:-1], pilot.rows):
    if "trainer/padded_tokens" in r and r["step"] > p["step"]:
      shape = r["trainer/padded_tokens"] / (r["step"] - p["step"])
      if shape not in seen:
        seen.add(shape)
        first.add(r["step"])
  prev, a, y, compile_rows, idle = base, [], [], [], []
  for row in win:
    steps = row["step"] - prev["step"]
    if (steps == 1 and "trainer/busy_frac" in row and
        prev.get("queue/depth", 0) >= cfg.rl.groups_per_step):
      # The batch was queued when the step before ended: the gap is the loop's own.
      idle.append(row["time_s"] - prev["time_s"] -
                  (_busy_s(row, "trainer/busy_frac") - _busy_s(prev, "trainer/busy_frac")))
    if "trainer/busy_frac" in row:
      busy = contention.alone_busy_s(
          "trainer", _busy_s(row, "trainer/busy_frac") - _busy_s(prev, "trainer/busy_frac"),
          prev["time_s"], row["time_s"])
      syncs = sum(policy.publishes(k) for k in range(prev["step"] + 1, row["step"] + 1))
      train = busy - syncs * row.get("weight_sync/duration_s", 0.0)
    else:
      train = row.get("trainer/step_time_s", 0.0) * steps
    if "trainer/padded_tokens" in row:
      tokens = row["trainer/padded_tokens"]
    else:
      longest = prompt_tokens + row.get("lengths/p99", cfg.sampler.max_new_tokens)
      tokens = steps * batch * pick_bucket(int(math.ceil(longest)), cfg.trainer.length_buckets)
    if row["step"] in first:
      compile_rows.append((steps, tokens, max(train, 0.0)))
    else:
      a.append([steps, tokens])
      y.append(max(train, 0.0))
    prev = row
  if len(y) < 2:  # too few rows without a compilation: keep them all
    a += [[st, tok] for st, tok, _ in compile_rows]
    y += [t for _, _, t in compile_rows]
    compile_rows = []
  a, y = np.asarray(a, np.float64), np.asarray(y, np.float64)
  if not np.sum(y) > 0:
    raise ProfileError(f"{pilot.workdir}/metrics.jsonl shows no trainer busy time "
                       f"(trainer/busy_frac); cannot fit the trainer")
  if "trainer/padded_tokens" not in win[-1]:
    notes.append("trainer: no trainer/padded_tokens in metrics.jsonl; estimated from lengths/p99")
  fixed, inv_rate = nnls(a, y)
  if inv_rate <= 0:
    # Token counts too uniform to separate the two terms: charge the time to tokens,
    # which is the conservative reading for longer responses.
    inv_rate, fixed = float(np.sum(y) / np.sum(a[:, 1])), 0.0
    notes.append("trainer: step time not separable into fixed + per-token; all per-token")
  eff = 1.0 + scaling_efficiency * (trainer_devices - 1)
  compile_s = 0.0
  if compile_rows:
    # Excess of the rows that compiled over the fitted step time (one compile each).
    compile_s = float(np.mean([max(t - (st * fixed + tok * inv_rate), 0.0)
                               for st, tok, t in compile_rows]))
    notes.append(f"trainer: {len(compile_rows)} step(s) at a new batch shape left out of the "
                 f"fit; compilation {compile_s:.3g}s per new shape")
  loop_s = 0.0
  if len(idle) >= MIN_READY_STEPS:
    loop_s = max(float(np.median(idle)), 0.0)
    notes.append(f"trainer: {loop_s:.3g}s of host time between steps whose batch was "
                 f"queued (median of {len(idle)})")
  return TrainerModel(fixed_s=float(fixed), tokens_per_s_per_device=1.0 / (inv_rate * eff),
                      scaling_efficiency=scaling_efficiency, compile_s=compile_s,
                      loop_s=loop_s)


def _decode_rows(base: dict, win: list[dict], steps_per_call: int):
  """(row before, row, decode steps, sampler tokens) of each window row since the row
  before it."""
  prev = base
  for row in win:
    steps = (row["sampler/generate_calls"] - prev.get("sampler/generate_calls", 0)) * steps_per_call
    yield prev, row, steps, row["sampler/tokens_per_s"] * (row["time_s"] - prev["time_s"])
    prev = row


def slot_occupancy(mean_len: float, steps_per_call: int) -> float:
  """Slots held per sequence that emits a token: a sequence holds its slot for its
  tokens and one call more (Scenario.pipeline_lag_steps), so a decode step runs
  (mean_len + steps_per_call) / mean_len sequences per token it emits."""
  return (max(mean_len, 1.0) + steps_per_call) / max(mean_len, 1.0)


def fit_sampler_direct(pilot: Pilot, *, prompt_tokens: int, lengths: LengthModel,
                       replicas: int, notes: list[str],
                       contention: contention_lib.Contention | None = None) -> SamplerModel | None:
  """Regression on per-row decode steps (alone seconds); None when the pilot did not
  log them."""
  contention = contention or contention_lib.Contention()
  base, win = window(pilot.rows)
  if "sampler/generate_calls" not in win[-1]:
    return None
  from rl_jax.sampler.engine import resolve_steps_per_call  # "auto": this machine's backend
  spc = resolve_steps_per_call(pilot.cfg.sampler.steps_per_call)
  mean_len = float(np.mean(lengths.sample(np.random.default_rng(0), 4096)))
  occupancy = slot_occupancy(mean_len, spc)
  a, y, w = [], [], []
  for prev, row, steps, tokens in _decode_rows(base, win, spc):
    busy = contention.alone_busy_s(
        "sampler", _busy_s(row, "sampler/busy_frac") - _busy_s(prev, "sampler/busy_frac"),
        prev["time_s"], row["time_s"])
    if steps <= 0 or busy <= 0:
      continue
    active = tokens / steps * occupancy
    ctx = row.get("sampler/mean_context", prompt_tokens + mean_len / 2)
    a.append([1.0, active / replicas, active * ctx / replicas])
    y.append(busy / steps)
    w.append(steps)
  if len(y) < 3:
    return None
  # Weighted by decode steps: the fit must reproduce total busy seconds (a row of few
  # steps, e.g. one interrupted by a pause, says little about the step time).
  a, y, sw = np.asarray(a), np.asarray(y), np.sqrt(np.asarray(w, np.float64))
  const = float(np.sum(sw * sw * y) / np.sum(sw * sw))
  x = nnls(a * sw[:, None], y * sw)
  sse_const = float(np.sum((sw * (y - const)) ** 2))
  sse_fit = float(np.sum((sw * (a @ x - y)) ** 2))
  if sse_const > 0 and sse_fit <= 0.8 * sse_const:
    notes.append(f"sampler: step = {x[0]:.3g} + {x[1]:.3g} n/R + {x[2]:.3g} ctx/R s")
    return SamplerModel(base_s=float(x[0]), per_seq_s=float(x[1]), per_ctx_token_s=float(x[2]))
  notes.append(f"sampler: constant decode step {const:.3g}s (active/context explain little)")
  return SamplerModel(base_s=const, per_seq_s=0.0, per_ctx_token_s=0.0)


def active_per_decode_step(rows: list[dict], steps_per_call: int) -> np.ndarray:
  """Sequences per decode step (all replicas together) of each row of the window that
  decoded: the sampler's tokens since the row before over its decode steps, times
  slot_occupancy at the window's mean lengths/p50 (the `active` of fit_sampler_direct).
  Empty when the rows log no generate calls."""
  base, win = window(rows)
  if not win or "sampler/generate_calls" not in win[-1]:
    return np.zeros(0)
  p50 = [r["lengths/p50"] for r in win if r.get("lengths/p50")]
  occupancy = slot_occupancy(float(np.mean(p50)), steps_per_call) if p50 else 1.0
  return np.asarray([tokens / steps * occupancy for _, _, steps, tokens in
                     _decode_rows(base, win, steps_per_call) if steps > 0], np.float64)


def sampler_busy_per_step(rows: list[dict]) -> float:
  """Sampler busy seconds per optimizer step over the window of a run's rows."""
  base, win = window(rows)
  last = win[-1]
  return ((_busy_s(last, "sampler/busy_frac") - _busy_s(base, "sampler/busy_frac")) /
          max(last["step"] - base["step"], 1))


def fit_profile(pilot: Pilot, *, scaling_efficiency: float = 0.9) -> Profile:
  """Fits every model except a sampler without decode-step counts (see calibrate)."""
  cfg = pilot.cfg
  notes: list[str] = []
  prompt = pilot.summary.get("prompt_tokens_mean") or _mean(pilot.rows, "lengths/prompt_mean")
  if prompt is None:
    prompt = cfg.data.max_prompt_length
    notes.append(f"prompt length: not logged; using data.max_prompt_length = {prompt}")
  prompt = int(round(prompt))
  replicas = int(cfg.mesh.sampler.get("data", 1))
  from rl_jax import sharding
  trainer_devices = sharding.mesh_devices(cfg.mesh)[1]
  lengths = fit_lengths(pilot, notes)
  verifier = fit_verifier(pilot, notes)
  base, _ = window(pilot.rows)
  contention = contention_lib.fit_contention(pilot.summary, base["time_s"], notes)
  trainer = fit_trainer(pilot, prompt_tokens=prompt, trainer_devices=trainer_devices,
                        scaling_efficiency=scaling_efficiency, notes=notes,
                        contention=contention)
  sampler = fit_sampler_direct(pilot, prompt_tokens=prompt, lengths=lengths,
                               replicas=replicas, notes=notes, contention=contention)
  needs_calibration = sampler is None
  if needs_calibration:
    # A first guess for calibration: every slot busy, step = busy / (tokens / slots).
    base, win = window(pilot.rows)
    busy = _busy_s(win[-1], "sampler/busy_frac") - _busy_s(base, "sampler/busy_frac")
    tokens = sum(r["sampler/tokens_per_s"] * (r["time_s"] - p["time_s"])
                 for p, r in zip([base] + win[:-1], win))
    guess = busy * cfg.sampler.max_concurrent_decodes / max(tokens, 1.0)
    sampler = SamplerModel(base_s=max(guess, 1e-6), per_seq_s=0.0, per_ctx_token_s=0.0)
  turns = fit_turns(pilot, notes)
  if turns is not None:
    s = pilot.summary
    lengths = lengths.scaled(s["tokens_model"] / max(s["tokens_model"] + s["tokens_env"], 1))
  sync_s = pilot.summary.get("weight_sync_s_mean")
  if sync_s is None:
    sync_s = float(np.mean([r.get("weight_sync/duration_s", 0.0) for r in pilot.rows]))
  return Profile(sampler=sampler, trainer=trainer, lengths=lengths, verifier_latency=verifier,
                 weight_sync_s=float(sync_s), prompt_tokens=prompt,
                 sampler_tensor=int(cfg.mesh.sampler.get("tensor", 1)), notes=notes,
                 needs_calibration=needs_calibration, turns=turns,
                 sampler_share=contention.sampler_share,
                 trainer_share=contention.trainer_share,
                 uniform_rate=fit_uniform_rate(pilot, notes))


def fit_uniform_rate(pilot: Pilot, notes: list[str]) -> float:
  """Share of verified groups whose rewards were all equal. A pilot that filtered counts
  them (filtered + trained uniform over completed groups); one that did not logs the
  trained batch's zero-variance groups per step (optim/zero_var_groups)."""
  s = pilot.summary
  if getattr(pilot.cfg.rl, "filter_groups", "none") != "none" and s.get("groups_completed"):
    rate = ((s.get("groups_filtered_zero_variance", 0) + s.get("groups_uniform_capped", 0))
            / s["groups_completed"])
  else:
    _, win = window(pilot.rows)
    counts = [r["optim/zero_var_groups"] for r in win if "optim/zero_var_groups" in r]
    if not counts:
      return 0.0
    rate = float(np.mean(counts)) / pilot.cfg.rl.groups_per_step
  notes.append(f"groups with all rewards equal: {100 * rate:.0f}% of those verified "
               f"(filtered with rl.filter_groups=zero_variance)")
  return float(rate)


def fit_turns(pilot: Pilot, notes: list[str]) -> TurnModel | None:
  """A tool-using pilot's turns and tool calls (module docstring); None otherwise."""
  s = pilot.summary
  if "turns_per_rollout_mean" not in s:
    return None
  tool = pilot.cfg.env.tool
  values = tuple(s.get("tool_latency_s") or ())
  latency = Latency(kind="empirical", values=values) if values else Latency(kind="none")
  obs = s["tokens_env"] / max(s["tool_calls"], 1)
  notes.append(f"turns: {s['turns_per_rollout_mean']:.2f} per episode (geometric), "
               f"{obs:.0f} observation tokens per call, tool latency from "
               f"{len(values)} pilot calls")
  return TurnModel(kind="geometric", mean_turns=max(float(s["turns_per_rollout_mean"]), 1.0),
                   observation_tokens=int(round(obs)), max_turns=int(pilot.cfg.env.max_turns),
                   tool=VerifierModel(latency=latency, workers=int(tool.workers),
                                      timeout_s=float(tool.timeout_s), retries=0))

"""Plots and an HTML page from run workdirs (summary.json + metrics.jsonl).

Used by launch/report.py (one or more workdirs) and launch/compare.py (sync vs async, one
seed or the median and range over several).
"""
from __future__ import annotations

import html
import json
import os
import textwrap
from typing import Sequence

import numpy as np

from rl_jax.errors import UserError
from rl_jax.metrics import read_jsonl


class ReportError(UserError, ValueError):
  pass


def load_run(workdir: str) -> dict:
  path = os.path.join(workdir, "summary.json")
  if not os.path.isfile(path):
    raise ReportError(f"{path} does not exist: is {workdir!r} a finished run's workdir?")
  with open(path) as f:
    summary = json.load(f)
  mpath = os.path.join(workdir, "metrics.jsonl")
  rows = read_jsonl(mpath) if os.path.isfile(mpath) else []
  name = summary.get("mode", os.path.basename(os.path.normpath(workdir)))
  return {"name": name, "workdir": workdir, "summary": summary, "rows": rows}


def final_reward(curve: Sequence[Sequence[float]], last: int = 3) -> float:
  """Mean held-out reward of the last `last` evaluations (one evaluation is noisy)."""
  return float(np.mean([r for _, _, r in curve[-last:]]))


def time_to_target(curve: Sequence[Sequence[float]], target: float) -> float | None:
  """Pipeline wall time of the first held-out evaluation at or above `target`."""
  for t, _, r in curve:
    if r >= target - 1e-9:
      return float(t)
  return None


def compare_headline(sync: dict, async_: dict) -> str:
  """compare.py's headline from the two runs' summaries: time to sync's final held-out
  reward (the mean of its last 3 evaluations) in each mode and the speedup. When async
  never reaches it (both runs train the same number of samples, so while the curves still
  rise a little policy lag or one noisy evaluation can keep async under it), also the
  time each mode took to async's own final reward, a level both reached: quality versus
  wall time at the best level the two share."""
  target = final_reward(sync["heldout_curve"])
  final_async = final_reward(async_["heldout_curve"])
  t_sync = time_to_target(sync["heldout_curve"], target)
  t_async = time_to_target(async_["heldout_curve"], target)
  if t_async is None:
    common = final_async
    c_sync = time_to_target(sync["heldout_curve"], common)
    c_async = time_to_target(async_["heldout_curve"], common)
    return (f"async never reached sync's final held-out reward {target:.3f} (async's final "
            f"{common:.3f}, both the mean of the last 3 evaluations); time to async's final: "
            f"sync {c_sync:.1f}s, async {c_async:.1f}s, speedup "
            f"{c_sync / max(c_async, 1e-9):.2f}x")
  return (f"time to target (held-out reward {target:.3f}): sync {t_sync:.1f}s, "
          f"async {t_async:.1f}s, speedup {t_sync / max(t_async, 1e-9):.2f}x; final held-out "
          f"(mean of last 3 evaluations) sync {target:.3f} vs async {final_async:.3f}")


def median_range(values) -> str:
  """"median [min, max]" of seconds or rewards; a run that never reached its target is
  inf (it counts in the median as the slowest)."""
  v = np.sort(np.asarray([np.inf if x is None else x for x in values], float))
  return f"{float(np.median(v)):.3g} [{v[0]:.3g}, {v[-1]:.3g}]"


def seeds_headline(runs: dict[str, list[dict]]) -> str:
  """compare.py --seeds: per mode (runs[mode] = that mode's seeds' summaries) the time to
  target and the final held-out reward (mean of the last 3 evaluations) as median
  [min, max] over seeds. Target = the median over the first mode's seeds of their final
  reward; a seed that never reaches it counts as inf (and is counted as such)."""
  modes = list(runs)
  finals = {m: [final_reward(s["heldout_curve"]) for s in runs[m]] for m in modes}
  target = float(np.median(finals[modes[0]]))
  times = {m: [time_to_target(s["heldout_curve"], target) for s in runs[m]] for m in modes}
  parts = []
  for m in modes:
    missed = sum(t is None for t in times[m])
    miss = f" ({missed} of {len(times[m])} never reached it)" if missed else ""
    parts.append(f"{m} {median_range(times[m])}s{miss}")
  line = (f"over {len(runs[modes[0]])} seeds, median [min, max]: time to target (held-out "
          f"reward {target:.3f}, {modes[0]}'s median final) " + ", ".join(parts))
  if len(modes) == 2:
    a, b = (float(np.median([np.inf if t is None else t for t in times[m]])) for m in modes)
    if np.isfinite(a) and np.isfinite(b):
      line += f", median speedup {a / max(b, 1e-9):.2f}x"
  return line + "; final held-out (mean of last 3 evaluations) " + ", ".join(
      f"{m} {median_range(finals[m])}" for m in modes)


def plot_seeds(runs: dict[str, list[dict]], path: str, *, title: str, note: str = "") -> str:
  """Held-out reward vs pipeline time with every seed's curve (one colour per mode) to
  `path` (.png or .svg); returns `path`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  check_plot_path(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig, ax = plt.subplots(figsize=(6, 4))
  for i, (mode, seeds) in enumerate(runs.items()):
    for k, run in enumerate(seeds):
      c = np.asarray(run["summary"]["heldout_curve"], float)
      ax.plot(c[:, 0], c[:, 2], marker=".", color=f"C{i}", alpha=0.75,
              label=f"{mode} ({len(seeds)} seeds)" if k == 0 else None)
  _heldout_axes(fig, ax, title, note)
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def _series(rows, key):
  pts = [(r.get("time_s"), r.get(key)) for r in rows if r.get(key) is not None and r.get("time_s") is not None]
  if not pts:
    return np.zeros(0), np.zeros(0)
  t, v = zip(*pts)
  return np.asarray(t, float), np.asarray(v, float)


def _heldout_figure(runs: list[dict], plt, title: str = "Held-out reward vs wall time",
                    note: str = ""):
  """Held-out reward (greedy) against pipeline wall time, one line per run; `note`
  (e.g. compare.py's headline) is wrapped under the axes."""
  fig, ax = plt.subplots(figsize=(6, 4))
  for run in runs:
    c = np.asarray(run["summary"]["heldout_curve"], float)
    ax.plot(c[:, 0], c[:, 2], marker="o", label=run["name"])
  _heldout_axes(fig, ax, title, note)
  return fig


def _heldout_axes(fig, ax, title: str, note: str):
  """Axis labels, title and legend of a held-out reward plot; `note` wrapped under the
  axes, the figure made taller by its lines."""
  ax.set_xlabel("pipeline wall time (s)")
  ax.set_ylabel("held-out reward (greedy)")
  ax.set_title(title)
  ax.legend(fontsize=8)
  if note:
    lines = [w for part in note.split("\n") for w in textwrap.wrap(part, 100)]
    width, height = fig.get_size_inches()
    fig.set_size_inches(width, height + 0.12 * len(lines))
    fig.text(0.5, 0.01, "\n".join(lines), ha="center", va="bottom", fontsize=7)
    fig.tight_layout(rect=(0, (0.15 + 0.12 * len(lines)) / (height + 0.12 * len(lines)), 1, 1))
  else:
    fig.tight_layout()


def check_plot_path(path: str) -> None:
  """A --plot path must end in .png or .svg (checked before any run starts)."""
  ext = os.path.splitext(path)[1].lower()
  if ext not in (".png", ".svg"):
    raise ReportError(f"--plot {path}: the plot is written as .png or .svg, "
                      f"not {ext or 'a file without extension'}")


def plot_heldout(runs: list[dict], path: str, *, title: str = "Held-out reward vs wall time",
                 note: str = "") -> str:
  """Writes the held-out-reward-vs-time plot alone to `path` (.png or .svg, e.g. a
  docs/ image the README links); returns `path`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  check_plot_path(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig = _heldout_figure(runs, plt, title=title, note=note)
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def make_plots(runs: list[dict], outdir: str) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(outdir, exist_ok=True)
  files = []

  def save(fig, name):
    path = os.path.join(outdir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    files.append(name)

  save(_heldout_figure(runs, plt), "heldout_vs_time.png")

  fig, ax = plt.subplots(figsize=(6, 4))
  width = 0.8 / max(len(runs), 1)
  for i, run in enumerate(runs):
    hist = {int(k): v for k, v in run["summary"]["staleness_histogram"].items()}
    disc = run["summary"].get("rollouts_discarded_stale", 0)
    ks = sorted(hist)
    ax.bar(np.asarray(ks) + i * width, [hist[k] for k in ks], width=width,
           label=f"{run['name']} (discarded rollouts: {disc})")
  ax.set_xlabel("staleness at consumption (versions)")
  ax.set_ylabel("groups trained")
  ax.set_title("Staleness histogram")
  ax.legend()
  save(fig, "staleness_hist.png")

  fig, axes = plt.subplots(len(runs), 1, figsize=(7, 2.6 * len(runs)), squeeze=False)
  for ax, run in zip(axes[:, 0], runs):
    t, depth = _series(run["rows"], "queue/depth")
    _, infl = _series(run["rows"], "queue/inflight_groups")
    ax.step(t, depth, where="post", label="queue depth")
    if len(infl):
      ax.step(t, infl, where="post", label="in-flight groups")
    tl = run["summary"].get("timeline", {})
    for row, role in enumerate(("sampler", "trainer")):
      spans = [(a, b - a) for a, b in tl.get(role, [])]
      if spans:
        ax.broken_barh(spans, (-2.5 - 1.5 * row, 1.0), color=f"C{row + 2}", label=f"{role} busy")
    ax.set_title(f"{run['name']}: queue and busy timelines")
    ax.set_xlabel("pipeline wall time (s)")
    ax.legend(loc="upper right", fontsize=7)
  save(fig, "queue_busy.png")

  fig, ax = plt.subplots(figsize=(6, 4))
  for i, run in enumerate(runs):
    for q, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
      t, v = _series(run["rows"], f"lengths/{q}")
      if len(t):
        ax.plot(t, v, style, color=f"C{i}", label=f"{run['name']} {q}")
  ax.set_xlabel("pipeline wall time (s)")
  ax.set_ylabel("completion length (tokens)")
  ax.set_title("Response-length percentiles")
  if ax.get_legend_handles_labels()[0]:  # runs without lengths/* rows draw no lines
    ax.legend(fontsize=7)
  save(fig, "lengths.png")
  tool_runs = [r for r in runs if r["summary"].get("heldout_tool_call_rate_curve")]
  if tool_runs:
    save(_tool_figure(plt, tool_runs), "tool_use.png")
  save(_pipeline_figure(plt, runs), "pipeline_over_time.png")
  if any(_series(r["rows"], "control/admission_bound")[0].size for r in runs):
    save(_control_figure(plt, runs), "control.png")
  return files


def pipeline_windows(rows: list[dict], every: int = 20) -> dict[str, np.ndarray]:
  """Per window of `every` rows (and the row before it), at the window's end time:
  steps_per_hour, trainer_busy_frac, discard_rate (discarded / (discarded + accepted)
  groups) and staleness (mean of staleness/mean), from the cumulative columns."""
  rows = [r for r in rows if "staleness/accepted" in r and "time_s" in r]
  out = {k: [] for k in ("time_s", "steps_per_hour", "trainer_busy_frac", "discard_rate",
                         "staleness")}
  for a, b in zip(rows[:-every:every], rows[every::every]):
    dt = max(b["time_s"] - a["time_s"], 1e-9)
    disc = b["staleness/discarded"] - a["staleness/discarded"]
    acc = b["staleness/accepted"] - a["staleness/accepted"]
    win = [r for r in rows if a["step"] < r["step"] <= b["step"]]
    out["time_s"].append(b["time_s"])
    out["steps_per_hour"].append((b["step"] - a["step"]) / dt * 3600)
    out["trainer_busy_frac"].append((b["trainer/busy_frac"] * b["time_s"] -
                                     a["trainer/busy_frac"] * a["time_s"]) / dt)
    out["discard_rate"].append(disc / max(disc + acc, 1))
    out["staleness"].append(float(np.mean([r.get("staleness/mean", 0.0) for r in win])))
  return {k: np.asarray(v, float) for k, v in out.items()}


PIPELINE_KEYS = ("steps_per_hour", "trainer_busy_frac", "discard_rate", "staleness")


def pipeline_summary(summary: dict) -> dict[str, float]:
  """A run's steps_per_hour (optimizer steps / wall_time_s x 3600), trainer_busy_frac,
  discard_rate (discarded / (discarded + trained) groups) and staleness (mean over the
  trained groups' staleness histogram)."""
  hist = {int(k): v for k, v in summary.get("staleness_histogram", {}).items()}
  trained = sum(hist.values())
  disc = summary.get("groups_discarded_stale", 0)
  return {"steps_per_hour": summary["optimizer_steps"] / max(summary["wall_time_s"], 1e-9) * 3600,
          "trainer_busy_frac": summary["trainer_busy_frac"],
          "discard_rate": disc / max(disc + trained, 1),
          "staleness": sum(k * v for k, v in hist.items()) / max(trained, 1)}


def _pipeline_figure(plt, runs):
  """Steps/h, trainer busy fraction, discard rate and staleness per 20-step window."""
  fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
  keys = (("steps_per_hour", "optimizer steps / hour"), ("trainer_busy_frac", "trainer busy"),
          ("discard_rate", "discarded / consumed groups"), ("staleness", "mean staleness"))
  for i, run in enumerate(runs):
    w = pipeline_windows(run["rows"])
    for ax, (key, _) in zip(axes, keys):
      ax.plot(w["time_s"], w[key], "o-", color=f"C{i}", label=run["name"])
  for ax, (_, label) in zip(axes, keys):
    ax.set_xlabel("pipeline wall time (s)")
    ax.set_ylabel(label)
    ax.set_title(f"{label} (20-step windows)", fontsize=9)
    ax.legend(fontsize=6)
  return fig


def _control_figure(plt, runs):
  """Live control (rl.control): the admission bound and decode slots in force, steps/h
  predicted one window ahead against measured, and the window-ahead relative errors."""
  fig, axes = plt.subplots(1, 3, figsize=(14, 4))
  for i, run in enumerate(runs):
    rows, name = run["rows"], run["name"]
    for key, style in (("control/admission_bound", "-"), ("control/decode_slots", ":")):
      t, v = _series(rows, key)
      axes[0].step(t, v, style, where="post", color=f"C{i}",
                   label=f"{name} {key.split('/')[1]}")
    # Each prediction is for the next window: drawn with that window's measurement.
    t, pred = _series(rows, "control/predicted_steps_per_hour")
    tm, meas = _series(rows, "control/measured_steps_per_hour")
    axes[1].plot(tm, meas, "o-", color=f"C{i}", label=f"{name} measured")
    if len(t) > 1:
      axes[1].plot(tm[1:len(pred)], pred[:len(tm) - 1], "x--", color=f"C{i}",
                   label=f"{name} predicted a window ahead")
    for key, style in (("steps_per_hour", "o-"), ("queue_depth", "s:"), ("staleness", "^--")):
      t, v = _series(rows, f"control/{key}_error")
      if len(t):
        axes[2].plot(t, 100 * v, style, color=f"C{i}", label=f"{name} {key}")
  axes[2].axhspan(-15, 15, color="0.9")
  for ax, (ylabel, title) in zip(axes, (
      ("groups / slots", "Admission bound and decode slots"),
      ("optimizer steps / hour", "Steps/h: measured vs predicted"),
      ("relative error (%)", "Window-ahead prediction error"))):
    ax.set_xlabel("pipeline wall time (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=6)
  return fig


def _tool_figure(plt, runs):
  """Tool use: held-out tool-call rate over time, and tool latency percentiles."""
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  for i, run in enumerate(runs):
    c = np.asarray(run["summary"]["heldout_tool_call_rate_curve"], float)
    left.plot(c[:, 0], c[:, 2], marker="o", color=f"C{i}", label=run["name"])
    for q, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
      t, v = _series(run["rows"], f"latency/tool_{q}")
      if len(t):
        right.plot(t, v, style, color=f"C{i}", label=f"{run['name']} {q}")
  left.set_xlabel("pipeline wall time (s)")
  left.set_ylabel("held-out episodes with a tool call")
  left.set_title("Held-out tool-call rate")
  left.legend()
  right.set_xlabel("pipeline wall time (s)")
  right.set_ylabel("tool latency (s)")
  right.set_title("Tool latency percentiles")
  right.legend(fontsize=7)
  return fig


_KEYS = ("wall_time_s", "optimizer_steps", "heldout_reward_initial", "heldout_reward_final",
         "rollouts_generated", "rollouts_trained", "rollouts_discarded_stale",
         "sampler_tokens_per_s", "trainer_tokens_per_s", "weight_sync_s_mean",
         "sampler_busy_frac", "trainer_busy_frac", "max_queue_depth",
         "groups_filtered_zero_variance", "filtered_share", "sampled_per_trained",
         "groups_uniform_capped", "rollouts_overlong_masked", "rollouts_overlong_penalized")
# Tool use (runs of a task with an environment).
_ENV_KEYS = ("heldout_tool_call_rate_initial", "heldout_tool_call_rate_final",
             "turns_per_rollout_mean", "tool_calls_per_rollout_mean", "tool_call_rate",
             "tool_latency_p50_s", "tool_latency_p95_s", "tool_latency_p99_s", "tool_calls",
             "tool_failures", "tool_timeouts", "tokens_model", "tokens_env", "parked_max",
             "parked_pages_max")


# Live control: decisions, advice given, and mean |window-ahead error| of each prediction.
_CONTROL_KEYS = ("control_decisions", "control_advice", "control_steps_per_hour_error",
                 "control_queue_depth_error", "control_staleness_error")


def _control_value(summary: dict, key: str):
  if key in ("control_decisions", "control_advice"):
    items = summary.get(key)
    if key == "control_advice" and items:
      return "; ".join(f"step {a['step']}: {' '.join(a['overrides'])}" for a in items)
    return None if items is None else len(items)
  name = key[len("control_"):-len("_error")]
  name = name if name == "steps_per_hour" else name + "_mean"
  return summary.get("control_error_mean", {}).get(name)


def write_html(runs: list[dict], outdir: str, headline: str = "") -> str:
  files = make_plots(runs, outdir)
  head = "".join(f"<th>{html.escape(r['name'])}</th>" for r in runs)
  body = ""
  env = any("tool_call_rate" in r["summary"] for r in runs)
  control = any("control_error_mean" in r["summary"] for r in runs)
  for k in _KEYS + (_ENV_KEYS if env else ()) + (_CONTROL_KEYS if control else ()):
    cells = ""
    for r in runs:
      v = _control_value(r["summary"], k) if k in _CONTROL_KEYS else r["summary"].get(k)
      cells += f"<td>{v:.4g}</td>" if isinstance(v, float) else f"<td>{v}</td>"
    body += f"<tr><td>{k}</td>{cells}</tr>"
  imgs = "".join(f'<p><img src="{f}"></p>' for f in files)
  page = (f"<html><head><meta charset='utf-8'><title>rl_jax report</title></head><body>"
          f"<h1>rl_jax report</h1><p>{html.escape(headline)}</p>"
          f"<table border=1 cellpadding=3><tr><th></th>{head}</tr>{body}</table>{imgs}"
          f"<p>Staleness = trainer_version - min(token_versions) at consumption, in published "
          f"versions. Wall time excludes held-out evaluation.</p></body></html>")
  path = os.path.join(outdir, "report.html")
  with open(path, "w") as f:
    f.write(page)
  return path

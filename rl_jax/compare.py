"""Side-by-side runs of one workload (launch/compare.py): sync against async, or two
values of one config field, over one or more seeds, with the headline, HTML report and
plot.

Target = sync's final held-out reward, taken as the mean of its last three evaluations
because one evaluation is noisy; time to target = pipeline time of a run's first
evaluation at or above it; speedup = sync's time to target / async's. If async never
reaches it, the headline also gives each mode's time to async's own final reward (a
level both reached).

Seeds (seeds > 1): each mode runs with config seeds seed, seed + 1, ..., seed + N - 1,
one run after another (runs sharing the machine would distort each other's wall time),
in <workdir>/<mode>_seed<k>. The headline gives time to target and final reward as the
median and [min, max] over seeds (target: the median of sync's finals; a seed that never
reaches it counts as infinitely slow), and the plot shows every seed's curve.

A/B (ab = "FIELD=A,B"): both values of one config field in each of `modes`; runs go to
<workdir>/<value>/<mode>_seed<k> (<workdir>/<value>/<mode> with one seed; value_dir
makes a path value one directory name), and each mode's headline gives time to A's
median final reward and both values' finals as median [min, max] over seeds, with
the sampler busy fraction and, when groups were filtered,
the filtered share and groups sampled per trained group; when a run used live control
(rl.control), also steps per hour, trainer busy fraction, discard rate and mean
staleness (report.pipeline_summary), and the report plots them over time.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Callable, Sequence

from rl_jax import report


def _seeds(config: str, seeds: int, overrides) -> list[tuple[str, list[str]]]:
  """(directory suffix, seed override) of each seed's run."""
  if seeds == 1:
    return [("", [])]
  from rl_jax import config as config_lib
  base = int(config_lib.parse_args(["--config", config, *overrides])[0].seed)
  return [(f"_seed{s}", [f"--config.seed={s}"]) for s in range(base, base + seeds)]


def parse_modes(modes: str) -> list[str]:
  out = [m for m in modes.split(",") if m]
  bad = [m for m in out if m not in ("sync", "async")] or ([] if out else [modes])
  if bad:
    raise report.ReportError(f"--modes takes sync and/or async, comma-separated; got {modes!r}")
  return out


def arms(config: str, workdir: str, *, seeds: int, modes: str, ab: str,
         overrides: Sequence[str]) -> dict[str, list[tuple[str, list[str]]]]:
  """Arm label -> (workdir, overrides) of each of its runs. Arms are the modes, or with
  `ab` "<mode> FIELD=value" for each mode and value."""
  mode_list = parse_modes(modes)
  runs = _seeds(config, seeds, overrides)
  if not ab:
    if set(mode_list) != {"sync", "async"}:
      raise report.ReportError("without --ab, compare.py compares sync against async: "
                               "--modes must be sync,async")
    return {m: [(os.path.join(workdir, m + sfx), [*seed, f"--config.rl.mode={m}"])
                for sfx, seed in runs] for m in mode_list}
  field, _, values = ab.partition("=")
  values = [v for v in values.split(",") if v]
  if not field or len(values) != 2 or values[0] == values[1]:
    raise report.ReportError(f"--ab takes FIELD=A,B with two different values; got {ab!r}")
  dirs = [value_dir(v) for v in values]
  if dirs[0] == dirs[1]:
    raise report.ReportError(f"--ab values {values[0]!r} and {values[1]!r} would share the "
                             f"run directory {dirs[0]!r}")
  return {f"{m} {field}={v}": [
      (os.path.join(workdir, d, m + sfx),
       [*seed, f"--config.rl.mode={m}", f"--config.{field}={v}"]) for sfx, seed in runs]
      for m in mode_list for v, d in zip(values, dirs)}


def value_dir(value: str) -> str:
  """The directory name of an --ab value under --workdir: the value with every character
  other than letters, digits and . _ + - replaced by _ (a path value stays inside it)."""
  name = re.sub(r"[^A-Za-z0-9._+-]", "_", value).lstrip(".")
  return name or "_"


def ab_headline(loaded: dict[str, list[dict]], modes: list[str]) -> str:
  """Per mode: seeds_headline over the two values' runs, then each value's sampler busy
  fraction, (with live control) report.PIPELINE_KEYS and (when it filtered groups)
  filtered share and sampled per trained group."""
  lines = []
  for m in modes:
    arm_sums = {label: [r["summary"] for r in runs] for label, runs in loaded.items()
                if label.split(" ", 1)[0] == m}
    extra = []
    controlled = any("control_decisions" in s for sums in arm_sums.values() for s in sums)
    for label, sums in arm_sums.items():
      value = label.split(" ", 1)[1]
      busy = report.median_range([s["sampler_busy_frac"] for s in sums])
      part = f"{value}: sampler busy {busy}"
      if controlled:
        part += "".join(f", {k.replace('_', ' ')} " + report.median_range(
            [report.pipeline_summary(s)[k] for s in sums]) for k in report.PIPELINE_KEYS)
      if any(s.get("groups_filtered_zero_variance") for s in sums):
        part += (f", filtered share {report.median_range([s['filtered_share'] for s in sums])}"
                 f", sampled per trained "
                 f"{report.median_range([s['sampled_per_trained'] for s in sums])}")
      extra.append(part)
    head = report.seeds_headline({label.split(" ", 1)[1]: s for label, s in arm_sums.items()})
    lines.append(f"{m}: {head}; " + "; ".join(extra))
  return "\n".join(lines)


def _pair_headline(sync: dict, async_: dict) -> str:
  """One seed, sync against async: report.compare_headline, busy fractions and (tool
  use) held-out tool-call rates."""
  line = report.compare_headline(sync, async_)
  line += (f"; sampler busy fraction sync {sync['sampler_busy_frac']:.2f}, async "
           f"{async_['sampler_busy_frac']:.2f}")
  if "heldout_tool_call_rate_final" in sync:
    line += (f"; held-out tool-call rate sync {sync['heldout_tool_call_rate_initial']:.2f} -> "
             f"{sync['heldout_tool_call_rate_final']:.2f}, async "
             f"{async_['heldout_tool_call_rate_initial']:.2f} -> "
             f"{async_['heldout_tool_call_rate_final']:.2f}")
  return line


def run(config: str, workdir: str, *, train: Callable[[list[str]], int],
        train_cmd: Sequence[str], overrides: Sequence[str] = (), seeds: int = 1,
        modes: str = "sync,async", ab: str = "", plot: str = "",
        report_only: bool = False) -> int:
  """Runs every arm's runs one after another (`train(train_cmd + flags)`, each its own
  process), unless report_only; prints the headline, writes the report (and the plot);
  the exit status."""
  if seeds < 1:
    raise report.ReportError(f"--seeds must be >= 1, got {seeds}")
  if plot:
    report.check_plot_path(plot)
  plan = arms(config, workdir, seeds=seeds, modes=modes, ab=ab, overrides=overrides)
  for label, runs in () if report_only else plan.items():
    for d, extra in runs:
      status = train([*train_cmd, "--config", config, *overrides, *extra, "--workdir", d])
      if status != 0:  # train.py printed why
        print(f"error: the {label} run in {d} failed (exit status {status})", file=sys.stderr)
        return status
  loaded = {label: [report.load_run(d) for d, _ in runs] for label, runs in plan.items()}
  name = os.path.splitext(os.path.basename(config.partition(":")[0]))[0]
  title = f"{name}: held-out reward vs wall time"
  if ab or seeds > 1:
    line = (ab_headline(loaded, parse_modes(modes)) if ab else
            report.seeds_headline({m: [r["summary"] for r in rs] for m, rs in loaded.items()}))
    runs = [{**r, "name": os.path.relpath(d, workdir)}
            for label, rs in loaded.items() for r, (d, _) in zip(rs, plan[label])]
    print(line)
    print(f"report: {report.write_html(runs, workdir, headline=line)}")
    if plot:
      print("plot: " + report.plot_seeds(loaded, plot, title=title, note=line))
    return 0
  runs = [loaded["sync"][0], loaded["async"][0]]
  line = _pair_headline(*(r["summary"] for r in runs))
  path = report.write_html(runs, workdir, headline=line)
  print(line)
  print(f"report: {path}")
  if plot:
    print("plot: " + report.plot_heldout(runs, plot, title=title, note=line))
  return 0

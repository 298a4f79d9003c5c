"""Run sync and async GRPO on the same workload and seed, then report time-to-target.

  python launch/compare.py --config configs/default.py --workdir runs/compare [--config.x=y ...]
      [--seeds N] [--plot docs/compare_default.png] [--report-only]
      [--ab FIELD=A,B [--modes async]]

Each mode runs in its own process (fair compile and cache state). Target = sync's final
held-out reward, taken as the mean of its last three evaluations because one evaluation
is noisy; time to target = pipeline time of a run's first evaluation at or above it;
speedup = sync's time to target / async's. If async never reaches it, the headline also
gives each mode's time to async's own final reward (a level both reached). --plot also writes the held-out reward vs
wall time plot, with the headline under it, to a .png or .svg file (the README's images).
--report-only runs nothing and rebuilds the headline, report and plot from the runs
already in --workdir.

--seeds N (N > 1) runs each mode N times, with config seeds seed, seed + 1, ...,
seed + N - 1, one run after another (runs sharing the machine would distort each other's
wall time), in <workdir>/<mode>_seed<k>. The headline gives time to target and final
reward as the median and [min, max] over seeds (target: the median of sync's finals; a
seed that never reaches it counts as infinitely slow), and the plot shows every seed's
curve. The HTML report has one column per run.

--ab FIELD=A,B compares two values of one config field instead (say
rl.filter_groups=none,zero_variance) in each of --modes (default sync,async): runs go to
<workdir>/<value>/<mode>_seed<k> (<workdir>/<value>/<mode> with one seed), and each
mode's headline gives time to A's median final reward and both values' finals as median
[min, max] over seeds, with the sampler busy fraction and, when groups were filtered,
the filtered share and groups sampled per trained group; when a run used live control
(rl.control), also steps per hour, trainer busy fraction, discard rate and mean staleness
(report.pipeline_summary), and the report plots them over time.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rl_jax import cli  # noqa: E402
from rl_jax import report  # noqa: E402


def _train(cmd: list[str]) -> int:
  """Runs one train.py command; its exit status."""
  print("running:", " ".join(cmd), flush=True)
  return subprocess.call(cmd)


def _seeds(args, overrides) -> list[tuple[str, list[str]]]:
  """(directory suffix, seed override) of each seed's run."""
  if args.seeds == 1:
    return [("", [])]
  from rl_jax import config as config_lib
  base = int(config_lib.parse_args(["--config", args.config, *overrides])[0].seed)
  return [(f"_seed{s}", [f"--config.seed={s}"]) for s in range(base, base + args.seeds)]


def _arms(args, overrides) -> dict[str, list[tuple[str, list[str]]]]:
  """Arm label -> (workdir, overrides) of each of its runs. Arms are the modes, or with
  --ab "<mode> FIELD=value" for each mode and value."""
  modes = [m for m in args.modes.split(",") if m]
  bad = [m for m in modes if m not in ("sync", "async")] or ([] if modes else [args.modes])
  if bad:
    raise report.ReportError(f"--modes takes sync and/or async, comma-separated; got {args.modes!r}")
  seeds = _seeds(args, overrides)
  if not args.ab:
    return {m: [(os.path.join(args.workdir, m + sfx), [*seed, f"--config.rl.mode={m}"])
                for sfx, seed in seeds] for m in modes}
  field, _, values = args.ab.partition("=")
  values = [v for v in values.split(",") if v]
  if not field or len(values) != 2 or values[0] == values[1]:
    raise report.ReportError(f"--ab takes FIELD=A,B with two different values; got {args.ab!r}")
  return {f"{m} {field}={v}": [
      (os.path.join(args.workdir, v, m + sfx),
       [*seed, f"--config.rl.mode={m}", f"--config.{field}={v}"]) for sfx, seed in seeds]
      for m in modes for v in values}


def _ab_headline(loaded: dict[str, list[dict]], modes: list[str]) -> str:
  """Per mode: seeds_headline over the two values' runs, then each value's sampler busy
  fraction, (with live control) report.PIPELINE_KEYS and (when it filtered groups)
  filtered share and sampled per trained group."""
  lines = []
  for m in modes:
    arms = {label: [r["summary"] for r in runs] for label, runs in loaded.items()
            if label.split(" ", 1)[0] == m}
    extra = []
    controlled = any("control_decisions" in s for sums in arms.values() for s in sums)
    for label, sums in arms.items():
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
    head = report.seeds_headline({label.split(" ", 1)[1]: s for label, s in arms.items()})
    lines.append(f"{m}: {head}; " + "; ".join(extra))
  return "\n".join(lines)


def _main(argv):
  p = cli.ArgumentParser(description=__doc__)
  p.add_argument("--config", required=True)
  p.add_argument("--workdir", default="runs/compare")
  p.add_argument("--seeds", type=int, default=1, help="runs per mode (seeds seed .. "
                 "seed + N - 1, one after another); the headline gives median and range")
  p.add_argument("--plot", default="", help="also write the held-out reward vs time plot "
                 "to this .png or .svg file")
  p.add_argument("--report-only", action="store_true",
                 help="run nothing: rebuild the headline, report and plot from the "
                 "runs already in --workdir")
  p.add_argument("--ab", default="", help="FIELD=A,B: compare two values of one config "
                 "field in each of --modes instead of sync against async")
  p.add_argument("--modes", default="sync,async", help="modes to run, comma-separated")
  args, overrides = p.parse_known_args(argv)
  if args.seeds < 1:
    raise report.ReportError(f"--seeds must be >= 1, got {args.seeds}")
  if args.plot:
    report.check_plot_path(args.plot)
  arms = _arms(args, overrides)
  if not args.ab and set(arms) != {"sync", "async"}:
    raise report.ReportError("without --ab, compare.py compares sync against async: "
                             "--modes must be sync,async")
  for label, runs in () if args.report_only else arms.items():
    for d, extra in runs:
      status = _train([sys.executable, os.path.join(ROOT, "launch", "train.py"),
                       "--config", args.config, *overrides, *extra, "--workdir", d])
      if status != 0:  # train.py printed why
        print(f"error: the {label} run in {d} failed (exit status {status})", file=sys.stderr)
        return status
  loaded = {label: [report.load_run(d) for d, _ in runs] for label, runs in arms.items()}
  name = os.path.splitext(os.path.basename(args.config.partition(":")[0]))[0]
  if args.ab or args.seeds > 1:
    if args.ab:
      line = _ab_headline(loaded, [m for m in args.modes.split(",") if m])
    else:
      line = report.seeds_headline({m: [r["summary"] for r in rs] for m, rs in loaded.items()})
    runs = [{**r, "name": os.path.relpath(d, args.workdir)}
            for label, rs in loaded.items() for r, (d, _) in zip(rs, arms[label])]
    print(line)
    print(f"report: {report.write_html(runs, args.workdir, headline=line)}")
    if args.plot:
      print("plot: " + report.plot_seeds(
          loaded, args.plot, title=f"{name}: held-out reward vs wall time", note=line))
    return 0
  runs = [loaded["sync"][0], loaded["async"][0]]
  sync, async_ = (r["summary"] for r in runs)
  line = report.compare_headline(sync, async_)
  line += (f"; sampler busy fraction sync {sync['sampler_busy_frac']:.2f}, async "
           f"{async_['sampler_busy_frac']:.2f}")
  if "heldout_tool_call_rate_final" in sync:
    line += (f"; held-out tool-call rate sync {sync['heldout_tool_call_rate_initial']:.2f} -> "
             f"{sync['heldout_tool_call_rate_final']:.2f}, async "
             f"{async_['heldout_tool_call_rate_initial']:.2f} -> "
             f"{async_['heldout_tool_call_rate_final']:.2f}")
  path = report.write_html(runs, args.workdir, headline=line)
  print(line)
  print(f"report: {path}")
  if args.plot:
    print("plot: " + report.plot_heldout(
        runs, args.plot, title=f"{name}: held-out reward vs wall time", note=line))
  return 0


def main(argv=None):
  return cli.run(_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())

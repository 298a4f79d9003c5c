"""Run sync and async GRPO on the same workload and seed, then report time-to-target.

  python launch/compare.py --config configs/default.py --workdir runs/compare [--config.x=y ...]
      [--seeds N] [--plot docs/compare_default.png] [--report-only]

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


def _runs(args, overrides) -> dict[str, list[tuple[str, list[str]]]]:
  """mode -> (workdir, seed override) of each of its runs."""
  if args.seeds == 1:
    return {m: [(os.path.join(args.workdir, m), [])] for m in ("sync", "async")}
  from rl_jax import config as config_lib
  base = int(config_lib.parse_args(["--config", args.config, *overrides])[0].seed)
  return {m: [(os.path.join(args.workdir, f"{m}_seed{s}"), [f"--config.seed={s}"])
              for s in range(base, base + args.seeds)] for m in ("sync", "async")}


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
  args, overrides = p.parse_known_args(argv)
  if args.seeds < 1:
    raise report.ReportError(f"--seeds must be >= 1, got {args.seeds}")
  if args.plot:
    report.check_plot_path(args.plot)
  workdirs = _runs(args, overrides)
  for mode, dirs in () if args.report_only else workdirs.items():
    for d, seed in dirs:
      status = _train([sys.executable, os.path.join(ROOT, "launch", "train.py"),
                       "--config", args.config, *overrides, *seed,
                       f"--config.rl.mode={mode}", "--workdir", d])
      if status != 0:  # train.py printed why
        print(f"error: the {mode} run in {d} failed (exit status {status})", file=sys.stderr)
        return status
  loaded = {m: [report.load_run(d) for d, _ in dirs] for m, dirs in workdirs.items()}
  name = os.path.splitext(os.path.basename(args.config.partition(":")[0]))[0]
  if args.seeds > 1:
    line = report.seeds_headline({m: [r["summary"] for r in runs] for m, runs in loaded.items()})
    runs = []
    for m, seeds in loaded.items():
      for r, (d, _) in zip(seeds, workdirs[m]):
        runs.append({**r, "name": os.path.basename(d)})
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

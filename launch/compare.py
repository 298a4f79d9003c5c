"""Run sync and async GRPO on the same workload and seed, then report time-to-target.

  python launch/compare.py --config configs/default.py --workdir runs/compare [--config.x=y ...]
      [--plot docs/compare_default.png] [--report-only]

Each mode runs in its own process (fair compile and cache state). Target = sync's final
held-out reward, taken as the mean of its last three evaluations because one evaluation
is noisy; time to target = pipeline time of a run's first evaluation at or above it;
speedup = sync's time to target / async's. If async never reaches it, the headline also
gives each mode's time to async's own final reward (a level both reached). --plot also writes the held-out reward vs
wall time plot, with the headline under it, to a .png or .svg file (the README's images).
--report-only runs nothing and rebuilds the headline, report and plot from the runs
already in --workdir.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rl_jax import cli  # noqa: E402
from rl_jax import report  # noqa: E402


def _main(argv):
  p = cli.ArgumentParser(description=__doc__)
  p.add_argument("--config", required=True)
  p.add_argument("--workdir", default="runs/compare")
  p.add_argument("--plot", default="", help="also write the held-out reward vs time plot "
                 "to this .png or .svg file")
  p.add_argument("--report-only", action="store_true",
                 help="run nothing: rebuild the headline, report and plot from the two "
                 "runs already in --workdir")
  args, overrides = p.parse_known_args(argv)
  if args.plot:
    report.check_plot_path(args.plot)
  for mode in () if args.report_only else ("sync", "async"):
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), "--config", args.config,
           *overrides, f"--config.rl.mode={mode}", "--workdir", os.path.join(args.workdir, mode)]
    print("running:", " ".join(cmd), flush=True)
    status = subprocess.call(cmd)
    if status != 0:  # train.py printed why
      print(f"error: the {mode} run failed (exit status {status})", file=sys.stderr)
      return status
  runs = [report.load_run(os.path.join(args.workdir, m)) for m in ("sync", "async")]
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
    name = os.path.splitext(os.path.basename(args.config.partition(":")[0]))[0]
    print("plot: " + report.plot_heldout(
        runs, args.plot, title=f"{name}: held-out reward vs wall time", note=line))


def main(argv=None):
  return cli.run(_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())

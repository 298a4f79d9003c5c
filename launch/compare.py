"""Run sync and async GRPO on the same workload and seed, then report time-to-target.

  python launch/compare.py --config configs/default.py --workdir runs/compare [--config.x=y ...]
      [--plot docs/compare_default.png]

Each mode runs in its own process (fair compile and cache state). Target = sync's final
held-out reward, taken as the mean of its last three evaluations because one evaluation
is noisy; time to target = pipeline time of a run's first evaluation at or above it;
speedup = sync's time to target / async's. --plot also writes the held-out reward vs
wall time plot, with the headline under it, to a .png or .svg file (the README's images).
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
  args, overrides = p.parse_known_args(argv)
  if args.plot:
    report.check_plot_path(args.plot)
  for mode in ("sync", "async"):
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), "--config", args.config,
           *overrides, f"--config.rl.mode={mode}", "--workdir", os.path.join(args.workdir, mode)]
    print("running:", " ".join(cmd), flush=True)
    status = subprocess.call(cmd)
    if status != 0:  # train.py printed why
      print(f"error: the {mode} run failed (exit status {status})", file=sys.stderr)
      return status
  runs = [report.load_run(os.path.join(args.workdir, m)) for m in ("sync", "async")]
  sync, async_ = (r["summary"] for r in runs)
  target = report.final_reward(sync["heldout_curve"])
  t_sync = report.time_to_target(sync["heldout_curve"], target)
  t_async = report.time_to_target(async_["heldout_curve"], target)
  if t_async is None:
    line = f"async never reached sync's final held-out reward {target:.3f}"
  else:
    line = (f"time to target (held-out reward {target:.3f}): sync {t_sync:.1f}s, "
            f"async {t_async:.1f}s, speedup {t_sync / max(t_async, 1e-9):.2f}x; final held-out "
            f"(mean of last 3 evaluations) sync {target:.3f} vs async "
            f"{report.final_reward(async_['heldout_curve']):.3f}")
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

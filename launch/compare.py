"""Run sync and async GRPO on the same workload, or two values of one config field, and
report time-to-target (rl_jax/compare.py says how it is measured).

  python launch/compare.py --config configs/default.py --workdir runs/compare [--config.x=y ...]
      [--seeds N] [--plot docs/compare_default.png] [--report-only]
      [--ab FIELD=A,B [--modes async]]

Each run is its own train.py process (fair compile and cache state), one after another.
--seeds N runs each mode with config seeds seed .. seed + N - 1 (median and range over
seeds). --ab FIELD=A,B compares two values of one field in each of --modes. --plot also
writes the held-out reward vs wall time plot, headline under it (.png or .svg).
--report-only runs nothing and rebuilds headline, report and plot from --workdir.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rl_jax import cli  # noqa: E402
from rl_jax import compare  # noqa: E402


def _train(cmd: list[str]) -> int:
  """Runs one train.py command; its exit status."""
  print("running:", " ".join(cmd), flush=True)
  return subprocess.call(cmd)


def _main(argv):
  p = cli.ArgumentParser(description=__doc__)
  p.add_argument("--config", required=True)
  p.add_argument("--workdir", default="runs/compare")
  p.add_argument("--seeds", type=int, default=1, help="runs per mode (seeds seed .. "
                 "seed + N - 1, one after another); the headline gives median and range")
  p.add_argument("--plot", default="", help="also write the held-out reward vs time plot "
                 "to this .png or .svg file")
  p.add_argument("--report-only", action="store_true", help="run nothing: rebuild the "
                 "headline, report and plot from the runs already in --workdir")
  p.add_argument("--ab", default="", help="FIELD=A,B: compare two values of one config "
                 "field in each of --modes instead of sync against async")
  p.add_argument("--modes", default="sync,async", help="modes to run, comma-separated")
  args, overrides = p.parse_known_args(argv)
  return compare.run(args.config, args.workdir, train=lambda cmd: _train(cmd),
                     train_cmd=[sys.executable, os.path.join(ROOT, "launch", "train.py")],
                     overrides=overrides, seeds=args.seeds, modes=args.modes, ab=args.ab,
                     plot=args.plot, report_only=args.report_only)


def main(argv=None):
  return cli.run(_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())

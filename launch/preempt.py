"""Preemption drill: SIGTERM a training run at chosen steps, resume it, report the cost.

  python launch/preempt.py --at 100,250 [--window 10] -- python launch/train.py \
      --config configs/default.py --config.checkpoint.every=50 --workdir runs/drill/all

Per preemption: groups and sampled tokens lost, groups continued, pipeline time lost
(the `window` steps after the resume against the `window` steps before) and the restart's
wall time (rl_jax/drill.py). The runs' output goes to <workdir>/drill.log.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import cli  # noqa: E402
from rl_jax import drill  # noqa: E402


def _main(argv):
  if "--" not in argv:
    raise drill.DrillError("give the train command after -- (see --help)")
  split = argv.index("--")
  p = cli.ArgumentParser(description=__doc__)
  p.add_argument("--at", required=True,
                 help="optimizer steps to preempt at, comma-separated and increasing")
  p.add_argument("--window", type=int, default=10,
                 help="steps before and after each resume compared for the time lost")
  args = p.parse_args(argv[:split])
  command = argv[split + 1:]
  try:
    at = [int(s) for s in args.at.split(",")]
  except ValueError:
    p.error(f"--at must be comma-separated steps, got {args.at!r}")
  if not at or at != sorted(set(at)) or at[0] < 1:
    p.error(f"--at must be increasing steps >= 1, got {args.at!r}")
  if not command:
    raise drill.DrillError("the train command after -- is empty")
  drill.workdir_of(command)
  if command[0] in ("python", "python3"):
    command = [sys.executable, *command[1:]]
  restarts = drill.run(command, at)
  for line in drill.report(drill.workdir_of(command), args.window, restarts):
    print(line)


def main(argv=None):
  return cli.run(_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())

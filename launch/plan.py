"""Plan the sampler / trainer split of a cluster by simulation, before running the job.

  python launch/plan.py --config configs/default.py --devices 8 [--profile WORKDIR]
      [--memory-gb 139] [--sweep-staleness 0,1,2,4] [--sweep-inflight auto,16,32]
      [--max-discard 0.05] [--turns-per-episode 2 [--turns-dist geometric]
      [--observation-tokens 16]] [--filter-rate 0.3] [--out DIR] [--config.x=y ...]
  python launch/plan.py --config configs/default.py --validate WORKDIR [--profile PILOT]
  python launch/plan.py --from-run WORKDIR [--window STEPS]   (the run's config.json)

--profile fits the throughput models and distributions from a pilot's workdir;
--validate compares the prediction for that run's own configuration with what it observed.
--from-run refits from the run's last window (--window steps, default its rl.control_every)
as live control does (rl.control), prints the refit table and the restart advice live
control gives: another split, weight-sync cadence or group size predicted to give >= 15%
more optimizer steps per hour at the same staleness bound.
--sweep-inflight takes rl.max_inflight_groups values; auto = (max_staleness + 1) * groups_per_step.
--turns-per-episode: tool-using episodes of that many model turns on average (a list: an
empirical distribution), a call to the env.tool pool of the config between two turns
(rl_jax.planner.TurnModel); default: a tool-using --profile pilot's fitted turns.
--filter-rate: share of verified groups whose rewards are all equal; with
rl.filter_groups=zero_variance they are filtered and replaced, so the simulated sampler
samples more groups per step while the trainer's batch is the informative groups.
Default: measured from the --profile pilot, else 0.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import cli  # noqa: E402
from rl_jax import config as config_lib  # noqa: E402
from rl_jax.planner import commands  # noqa: E402


def _main(argv):
  if cli.print_help(argv, __doc__):
    return 0
  # --from-run reads the run's own config.json; --config is then only its fallback.
  base = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "configs", "base.py")
  cfg, rest = config_lib.parse_args(argv, default_config=base if "--from-run" in argv else None)
  config_lib.check_before_jax(cfg)
  p = cli.ArgumentParser(description=__doc__)
  p.add_argument("--devices", type=int)
  p.add_argument("--profile")
  p.add_argument("--validate")
  p.add_argument("--from-run")
  p.add_argument("--window", type=int)
  p.add_argument("--memory-gb", type=float)
  p.add_argument("--sweep-staleness", default="")
  p.add_argument("--sweep-inflight", default="")
  p.add_argument("--max-discard", type=float, default=0.05)
  p.add_argument("--turns-per-episode", default="")
  p.add_argument("--turns-dist", choices=("geometric", "fixed"), default="geometric")
  p.add_argument("--observation-tokens", type=int, default=16)
  p.add_argument("--filter-rate", type=float, default=None)
  p.add_argument("--out", default="runs/plan")
  return commands.run(cfg, p.parse_args(rest))


def main(argv):
  return cli.run(_main, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

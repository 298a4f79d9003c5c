"""Train a policy with synchronous or asynchronous GRPO.

  python launch/train.py --config configs/default.py [--workdir runs/x] [--config.rl.mode=sync]
      [--overwrite] [--debug] [--dry-run]

With --config.checkpoint.every=N the run checkpoints to <workdir>/checkpoints, and the same
command with the same --workdir resumes from the newest checkpoint. A workdir belongs to
one run (rl_jax/workdir.py): a second run on it is refused while the first holds its lock,
and a workdir holding another run's files is refused unless --overwrite deletes them.
Exit status (rl_jax/cli.py): 0 done; 1 with one `error:` line (--debug adds the
traceback); 143 after SIGTERM (preempted: rerun the same command to resume). --dry-run
checks the flags and the config and exits (rl_jax/cli.py).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import cli  # noqa: E402  (imports no jax)
from rl_jax import config as config_lib  # noqa: E402
from rl_jax import workdir as workdir_lib  # noqa: E402


def _main(argv):
  if cli.print_help(argv, __doc__):
    return 0
  cfg, rest = config_lib.parse_args(argv)
  config_lib.check_before_jax(cfg)  # before the flag parse, where a --dry-run stops
  if cli.dry_running():  # every check that needs no devices (choices, domains) too
    config_lib.validate(cfg, num_devices=sys.maxsize)
  parser = cli.ArgumentParser(description=__doc__)
  parser.add_argument("--workdir", default="runs/default")
  parser.add_argument("--overwrite", action="store_true",
                      help="delete the run files already in --workdir and start over")
  args = parser.parse_args(rest)
  lock = workdir_lib.claim(args.workdir, cfg, overwrite=args.overwrite)
  from rl_jax.orchestration import runtime
  runtime.prepare_host_devices(cfg)  # before jax initialises: CPU runs get fake devices
  from rl_jax.orchestration import loop
  try:
    summary = loop.run(cfg, args.workdir)
  except loop.RunError as e:
    raise cli.UserError(str(e)) from e
  except loop.Preempted as e:
    print(e, flush=True)
    return cli.EXIT_PREEMPTED
  finally:
    if lock is not None:
      lock.release()
  if "wall_time_s" not in summary:  # a follower process of a multi-process run
    print(f"done: process {summary['process_index']} followed process 0 for "
          f"{summary['optimizer_steps']} optimizer steps", flush=True)
    return 0
  resumed = (f"; {summary['groups_lost_on_resume']} groups lost on resume "
             f"({summary['sampler_tokens_lost_on_resume']} sampled tokens)"
             if summary["resumes"] else "")
  tools = ""
  if "heldout_tool_call_rate_final" in summary:
    tools = (f"; held-out tool-call rate {summary['heldout_tool_call_rate_initial']:.3f} -> "
             f"{summary['heldout_tool_call_rate_final']:.3f}")
  print(f"done: held-out reward {summary['heldout_reward_initial']:.3f} -> "
        f"{summary['heldout_reward_final']:.3f} in {summary['wall_time_s']:.0f}s{tools}"
        f"{resumed}; "
        f"summary in {os.path.join(args.workdir, 'summary.json')}")
  return 0


def main(argv):
  return cli.run(_main, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""Train a policy with synchronous or asynchronous GRPO.

  python launch/train.py --config configs/default.py [--workdir runs/x] [--config.rl.mode=sync]

With --config.checkpoint.every=N the run checkpoints to <workdir>/checkpoints, and the same
command with the same --workdir resumes from the newest checkpoint. SIGTERM saves and exits
with status 0 within checkpoint.grace_period_s; any failure exits non-zero with one line.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import config as config_lib  # noqa: E402  (imports no jax)


def main(argv):
  cfg, rest = config_lib.parse_args_or_exit(argv)
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--workdir", default="runs/default")
  args = parser.parse_args(rest)
  from rl_jax.orchestration import runtime
  runtime.prepare_host_devices(cfg)  # before jax initialises: CPU runs get fake devices
  try:
    from rl_jax.orchestration import loop
    summary = loop.run(cfg, args.workdir)
  except (config_lib.ConfigError, loop.RunError) as e:
    sys.exit(f"error: {e}")
  except loop.Preempted as e:
    print(e, flush=True)
    return
  except KeyboardInterrupt:
    sys.exit("interrupted")
  if "wall_time_s" not in summary:  # a follower process of a multi-process run
    print(f"done: process {summary['process_index']} followed process 0 for "
          f"{summary['optimizer_steps']} optimizer steps", flush=True)
    return
  lost = summary["groups_lost_on_resume"]
  print(f"done: held-out reward {summary['heldout_reward_initial']:.3f} -> "
        f"{summary['heldout_reward_final']:.3f} in {summary['wall_time_s']:.0f}s"
        f"{f'; {lost} groups lost on resume' if summary['resumes'] else ''}; "
        f"summary in {os.path.join(args.workdir, 'summary.json')}")


if __name__ == "__main__":
  main(sys.argv[1:])

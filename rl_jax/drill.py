"""Preemption drill: SIGTERM a training run at chosen optimizer steps, rerun the same
command to resume it, and report what each preemption cost.

  python launch/preempt.py --at 100,250 [--window 10] -- python launch/train.py \
      --config configs/default.py --config.checkpoint.every=50 --workdir runs/drill/all

The train command needs --workdir and checkpointing on (SIGTERM saves at the next step
boundary). At each --at step the drill waits for the run's metrics row of that step,
sends SIGTERM, waits for exit status 143 and starts the command again; the last start
runs to the end. Per preemption it prints, from summary.json's `resumes` and
metrics.jsonl (pipeline time, `time_s`, which excludes held-out evaluation):

- groups and sampled tokens lost (sampler work done again), groups continued
  (queued, being verified, being decoded: checkpoint.rollouts), groups discarded as too
  stale on resume;
- pipeline time lost: (time of the `window` steps after the resumed step) - (time of
  the `window` steps before it), i.e. the refill of the pipeline plus the first train
  step's compile in the new process, against the pace before the preemption;
- restart wall time: SIGTERM to the resumed run's first metrics row (exit, process
  start, restore, compiles: not pipeline time).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from rl_jax import cli
from rl_jax.errors import UserError

POLL_S = 0.2


class DrillError(UserError, RuntimeError):
  """A drill that cannot go on: one sentence."""


def workdir_of(command: list[str]) -> str:
  """The --workdir of a train command."""
  for i, arg in enumerate(command):
    if arg == "--workdir" and i + 1 < len(command):
      return command[i + 1]
    if arg.startswith("--workdir="):
      return arg.split("=", 1)[1]
  raise DrillError("the train command has no --workdir: the drill resumes the run there")


def rows(workdir: str) -> dict[int, dict]:
  """metrics.jsonl's optimizer-step rows by step (a line being written is skipped)."""
  out = {}
  path = os.path.join(workdir, "metrics.jsonl")
  if os.path.exists(path):
    for line in open(path).read().splitlines():
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if "time_s" in row:
        out[row["step"]] = row
  return out


def _start(command: list[str], log):
  return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def run(command: list[str], at: list[int]) -> list[float]:
  """Runs the drill; the restart wall time of each preemption (SIGTERM to the resumed
  run's first new metrics row)."""
  workdir = workdir_of(command)
  os.makedirs(workdir, exist_ok=True)
  restarts, killed_at = [], None
  with open(os.path.join(workdir, "drill.log"), "a") as log:
    for n, step in enumerate([*at, None]):
      proc = _start(command, log)
      if killed_at is not None:
        last = max(rows(workdir), default=0)
        while proc.poll() is None and not [s for s in rows(workdir) if s > last]:
          time.sleep(POLL_S)
        restarts.append(time.time() - killed_at)
      if step is None:
        status = proc.wait()
        if status != 0:
          raise DrillError(f"the last run exited with status {status} (its output: "
                           f"{os.path.join(workdir, 'drill.log')})")
        return restarts
      while proc.poll() is None and max(rows(workdir), default=0) < step:
        time.sleep(POLL_S)
      if proc.poll() is not None:
        raise DrillError(f"run {n + 1} exited with status {proc.returncode} before step "
                         f"{step} (its output: {os.path.join(workdir, 'drill.log')})")
      proc.send_signal(signal.SIGTERM)
      killed_at = time.time()
      if proc.wait() != cli.EXIT_PREEMPTED:
        raise DrillError(f"run {n + 1} exited with status {proc.returncode} after SIGTERM, "
                         f"not {cli.EXIT_PREEMPTED} (is checkpoint.every > 0?)")
  return restarts


def time_lost(by_step: dict[int, dict], step: int, window: int) -> float | None:
  """Pipeline seconds of the `window` steps after `step` minus those of the `window`
  steps before it; None when the run lacks either window."""
  need = (step - window, step, step + window)
  if any(s not in by_step for s in need):
    return None
  t = [by_step[s]["time_s"] for s in need]
  return (t[2] - t[1]) - (t[1] - t[0])


def report(workdir: str, window: int, restarts: list[float]) -> list[str]:
  """One line per resume of the run in `workdir`, then a total."""
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  by_step = rows(workdir)
  lines = []
  for i, r in enumerate(summary["resumes"]):
    lost = time_lost(by_step, r["step"], window)
    restart = f"; restart {restarts[i]:.0f} s of wall time" if i < len(restarts) else ""
    lines.append(
        f"resume at step {r['step']}: {r['groups_lost']} groups lost ({r['tokens_lost']} "
        f"sampled tokens), {r['groups_queued']} queued + {r['groups_continued']} in flight "
        f"continued ({r['sequences_continued']} sequences, {r['tokens_continued']} tokens), "
        f"{r['groups_discarded_stale']} discarded as stale; pipeline time lost "
        + ("n/a" if lost is None else f"{lost:.1f} s") + f" ({window}-step windows){restart}")
  lines.append(
      f"total: {summary['sampler_tokens_lost_on_resume']} sampled tokens lost over "
      f"{len(summary['resumes'])} resumes; held-out {summary['heldout_reward_initial']:.3f} -> "
      f"{summary['heldout_reward_final']:.3f} in {summary['wall_time_s']:.0f} s of pipeline time")
  return lines

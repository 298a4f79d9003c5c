"""The preemption drill (launch/preempt.py, rl_jax/drill.py): its time-lost formula
against a direct computation, and a real drill of a tiny async run preempted twice."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from rl_jax import drill

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_time_lost_compares_the_windows_around_the_resume():
  rng = np.random.default_rng(0)
  t = np.cumsum(rng.uniform(0.5, 1.5, size=40))
  by_step = {s: {"time_s": float(t[s - 1])} for s in range(1, 41)}
  for step, window in ((20, 10), (12, 3), (30, 10)):
    want = (t[step + window - 1] - t[step - 1]) - (t[step - 1] - t[step - window - 1])
    assert drill.time_lost(by_step, step, window) == pytest.approx(want)
  assert drill.time_lost(by_step, 35, 10) is None  # no 10 steps after step 35
  assert drill.time_lost(by_step, 5, 10) is None


def test_the_train_command_must_name_its_workdir():
  assert drill.workdir_of(["train.py", "--workdir", "runs/a"]) == "runs/a"
  assert drill.workdir_of(["train.py", "--workdir=runs/b"]) == "runs/b"
  with pytest.raises(drill.DrillError, match="no --workdir"):
    drill.workdir_of(["train.py", "--config", "configs/default.py"])


def test_a_drill_preempts_twice_and_the_default_loses_no_sampled_token(tmp_path):
  """A tiny async run (checkpoint.rollouts=all by default) SIGTERMed after steps 2 and
  4 and resumed each time: two resume lines, nothing lost, every step trained once."""
  workdir = str(tmp_path / "run")
  train = [sys.executable, "launch/train.py", "--config", "configs/default.py",
           "--config.task.digits=1", "--config.task.heldout_size=16",
           "--config.sampler.max_new_tokens=6", "--config.sampler.max_concurrent_decodes=16",
           "--config.mesh.sampler.data=1", "--config.mesh.trainer.data=1",
           "--config.rl.total_steps=8", "--config.rl.groups_per_step=4",
           "--config.rl.group_size=4", "--config.rl.eval_every=4",
           "--config.warmstart.steps=0", "--config.metrics.tensorboard=false",
           "--config.checkpoint.every=1", "--config.checkpoint.grace_period_s=60",
           "--workdir", workdir]
  out = subprocess.run([sys.executable, "launch/preempt.py", "--at", "2,4", "--window", "1",
                        "--", *train], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  resumes = [line for line in lines if line.startswith("resume at step")]
  assert len(resumes) == 2, out.stdout
  for line in resumes:
    assert re.search(r": 0 groups lost \(0 sampled tokens\)", line), line
    assert re.search(r"pipeline time lost -?\d+\.\d s \(1-step windows\); restart \d+ s", line)
  assert lines[-1].startswith("total: 0 sampled tokens lost over 2 resumes"), lines[-1]
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert [r["step"] for r in summary["resumes"]][0] >= 2
  assert summary["groups_trained"] == 8 * 4 and summary["groups_lost_on_resume"] == 0
  assert "resumed from checkpoint" in open(os.path.join(workdir, "drill.log")).read()

"""Workdir ownership (rl_jax/workdir.py) and metrics.jsonl continuation (rl_jax/metrics.py)."""
import json
import os
import socket
import subprocess
import sys

import pytest

from rl_jax import config as config_lib
from rl_jax import metrics
from rl_jax import workdir as workdir_lib
from rl_jax.workdir import WorkdirError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**fields):
  cfg = config_lib.base_config()
  for dotted, value in fields.items():  # rl__mode="sync" sets cfg.rl.mode
    *group, key = dotted.split("__")
    node = cfg[group[0]] if group and group[0] else cfg
    node[key] = value
  return cfg


def _write_run(path, cfg, rows=2, checkpoint_steps=()):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    f.write(cfg.to_json())
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for step in range(1, rows + 1):
      f.write(json.dumps({"step": step, "optim/loss": 0.5}) + "\n")
  for step in checkpoint_steps:
    os.makedirs(os.path.join(path, "checkpoints", str(step)))


def test_second_run_on_a_locked_workdir_is_refused_naming_the_holder(tmp_path):
  lock = workdir_lib.claim(str(tmp_path), _cfg())
  try:
    with pytest.raises(WorkdirError) as e:
      workdir_lib.claim(str(tmp_path), _cfg())
    msg = str(e.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg, msg
    assert "rl_jax.lock" in msg and "\n" not in msg
  finally:
    lock.release()
  assert not os.path.exists(tmp_path / "rl_jax.lock")
  workdir_lib.claim(str(tmp_path), _cfg()).release()  # free again once released


def test_lock_held_by_another_process_is_refused(tmp_path):
  """A real second process: the lock is the kernel's, per open file, not per pid."""
  code = ("import sys, time; sys.path.insert(0, sys.argv[1]);"
          "from rl_jax import workdir, config;"
          "workdir.claim(sys.argv[2], config.base_config()); print('held', flush=True);"
          "time.sleep(600)")
  p = subprocess.Popen([sys.executable, "-c", code, ROOT, str(tmp_path)],
                       stdout=subprocess.PIPE, text=True)
  try:
    assert p.stdout.readline().strip() == "held"
    with pytest.raises(WorkdirError, match=f"pid {p.pid} on host"):
      workdir_lib.claim(str(tmp_path), _cfg())
  finally:
    p.kill()
    p.wait()
  # The holder died without releasing: its stale lock file is taken over.
  assert os.path.exists(tmp_path / "rl_jax.lock")
  lock = workdir_lib.claim(str(tmp_path), _cfg())
  assert json.load(open(tmp_path / "rl_jax.lock"))["pid"] == os.getpid()
  lock.release()


def test_other_processes_of_a_multi_process_run_do_not_lock(tmp_path):
  lock = workdir_lib.claim(str(tmp_path), _cfg())
  try:
    assert workdir_lib.claim(str(tmp_path), _cfg(), environ={"JAX_PROCESS_ID": "1"}) is None
  finally:
    lock.release()


def test_workdir_holding_another_run_is_refused_unless_overwrite(tmp_path):
  run = str(tmp_path / "run")
  _write_run(run, _cfg(__seed=0), rows=3)
  with pytest.raises(WorkdirError) as e:
    workdir_lib.claim(run, _cfg(__seed=1))
  assert "seed=0" in str(e.value) and "seed=1" in str(e.value) and "--overwrite" in str(e.value)
  with pytest.raises(WorkdirError, match="rl.mode='async'.*rl.mode='sync'"):
    workdir_lib.claim(run, _cfg(rl__mode="sync"))
  (tmp_path / "run" / "notes.txt").write_text("mine")
  workdir_lib.claim(run, _cfg(__seed=1), overwrite=True).release()
  assert sorted(os.listdir(run)) == ["notes.txt"]  # only the run's own files go


def test_config_of_a_run_that_failed_at_start_up_is_no_run(tmp_path):
  """A run that stopped before its first result left only config.json: the corrected
  command may use the workdir (the bad task.path is exactly what differs)."""
  _write_run(str(tmp_path), _cfg(**{"task__path": "typo.jsonl"}), rows=0)
  os.unlink(tmp_path / "metrics.jsonl")
  workdir_lib.claim(str(tmp_path), _cfg(**{"task__path": "data.jsonl"})).release()
  (tmp_path / "summary.json").write_text("{}")  # a finished run is a run
  with pytest.raises(WorkdirError, match="task.path='typo.jsonl'"):
    workdir_lib.claim(str(tmp_path), _cfg(**{"task__path": "data.jsonl"}))


def test_rows_without_a_checkpoint_to_resume_are_refused(tmp_path):
  run = str(tmp_path)
  cfg = _cfg()
  _write_run(run, cfg, rows=2)
  with pytest.raises(WorkdirError, match="2 metrics.jsonl rows .* no checkpoint"):
    workdir_lib.claim(run, cfg)
  os.makedirs(os.path.join(run, "checkpoints", "3.orbax-checkpoint-tmp-1"))  # unfinished
  with pytest.raises(WorkdirError, match="no checkpoint"):
    workdir_lib.claim(run, cfg)
  os.makedirs(os.path.join(run, "checkpoints", "2"))
  with pytest.raises(WorkdirError, match="checkpoint.every=0"):
    workdir_lib.claim(run, cfg)
  cfg.checkpoint.every = 1
  workdir_lib.claim(run, cfg).release()  # a resume
  # A resumable workdir defers the config comparison to the checkpoint's own config.
  cfg.seed = 5
  workdir_lib.claim(run, cfg).release()


def test_unwritable_workdir_is_one_line(tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(WorkdirError, match="cannot be created"):
    workdir_lib.claim(str(tmp_path / "file" / "run"), _cfg())
  if os.geteuid() == 0:
    pytest.skip("root writes to read-only directories")
  ro = tmp_path / "ro"
  ro.mkdir()
  ro.chmod(0o500)
  try:
    with pytest.raises(WorkdirError, match="not writable"):
      workdir_lib.claim(str(ro), _cfg())
  finally:
    ro.chmod(0o700)


def test_truncate_after_keeps_rows_a_resume_does_not_write_again(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  rows = [{"step": 1, "optim/loss": 1.0}, {"step": 2, "optim/loss": 2.0},
          {"step": 2, "reward/heldout": 0.5},  # the final row of a run finished at step 2
          {"step": 3, "optim/loss": 3.0}]
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
    f.write('{"step": 4, "optim')  # killed mid-write
  assert metrics.truncate_after(path, 2) == 3
  assert metrics.read_jsonl(path) == rows[:2]
  assert metrics.truncate_after(path, 0) == 2
  assert metrics.read_jsonl(path) == []
  assert metrics.truncate_after(str(tmp_path / "none.jsonl"), 3) == 0

"""Workdir ownership: one run per workdir, and a workdir never mixes two runs' files.

`claim(workdir, cfg, overwrite=...)` runs in launch/train.py before anything is built:

  1. The workdir is created and must be writable (else one line naming the path).
  2. A lock: `<workdir>/rl_jax.lock` is opened and locked (fcntl.flock, released by the
     kernel when the process ends, however it ends) and holds {"pid", "host", "started"}.
     A second run on the same workdir is refused with one line naming the holder. A lock
     file left by a dead process is simply locked again (its content is overwritten).
     Multi-process runs lock in process 0 only (the others run the same command).
  3. Identity: a workdir holding results (metrics rows, a checkpoint or summary.json; a
     config.json alone is what a run that failed at start-up leaves, and is replaced)
     whose config.json differs from `cfg` in a field that defines the
     run (`defines_run`: seed, model.*, task.*, data.* except task.heldout_size and
     model.remat, as for resuming from a checkpoint, plus rl.mode) is refused. A workdir
     with a checkpoint to resume from is checked against the checkpoint instead, when
     the run starts (rl_jax.checkpoint.check_workdir).
  4. Rows without a state: metrics.jsonl rows but no checkpoint to resume from (or
     checkpoint.every=0, which would not resume) would mix two runs' rows: refused.

`overwrite=True` (train.py --overwrite) deletes the files a run writes (config.json,
metrics.jsonl, summary.json, error.log, tb/, checkpoints/) and starts over; it never
deletes the workdir itself or anything else in it. Imports no jax.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time

from rl_jax import config as config_lib
from rl_jax.errors import UserError

LOCK_FILE = "rl_jax.lock"
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "error.log")
RUN_DIRS = ("tb", "checkpoints")
# Fields that define a run beyond what a checkpoint must share (config.RESUME_MUST_MATCH).
_RUN_IDENTITY = ("rl.mode",)
_RANK_VARS = ("JAX_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "TPU_WORKER_ID")


class WorkdirError(UserError):
  """The workdir cannot be used for this run: one sentence naming the path and why."""


def defines_run(key: str) -> bool:
  """Whether two runs whose configs differ in `key` are different runs."""
  return key in _RUN_IDENTITY or config_lib.resume_must_match(key)


def config_difference(saved: dict, cfg) -> tuple[str, object, object] | None:
  """(field, saved value, new value) of the first field that defines the run and
  differs, else None. Fields only one side has (code changes in between) are ignored."""
  old, new = config_lib.flatten(saved), config_lib.flatten(cfg.to_dict())
  for key in sorted(set(old) & set(new)):
    a, b = json.loads(json.dumps(old[key])), json.loads(json.dumps(new[key]))
    if a != b and defines_run(key):
      return key, old[key], new[key]
  return None


def has_checkpoint(workdir: str) -> bool:
  """Whether `<workdir>/checkpoints` holds a committed step (a directory named by a
  number; orbax writes a step under a temporary name and renames it when complete)."""
  path = os.path.join(workdir, "checkpoints")
  try:
    return any(name.isdigit() and os.path.isdir(os.path.join(path, name))
               for name in os.listdir(path))
  except OSError:
    return False


def count_rows(path: str) -> int:
  try:
    with open(path, "rb") as f:
      return sum(1 for line in f if line.strip())
  except FileNotFoundError:
    return 0


def process_rank(environ=None) -> int:
  """This process's rank from the launcher's environment (0 when there is none)."""
  env = os.environ if environ is None else environ
  for var in _RANK_VARS:
    try:
      return int(env[var])
    except (KeyError, ValueError):
      continue
  return 0


class Lock:
  """An exclusive lock on `<workdir>/rl_jax.lock` for this process (module docstring)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd: int | None = None

  def acquire(self) -> "Lock":
    import fcntl
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise WorkdirError(f"workdir {os.path.dirname(self.path)} is not writable: cannot "
                         f"create {self.path} ({e.strerror})") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      holder = _read_holder(fd)
      os.close(fd)
      raise WorkdirError(
          f"workdir {os.path.dirname(self.path)} is in use by another run ({holder}, lock "
          f"{self.path}); wait for it to end or use another --workdir") from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      os.unlink(self.path)  # before unlocking: a waiting run then creates a fresh file
    except OSError:
      pass
    os.close(self._fd)
    self._fd = None

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()


def _read_holder(fd: int) -> str:
  try:
    info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    return f"pid {info['pid']} on host {info['host']}"
  except (OSError, ValueError, KeyError, TypeError):
    return "a process whose lock file is unreadable"


def _create(workdir: str) -> None:
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f"workdir {workdir} exists and is not a directory")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f"workdir {workdir} cannot be created ({e.strerror})") from None


def clear(workdir: str) -> None:
  """Deletes the files a run writes in `workdir` (module docstring), nothing else."""
  for name in RUN_FILES:
    try:
      os.unlink(os.path.join(workdir, name))
    except FileNotFoundError:
      pass
  for name in RUN_DIRS:
    shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)


def check_contents(workdir: str, cfg) -> None:
  """WorkdirError when `workdir` holds another run or rows that cannot be continued."""
  config_path = os.path.join(workdir, "config.json")
  hint = "use another --workdir, or pass --overwrite to delete that run's files and start over"
  rows = count_rows(os.path.join(workdir, "metrics.jsonl"))
  if not (rows or has_checkpoint(workdir) or
          os.path.exists(os.path.join(workdir, "summary.json"))):
    return  # at most the config.json of a run that failed before its first result
  resumable = has_checkpoint(workdir) and cfg.checkpoint.every > 0
  # With a checkpoint to resume from, the checkpoint's own config decides
  # (checkpoint.check_workdir, naming the model field that differs).
  if os.path.exists(config_path) and not resumable:
    try:
      with open(config_path) as f:
        saved = json.load(f)
    except (OSError, ValueError) as e:
      raise WorkdirError(f"{config_path} cannot be read ({e}); {hint}") from None
    diff = config_difference(saved, cfg)
    if diff is not None:
      key, old, new = diff
      raise WorkdirError(f"workdir {workdir} holds another run: its config.json has "
                         f"{key}={old!r} but this config has {key}={new!r}; {hint}")
  if not rows:
    return
  if not has_checkpoint(workdir):
    raise WorkdirError(f"workdir {workdir} holds {rows} metrics.jsonl rows of a run with no "
                       f"checkpoint to resume from; {hint}")
  if cfg.checkpoint.every <= 0:
    raise WorkdirError(f"workdir {workdir} holds checkpoints, but checkpoint.every=0 does not "
                       f"resume from them; set --config.checkpoint.every, or {hint}")


def claim(workdir: str, cfg, *, overwrite: bool = False, environ=None) -> Lock | None:
  """Creates, locks and checks `workdir` for a run of `cfg` (module docstring); the held
  Lock (None in processes other than 0, and for object-store URLs such as gs://..., which
  hold no lock files), released by `Lock.release` or at exit."""
  if "://" in workdir:
    return None
  _create(workdir)
  lock = Lock(workdir).acquire() if process_rank(environ) == 0 else None
  try:
    if overwrite:
      if lock is not None:
        clear(workdir)
    else:
      check_contents(workdir, cfg)
  except BaseException:
    if lock is not None:
      lock.release()
    raise
  return lock

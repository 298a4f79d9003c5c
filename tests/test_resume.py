"""Resume and fault handling of real runs: launch/train.py in subprocesses, killed with
SIGKILL and preempted with SIGTERM at whatever step they reached, then resumed."""
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from rl_jax import checkpoint as ck
from rl_jax import cli
from rl_jax import config as config_lib
from rl_jax import model as model_lib
from rl_jax.orchestration import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = ["--config.task.digits=1", "--config.task.heldout_size=16",
        "--config.task.heldout_fraction=0.3", "--config.task.format_reward=0.5",
        "--config.sampler.max_new_tokens=6", "--config.sampler.max_concurrent_decodes=16",
        # The usable pool (num_pages - 1) is one group's worst case, 1 prompt page + 4
        # samples x 2 pages: groups wait for pages before they start.
        "--config.sampler.num_pages=10", "--config.mesh.sampler.data=1",
        "--config.mesh.trainer.data=1",
        # Rewards depend on the order rollouts reach the verifiers (below); one step per
        # call keeps the order in which this run's injected failures give a reward spread.
        "--config.sampler.steps_per_call=1",
        # The accounting below counts every admitted group as trained, discarded or lost:
        # no filtering (its resume test turns it on) and a one-batch queue.
        "--config.rl.filter_groups=none", "--config.rl.queue_maxsize=64"]
TINY = ["--config", "configs/default.py", *TASK, "--config.rl.total_steps=5",
        "--config.rl.groups_per_step=4", "--config.rl.group_size=4", "--config.rl.eval_every=2",
        "--config.warmstart.steps=40", "--config.metrics.tensorboard=false",
        "--config.checkpoint.every=1", "--config.checkpoint.keep=20",
        "--config.checkpoint.grace_period_s=20",
        # Injected failures make rewards depend on the verifier pool's call index.
        "--config.verifier.failure_prob=0.2", "--config.verifier.retries=0",
        "--config.verifier.workers=8"]
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def env():
  # The session's persistent compilation cache (tests/conftest.py): later runs load the
  # executables earlier runs and in-process tests compiled; compiling is most of a tiny run.
  assert os.environ["JAX_COMPILATION_CACHE_DIR"]
  return dict(os.environ)


class Run:
  """One launch/train.py process; its output goes to files so pipes never fill."""

  def __init__(self, env, workdir, *extra, script="launch/train.py", args=None):
    os.makedirs(workdir, exist_ok=True)
    n = len([f for f in os.listdir(workdir) if f.startswith("out")])
    self.out_path = os.path.join(workdir, f"out{n}.txt")
    self.err_path = os.path.join(workdir, f"err{n}.txt")
    self.workdir = workdir
    cmd = args or [*TINY, *extra, "--workdir", workdir]
    with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
      self.proc = subprocess.Popen([sys.executable, script, *cmd], cwd=ROOT, env=env,
                                   stdout=out, stderr=err)

  @classmethod
  def finished(cls, workdir, n):
    """The n-th run of `workdir` (its out{n}.txt / err{n}.txt), which has exited."""
    run = cls.__new__(cls)
    run.workdir = workdir
    run.out_path = os.path.join(workdir, f"out{n}.txt")
    run.err_path = os.path.join(workdir, f"err{n}.txt")
    run.proc = None
    return run

  @property
  def out(self):
    return open(self.out_path).read()

  @property
  def err(self):
    return open(self.err_path).read()

  def wait(self, timeout=TIMEOUT_S):
    return self.proc.wait(timeout)

  def wait_for_new_step(self, step):
    """Until this process has written the metrics row of optimizer step >= `step`."""
    deadline = time.time() + TIMEOUT_S
    path = os.path.join(self.workdir, "metrics.jsonl")
    while time.time() < deadline:
      assert self.proc.poll() is None, f"exited early:\n{self.out}\n{self.err[-3000:]}"
      resumed = re.search(r"resumed from checkpoint \S+/(\d+) ", self.out)
      if resumed or "held-out reward at start" in self.out:
        if any(r["step"] >= step for r in _rows(path) if "optim/loss" in r):
          return
      time.sleep(0.05)
    raise AssertionError("timed out")

  def resumed_step(self):
    """The step this process resumed from (waits for its message)."""
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline:
      found = re.search(r"resumed from checkpoint \S+/(\d+) ", self.out)
      if found:
        return int(found.group(1))
      assert self.proc.poll() is None, f"exited early:\n{self.out}\n{self.err[-3000:]}"
      time.sleep(0.05)
    raise AssertionError("timed out")


def _rows(path):
  rows = []
  if os.path.exists(path):
    for line in open(path).read().splitlines():
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:  # a line being written
        pass
  return rows


def _params(workdir, step):
  return jax.tree.leaves(ck.Checkpointer(workdir, read_only=True).restore_params(step)[1])


def _corrupt(workdir, step):
  """Flips the second half of every array data file of one step."""
  for folder, _, files in os.walk(os.path.join(ck.directory(workdir), str(step))):
    for name in files if os.path.basename(folder) == "d" else ():
      with open(os.path.join(folder, name), "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2:] = bytes(b ^ 0xFF for b in data[len(data) // 2:])
        f.seek(0)
        f.write(data)


def _summary(run):
  return json.load(open(os.path.join(run.workdir, "summary.json")))


def _finish(run):
  assert run.wait() == 0, run.err[-3000:]
  return _summary(run)


def _sync_runs(env, base):
  """Runs into `base`: see sync_runs."""
  ref, killed = str(base / "uninterrupted"), str(base / "killed")
  flags = ("--config.rl.mode=sync", "--config.rl.filter_groups=zero_variance",
           "--config.rl.max_oversample=2")
  run = Run(env, killed, *flags)
  run.wait_for_new_step(2)
  run.proc.kill()
  run.wait()
  resumed = Run(env, killed, *flags)
  reference = Run(env, ref, *flags)
  _finish(reference)
  _finish(resumed)


@pytest.fixture(scope="module")
def sync_runs(env, tmp_path_factory):
  """An uninterrupted sync run, and one SIGKILLed after step 2 and resumed; both filter
  zero-variance groups (the untrained model's groups are mostly uniform).

  Under pytest-xdist the module's tests may land on both workers: the first worker to
  get here makes the runs in the session's shared base directory (the workers' bases'
  parent) under a file lock, and every worker tests its own copy (the tests start runs
  in these workdirs, which a run locks)."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent
  shared = base / "resume_sync_runs"
  with open(base / "resume_sync_runs.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (shared / "done").exists():
      shutil.rmtree(shared, ignore_errors=True)
      _sync_runs(env, shared)
      (shared / "done").touch()
  mine = tmp_path_factory.mktemp("sync")
  shutil.copytree(shared, mine, dirs_exist_ok=True)
  reference = Run.finished(str(mine / "uninterrupted"), 0)
  resumed = Run.finished(str(mine / "killed"), 1)
  return reference, _summary(reference), resumed, _summary(resumed)


def test_sync_resume_after_sigkill_is_bitwise_identical(sync_runs):
  reference, ref_summary, resumed, summary = sync_runs
  step = resumed.resumed_step()
  assert step in (1, 2, 3), resumed.out
  for a, b in zip(_params(reference.workdir, 5), _params(resumed.workdir, 5)):
    np.testing.assert_array_equal(a, b)
  # ... and learning happened, so the equality is not that of untouched params.
  assert any(not np.array_equal(a, b) for a, b in zip(_params(reference.workdir, 0),
                                                      _params(reference.workdir, 5)))
  steps = [r["step"] for r in _rows(os.path.join(resumed.workdir, "metrics.jsonl"))]
  assert steps == [1, 2, 3, 4, 5, 5]  # continued from the checkpoint's step: no duplicates
  rows = {r["step"]: r for r in _rows(os.path.join(resumed.workdir, "metrics.jsonl"))
          if "optim/loss" in r}
  ref_rows = {r["step"]: r for r in _rows(os.path.join(reference.workdir, "metrics.jsonl"))
              if "optim/loss" in r}
  assert sorted(rows) == [1, 2, 3, 4, 5]  # rows of the killed attempt past the cut are gone
  assert [rows[s]["optim/loss"] for s in rows] == [ref_rows[s]["optim/loss"] for s in rows]
  assert summary["resumes"] == [{
      "step": step, "groups_lost": 0, "rollouts_lost": 0, "tokens_lost": 0, "groups_queued": 0,
      "groups_continued": 0, "sequences_continued": 0, "tokens_continued": 0,
      "groups_discarded_stale": 0, "skipped_steps": []}]
  assert summary["groups_trained"] == ref_summary["groups_trained"] == 20
  assert summary["groups_lost_on_resume"] == 0
  # The window's filtered groups are filtered again after the resume, counted once.
  for key in ("groups_filtered_zero_variance", "groups_uniform_capped", "groups_admitted",
              "rollouts_generated"):
    assert summary[key] == ref_summary[key], key
  assert summary["groups_filtered_zero_variance"] > 0
  assert summary["heldout_reward_final"] == ref_summary["heldout_reward_final"]
  assert [p[1:] for p in summary["heldout_curve"]] == [p[1:] for p in ref_summary["heldout_curve"]]
  # Faults surfaced as metrics: injected verifier failures; the tiny KV pool is respected.
  assert any(r["verifier/error_rate"] > 0 for r in ref_rows.values())
  assert max(r["sampler/kv_pages_used"] for r in ref_rows.values()) <= 9


def test_export_and_evaluate_reproduce_the_final_heldout_reward(sync_runs, env, tmp_path):
  reference, ref_summary, _, _ = sync_runs
  hf = str(tmp_path / "hf")
  export = Run(env, str(tmp_path / "logs"), script="launch/export.py",
               args=["--workdir", reference.workdir, "--out", hf])
  assert export.wait() == 0, export.err
  _, params = model_lib.from_pretrained(hf)
  for a, b in zip(jax.tree.leaves(params), _params(reference.workdir, 5)):
    np.testing.assert_array_equal(a, b)
  evals = [Run(env, str(tmp_path / "logs"), script="launch/evaluate.py",
               args=["--workdir", reference.workdir]),
           Run(env, str(tmp_path / "logs"), script="launch/evaluate.py",
               args=["--hf", hf, "--config", "configs/default.py", *TASK])]
  for run in evals:
    assert run.wait() == 0, run.err[-3000:]
    reward = float(re.search(r"held-out reward ([0-9.]+)", run.out).group(1))
    assert abs(reward - ref_summary["heldout_reward_final"]) < 1e-4, run.out


@pytest.mark.parametrize("override, field", [("--config.model.preset=qwen2_0_5b", "vocab_size"),
                                             ("--config.seed=3", "seed")])
def test_incompatible_config_is_one_clear_error(sync_runs, env, override, field):
  reference = sync_runs[0]
  run = Run(env, reference.workdir, "--config.rl.mode=sync", override)
  assert run.wait() == 1
  lines = run.err.strip().splitlines()
  assert lines[-1].startswith("error: checkpoint ") and field in lines[-1], run.err
  assert "Traceback" not in run.err


def test_async_kill_preempt_and_corruption_lose_only_in_flight_groups(env, tmp_path):
  workdir = str(tmp_path)
  extra = ("--config.rl.mode=async", "--config.rl.total_steps=6", "--config.warmstart.steps=0")
  run = Run(env, workdir, *extra)
  run.wait_for_new_step(2)
  run.proc.kill()
  run.wait()
  run = Run(env, workdir, *extra)
  first = run.resumed_step()
  # Two steps past the resume, so the step before the one SIGTERM saves (restored below
  # after the corruption) was written by this resumed run, whatever step it stops at.
  run.wait_for_new_step(first + 2)
  t0 = time.time()
  run.proc.send_signal(signal.SIGTERM)
  assert run.wait() == cli.EXIT_PREEMPTED, run.err[-3000:]  # not done: a retry resumes it
  assert time.time() - t0 < 20  # checkpoint.grace_period_s
  stopped = int(re.search(r"preempted \(SIGTERM\) after (\d+) optimizer steps: saved checkpoint "
                          r"step (\d+)", run.out).group(2))
  checkpointer = ck.Checkpointer(workdir, read_only=True)
  assert checkpointer.latest_step() == stopped > first
  # The newest checkpoint rots on disk: the next start restores the one before it.
  _corrupt(workdir, stopped)
  run = Run(env, workdir, *extra)
  summary = _finish(run)
  assert f"checkpoints/{stopped} cannot be restored" in run.err
  assert run.resumed_step() == stopped - 1
  resumes = summary["resumes"]
  assert [r["step"] for r in resumes] == [first, stopped - 1]
  assert resumes[1]["skipped_steps"] == [stopped]
  lost = carried = 0
  for r in resumes:
    state = checkpointer.read_json(r["step"], "loop")
    assert r["groups_lost"] == len(state["lost_group_ids"])
    assert all(g < state["next_group_id"] for g in state["lost_group_ids"])
    # Verified groups queued at the cut are carried by the checkpoint, not lost.
    queued = {g["group_id"] for g in state["queued_groups"]["groups"]}
    assert not queued & set(state["lost_group_ids"])
    carried += len(queued)
    # One process reads one prompt per group id: a resumed run continues the prompt
    # stream exactly where group ids continue, so no prompt is drawn twice.
    assert state["prompts"]["iterator"]["next_index"] == state["next_group_id"]
    lost += r["groups_lost"]
  assert lost + carried > 0 and summary["groups_lost_on_resume"] == lost
  assert f"{lost} groups lost on resume" in run.out
  assert f"{len(state['queued_groups']['groups'])} verified groups queued there are trained" in run.out
  # Exact accounting across kill, preemption and fallback: every admitted group is
  # trained, discarded as stale (carried groups too, past the bound), dropped for a
  # verifier error, lost, or in flight at the end; and no trained group exceeded the bound.
  assert summary["groups_trained"] == 6 * 4
  assert summary["groups_admitted"] == (summary["groups_trained"] +
                                        summary["groups_discarded_stale"] +
                                        summary["groups_dropped_verifier_error"] + lost +
                                        summary["groups_in_flight_at_end"])
  assert max(int(k) for k in summary["staleness_histogram"]) <= 2
  assert summary["rollouts_in_flight_at_end"] >= 0


def test_worker_failure_saves_and_stops_every_thread(tmp_path, monkeypatch):
  """A verifier callback that raises stops the run at once (the pool would only log
  it), after saving the consistent state; one line for the user, the traceback on disk."""
  cfg, _ = config_lib.parse_args([*TINY, "--config.rl.mode=async", "--config.warmstart.steps=0",
                                  "--config.metrics.console=false"])
  config_lib.validate(cfg)
  calls = {"n": 0}
  from rl_jax.orchestration.sampler_worker import SamplerWorker
  original = SamplerWorker._record_verified

  def failing(self, key, result):
    calls["n"] += 1
    if calls["n"] > 40:
      raise KeyError("verifier exploded")
    return original(self, key, result)
  monkeypatch.setattr(SamplerWorker, "_record_verified", failing)
  with pytest.raises(loop.RunError) as info:
    loop.Pipeline(cfg, str(tmp_path)).run()
  # Not the verifier-patience error a swallowed exception would end in.
  message = str(info.value)
  assert message.startswith("a worker thread failed: KeyError: 'verifier exploded'")
  step = int(re.search(r"saved checkpoint step (\d+)", message).group(1))
  assert ck.Checkpointer(str(tmp_path), read_only=True).latest_step() == step
  assert "verifier exploded" in open(tmp_path / "error.log").read()
  assert not [t for t in threading.enumerate() if t.name == "sampler" and t.is_alive()]


def test_sigterm_without_checkpointing_stops_at_once_with_143(env, tmp_path):
  run = Run(env, str(tmp_path), "--config.rl.mode=async", "--config.checkpoint.every=0",
            "--config.checkpoint.grace_period_s=3000", "--config.rl.total_steps=50",
            "--config.warmstart.steps=0")
  run.wait_for_new_step(1)
  run.proc.send_signal(signal.SIGTERM)
  assert run.wait() == cli.EXIT_PREEMPTED, run.err[-3000:]  # well before the grace period
  last = run.out.strip().splitlines()[-1]
  assert re.fullmatch(r"preempted \(SIGTERM\) after \d+ optimizer steps: checkpointing is off "
                      r"\(checkpoint.every=0\), so nothing was saved", last), run.out
  assert "Traceback" not in run.err


def test_sigterm_past_the_grace_period_exits_143():
  code = ("import os, signal, threading, time\n"
          "from rl_jax.orchestration import checkpointing\n"
          "checkpointing.catch_sigterm(threading.Event(), 0.5, saves=True)\n"
          "os.kill(os.getpid(), signal.SIGTERM)\n"
          "time.sleep(300)  # a save that never finishes\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=TIMEOUT_S)
  assert proc.returncode == cli.EXIT_PREEMPTED, proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(
      "error: SIGTERM: the checkpoint could not be saved within checkpoint.grace_period_s=0.5s")


def test_disk_full_names_the_last_committed_step(tmp_path, monkeypatch):
  """A save that fails (the disk is full from step 3 on) ends the run in one line that
  names the newest step that committed, not the step whose write failed."""
  import orbax.checkpoint as ocp
  cfg, _ = config_lib.parse_args([*TINY, "--config.rl.mode=async", "--config.warmstart.steps=0",
                                  "--config.metrics.console=false", "--config.rl.eval_every=0"])
  config_lib.validate(cfg)
  original = ocp.CheckpointManager.save

  def save(self, step, *args, **kwargs):
    if step >= 3:
      raise OSError(28, "No space left on device")
    return original(self, step, *args, **kwargs)
  monkeypatch.setattr(ocp.CheckpointManager, "save", save)
  with pytest.raises(loop.RunError) as info:
    loop.Pipeline(cfg, str(tmp_path)).run()
  message = str(info.value)
  assert message.startswith("writing checkpoint step 3 to ")
  assert "No space left on device" in message and "\n" not in message
  assert f"the newest complete checkpoint is checkpoint {tmp_path}/checkpoints/2; " in message
  assert "failed:" not in message and "trainer" not in message
  assert ck.Checkpointer(str(tmp_path), read_only=True).latest_step() == 2
  assert not [t for t in threading.enumerate() if t.name == "sampler" and t.is_alive()]


def test_queued_groups_round_trip_multi_turn_rollouts():
  """pack_groups / unpack_groups keep every per-token array of a queued group, the
  model mask and turn count of a multi-turn rollout, and None for a single-turn one."""
  from rl_jax.orchestration import checkpointing
  from rl_jax.tasks import make_task
  from rl_jax.types import Group, Rollout
  task = make_task(config_lib.base_config().task)
  multi = Rollout(group_id=3, sample_index=0, prompt_tokens=np.array([1, 5], np.int32),
                  completion_tokens=np.array([7, 8, 9, 10, 2], np.int32),
                  behavior_logprobs=np.array([-0.5, 0, 0, -0.25, -0.125], np.float32),
                  token_versions=np.array([4, -1, -1, 5, 5], np.int32),
                  model_mask=np.array([True, False, False, True, True]), num_turns=2,
                  reward=1.0, reward_info={"correct": 1.0}, verifier_status="ok",
                  completion_text="x", finish_reason="stop")
  single = Rollout(group_id=3, sample_index=1, prompt_tokens=np.array([1, 5], np.int32),
                   completion_tokens=np.array([6, 2], np.int32),
                   behavior_logprobs=np.array([-1, -2], np.float32),
                   token_versions=np.array([4, 4], np.int32), verifier_status="ok")
  group = Group(group_id=3, example=task.example(3), prompt_tokens=multi.prompt_tokens,
                rollouts=[multi, single], index=3)
  packed = json.loads(json.dumps(checkpointing.pack_groups([group])))
  (back,) = checkpointing.unpack_groups(packed, task)
  for got, want in zip(back.rollouts, group.rollouts):
    for name in ("prompt_tokens", "completion_tokens", "behavior_logprobs", "token_versions"):
      np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
      assert getattr(got, name).dtype == getattr(want, name).dtype
    assert (got.num_turns, got.reward, got.sample_index) == (want.num_turns, want.reward,
                                                             want.sample_index)
  np.testing.assert_array_equal(back.rollouts[0].model_mask, multi.model_mask)
  assert back.rollouts[0].model_mask.dtype == bool and back.rollouts[1].model_mask is None
  assert back.rollouts[0].min_version == 4 and back.rollouts[0].staleness(6) == 2


def _wait_mid_decode(worker, ready=None) -> bool:
  """Waits until some sample is decoded partway (a condition, not a time window), then
  returns `ready(partial)` at that look (True without `ready`). When it holds, the sampler
  thread is left paused (the end of the checkpoint's own pause lets it go on), so that the
  cut sees that moment even when the trainer is the slow side."""
  for _ in range(20000):
    worker._pause.set()
    while not worker._paused.is_set() and worker._thread.is_alive():
      time.sleep(0.001)
    partial = worker.take_partial()
    if any(len(v[0]) for seqs in partial.values() for v in seqs.values()):
      if ready is None or ready(partial):
        return True
      worker._pause.clear()
      return False
    worker._pause.clear()
    time.sleep(0.02)  # the sampler thread sees the pause end and steps
  raise AssertionError("the sampler decoded no sample partway (20000 looks)")


def _preempted_and_resumed(tmp_path, monkeypatch, *flags, preempt_at=2, resume_flags=(),
                           before_resume=None, ready=None):
  """An async run preempted (SIGTERM's path) after step `preempt_at` and resumed in
  the same process: (the resumed run's summary, the loop state of the checkpoint it
  resumed from, the groups and partial samples handed to the resumed sampler, and the
  rollouts the resumed sampler finished). The sampler sleeps 20 ms per step and the
  preemption waits for a sample decoded partway, so the cut falls in mid-decode."""
  from rl_jax.orchestration.checkpointing import RunCheckpoints
  from rl_jax.orchestration.sampler_worker import SamplerWorker
  cfg, _ = config_lib.parse_args([*TINY, "--config.rl.mode=async", "--config.warmstart.steps=0",
                                  "--config.rl.total_steps=4", "--config.metrics.console=false",
                                  *flags])
  config_lib.validate(cfg)
  step_once, save = SamplerWorker.step_once, RunCheckpoints.save
  restore_in_flight, finished = SamplerWorker.restore_in_flight, SamplerWorker.on_rollout_finished
  seen = {"restored": None, "rollouts": [], "first": True, "step": None}

  def slow_step(self):
    time.sleep(0.02)
    return step_once(self)

  def preempt(self, step, **kw):
    # Right before the checkpoint's own pause (after any evaluation, whose pause would let
    # the sampler go on): at preempt_at, or with `ready(pipeline, partial)` the first
    # step from preempt_at on, before the last, at which it holds.
    p = self.p
    due = (step == preempt_at if ready is None else preempt_at <= step < p.cfg.rl.total_steps)
    if seen["first"] and seen["step"] is None and due and _wait_mid_decode(
        p.worker, None if ready is None else lambda partial: ready(p, partial)):
      seen["step"] = step
      p._preempt.set()  # what SIGTERM's handler does
    return save(self, step, **kw)

  def restore(self, groups, partial):
    seen["restored"] = (list(groups), dict(partial))
    return restore_in_flight(self, groups, partial)

  def record(self, r, verify=True):
    if not seen["first"]:
      seen["rollouts"].append(r)
    return finished(self, r, verify)
  monkeypatch.setattr(SamplerWorker, "step_once", slow_step)
  monkeypatch.setattr(RunCheckpoints, "save", preempt)
  monkeypatch.setattr(SamplerWorker, "restore_in_flight", restore)
  monkeypatch.setattr(SamplerWorker, "on_rollout_finished", record)
  with pytest.raises(loop.Preempted):
    loop.Pipeline(cfg, str(tmp_path)).run()
  seen["first"] = False
  if before_resume is not None:
    before_resume(cfg)
  cfg, _ = config_lib.parse_args([*TINY, "--config.rl.mode=async", "--config.warmstart.steps=0",
                                  "--config.rl.total_steps=4", "--config.metrics.console=false",
                                  *flags, *resume_flags])
  summary = loop.Pipeline(cfg, str(tmp_path)).run()
  state = ck.Checkpointer(str(tmp_path), read_only=True).read_json(seen["step"], "loop")
  return summary, state, seen["restored"], seen["rollouts"]


def _accounting_holds(summary, lost):
  assert summary["groups_admitted"] == (summary["groups_trained"] +
                                        summary["groups_discarded_stale"] +
                                        summary["groups_dropped_verifier_error"] + lost +
                                        summary["groups_in_flight_at_end"])
  assert summary["rollouts_in_flight_at_end"] >= 0


def test_a_preempted_async_run_continues_its_sequences_where_they_were(tmp_path, monkeypatch):
  """checkpoint.rollouts=all (the default): the cut keeps the queued groups, the groups
  being verified and every sequence being decoded, token for token; the resumed sampler
  continues each sequence after its saved tokens, which keep their log-probs and policy
  versions; nothing is lost and every admitted group is accounted for once."""
  from rl_jax.orchestration import checkpointing
  from rl_jax.tasks import make_task
  summary, state, restored, rollouts = _preempted_and_resumed(tmp_path, monkeypatch)
  assert state["lost_group_ids"] == [] and state["lost_tokens"] == 0
  groups, partial = restored
  saved, saved_partial = checkpointing.unpack(state["inflight_groups"], make_task(
      config_lib.parse_args(TINY)[0].task))
  assert [g.group_id for g in groups] == [g.group_id for g in saved]
  def lists(p):
    return {g: {i: [np.asarray(x).tolist() for x in v] for i, v in seqs.items()}
            for g, seqs in p.items()}
  assert saved_partial, "the cut should fall in mid-decode"
  assert lists(partial) == lists(saved_partial)
  by_key = {(r.group_id, r.sample_index): r for r in rollouts}
  for gid, seqs in partial.items():
    for i, (tokens, logprobs, versions) in seqs.items():
      r = by_key[gid, i]  # finished after the resume, with its saved prefix
      n = len(tokens)
      assert 0 < n < r.num_tokens or r.finish_reason == "stop"
      np.testing.assert_array_equal(r.completion_tokens[:n], tokens)
      np.testing.assert_array_equal(r.behavior_logprobs[:n], logprobs)
      np.testing.assert_array_equal(r.token_versions[:n], versions)
      assert (r.token_versions[n:] >= state["version"]).all()
      assert max(versions) <= state["version"]
  (resume,) = summary["resumes"]
  assert resume["groups_lost"] == 0 and resume["tokens_lost"] == 0
  assert resume["groups_continued"] == len(groups) > 0
  assert resume["sequences_continued"] == sum(len(v) for v in partial.values())
  assert resume["groups_queued"] == len(state["queued_groups"]["groups"])
  assert summary["sampler_tokens_lost_on_resume"] == 0
  assert summary["groups_trained"] == 4 * 4
  _accounting_holds(summary, lost=0)


def test_rollouts_off_loses_the_groups_in_flight_and_counts_their_tokens(tmp_path, monkeypatch):
  """checkpoint.rollouts=off: the same cut carries nothing; the groups it held are lost
  on resume, their sampled tokens counted, and the accounting still holds."""
  summary, state, restored, _ = _preempted_and_resumed(
      tmp_path, monkeypatch, "--config.checkpoint.rollouts=off")
  assert restored == ([], {})
  assert state["queued_groups"]["groups"] == state["inflight_groups"]["groups"] == []
  (resume,) = summary["resumes"]
  assert resume["groups_lost"] == len(state["lost_group_ids"]) > 0
  assert resume["tokens_lost"] == state["lost_tokens"] > 0
  assert summary["sampler_tokens_lost_on_resume"] == resume["tokens_lost"]
  _accounting_holds(summary, lost=resume["groups_lost"])


def test_rollouts_queued_keeps_the_verified_groups_and_loses_the_decoding_ones(tmp_path,
                                                                              monkeypatch):
  """checkpoint.rollouts=queued: the cut keeps the queued groups and the groups whose
  samples have all finished; a group with a sample decoded partway (as the checkpoint's
  own read of the generator saw it) is lost, with its tokens counted."""
  from rl_jax.orchestration import checkpointing
  from rl_jax.orchestration.checkpointing import RunCheckpoints
  from rl_jax.orchestration.sampler_worker import SamplerWorker
  from rl_jax.tasks import make_task
  take, loop_state, reads, cuts = SamplerWorker.take_partial, RunCheckpoints.loop_state, [], []

  def recorded(self):
    reads.append(take(self))
    return reads[-1]

  def cut(self, step):
    state = loop_state(self, step)
    cuts.append((step, reads[-1]))  # the generator as this checkpoint read it
    return state
  monkeypatch.setattr(SamplerWorker, "take_partial", recorded)
  monkeypatch.setattr(RunCheckpoints, "loop_state", cut)
  # Preempted after step 3: the sampler stays paused from the wait to the checkpoint's
  # read. The exit path's save finds step 3 saved and computes no second cut.
  summary, state, restored, _ = _preempted_and_resumed(
      tmp_path, monkeypatch, "--config.checkpoint.rollouts=queued", preempt_at=3)
  (at_cut,) = [partial for step, partial in cuts if step == 3]
  decoding = {g for g, seqs in at_cut.items() if seqs}
  carried, partial = checkpointing.unpack(state["inflight_groups"], make_task(
      config_lib.parse_args(TINY)[0].task))
  assert partial == {} and restored[1] == {}
  assert all(len(g.rollouts) == 4 for g in carried)  # rl.group_size
  assert decoding and decoding <= set(state["lost_group_ids"])
  assert not decoding & {g.group_id for g in carried}
  assert state["lost_tokens"] >= sum(len(v[0]) for g in decoding for v in at_cut[g].values())
  (resume,) = summary["resumes"]
  assert resume["groups_lost"] == len(state["lost_group_ids"])
  assert resume["tokens_lost"] == state["lost_tokens"] == summary["sampler_tokens_lost_on_resume"]
  assert resume["groups_continued"] == len(carried)
  _accounting_holds(summary, lost=resume["groups_lost"])


def test_the_staleness_rule_decides_for_the_groups_in_flight_on_resume(tmp_path, monkeypatch):
  """Resumed with rl.max_staleness=0, every group in flight holding a token of an older
  version than the checkpoint's is discarded on resume (counted by its oldest version),
  not generated to the end; the others continue."""
  from rl_jax.orchestration import checkpointing
  from rl_jax.tasks import make_task
  def holds_older_tokens(pipeline, partial):
    """Some group in flight holds a token older than the trainer's version."""
    v = pipeline.version
    return (any(len(x[2]) and min(x[2]) < v for seqs in partial.values() for x in seqs.values())
            or any(r.num_tokens and r.min_version < v
                   for g in pipeline.worker.cut_state()["generating"] for r in g.rollouts))
  # Preempted at the first step from 3 on whose cut holds such a group.
  summary, state, restored, _ = _preempted_and_resumed(
      tmp_path, monkeypatch, "--config.rl.total_steps=8", preempt_at=3,
      resume_flags=("--config.rl.max_staleness=0",), ready=holds_older_tokens)
  saved, partial = checkpointing.unpack(state["inflight_groups"], make_task(
      config_lib.parse_args(TINY)[0].task))
  oldest = {g.group_id: checkpointing._oldest_version(g, partial) for g in saved}
  stale = {g for g, v in oldest.items() if v is not None and v < state["version"]}
  assert stale, "the cut should hold groups sampled by an older version"
  (resume,) = summary["resumes"]
  assert resume["groups_discarded_stale"] == len(stale)
  assert {g.group_id for g in restored[0]} == set(oldest) - stale
  assert sum(summary["discarded_by_version"].get(str(oldest[g]), 0) for g in stale) >= len(stale)
  _accounting_holds(summary, lost=0)


@pytest.mark.parametrize("change, said", [("tokenizer", "another tokenizer (tokenizer fingerprint"),
                                          ("prompt", "task example")])
def test_rollouts_from_another_tokenizer_or_task_are_refused(tmp_path, monkeypatch, change,
                                                             said):
  """A checkpoint's rollouts sampled with another tokenizer, or from prompts the task now
  encodes differently, are refused with one line that names which and how to resume
  without them; with checkpoint.rollouts=off the same checkpoint resumes."""
  from rl_jax.data import prompts as prompts_lib
  from rl_jax.model import tokenizer as tokenizer_lib

  def change_it(cfg):
    del cfg
    if change == "tokenizer":
      monkeypatch.setattr(tokenizer_lib.CharTokenizer, "fingerprint", lambda self: "char-other")
    else:
      encode = prompts_lib.prompt_tokens
      monkeypatch.setattr(prompts_lib, "prompt_tokens", lambda *a: encode(*a)[:-1] + [7])
  with pytest.raises(loop.RunError) as info:
    _preempted_and_resumed(tmp_path, monkeypatch, before_resume=change_it)
  message = str(info.value)
  assert said in message and "\n" not in message, message
  assert "resume with --config.checkpoint.rollouts=off" in message
  cfg, _ = config_lib.parse_args([*TINY, "--config.rl.mode=async", "--config.warmstart.steps=0",
                                  "--config.rl.total_steps=4", "--config.metrics.console=false",
                                  "--config.checkpoint.rollouts=off"])
  summary = loop.Pipeline(cfg, str(tmp_path)).run()
  assert summary["resumes"][-1]["groups_lost"] > 0 and summary["groups_trained"] == 16

"""Two processes on localhost run launch/train.py as one multi-controller JAX job.

Each process gets 4 CPU devices; the colocated sampler/trainer meshes span all 8, so every
train step, decode step and weight sync is a cross-process computation (gloo collectives).
"""
import json
import os
import socket
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")
TINY = [
    "--config", "configs/default.py", "--config.rl.mode=sync", "--config.rl.total_steps=3",
    "--config.rl.groups_per_step=4", "--config.rl.group_size=2",
    "--config.task.heldout_size=8", "--config.warmstart.steps=0",
    "--config.sampler.max_new_tokens=8", "--config.verifier.latency=none",
    "--config.mesh.colocated=True", "--config.mesh.sampler.data=8",
    "--config.mesh.trainer.data=8", "--config.rl.eval_every=0",
    "--config.metrics.tensorboard=False", "--config.metrics.console=False",
]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(**extra) -> dict:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_", "XLA_", "SLURM_", "OMPI_", "TPU_"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **extra)
  return env


def _launch(flags_by_process, workdir, timeout=240, **extra):
  """Starts one train.py per entry of flags_by_process; returns their CompletedProcess-like
  (returncode, stdout, stderr) tuples."""
  port = _free_port()
  procs = []
  for i, flags in enumerate(flags_by_process):
    env = _env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES=str(len(flags_by_process)), JAX_PROCESS_ID=str(i),
               XLA_FLAGS="--xla_force_host_platform_device_count=4", **extra)
    procs.append(subprocess.Popen(
        [sys.executable, TRAIN, *flags, "--workdir", str(workdir)], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  out = []
  try:
    for p in procs:
      stdout, stderr = p.communicate(timeout=timeout)
      out.append((p.returncode, stdout, stderr))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return out


def _last_line(text: str) -> str:
  lines = [l for l in text.splitlines() if l.strip() and not l.startswith("[Gloo]")]
  return lines[-1] if lines else ""


def test_unreachable_coordinator_fails_fast_with_one_line(tmp_path):
  env = _env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES="2",
             JAX_PROCESS_ID="1", RL_JAX_INIT_TIMEOUT_S="3",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  p = subprocess.run([sys.executable, TRAIN, *TINY, "--workdir", str(tmp_path)], cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=120)
  assert p.returncode != 0
  assert _last_line(p.stderr).startswith("error: jax.distributed.initialize could not reach "
                                         "127.0.0.1:"), p.stderr[-2000:]
  assert "within 3s" in _last_line(p.stderr)


def test_processes_with_different_configs_fail_on_every_process(tmp_path):
  results = _launch([TINY, TINY + ["--config.seed=1"]], tmp_path, timeout=120)
  for i, (rc, _, stderr) in enumerate(results):
    assert rc != 0
    line = _last_line(stderr)
    assert line.startswith("error: processes were started with different configs"), stderr[-2000:]
    assert f"this is process {i}" in line


def test_two_process_async_is_refused_with_one_line(tmp_path):
  flags = [f for f in TINY if f != "--config.rl.mode=sync"] + ["--config.rl.mode=async"]
  for rc, _, stderr in _launch([flags, flags], tmp_path, timeout=120):
    assert rc != 0
    assert _last_line(stderr).startswith("error: rl.mode='async' runs in one process only")


def _digest(path):
  d = json.load(open(path))
  return d["policy_version"], d["optimizer_steps"], np.asarray(d["params"])


def test_two_process_sync_agrees_and_matches_single_process(tmp_path):
  multi = tmp_path / "multi"
  results = _launch([TINY, TINY], multi, RL_JAX_DIGEST=str(tmp_path / "multi_digest"))
  for rc, _, stderr in results:
    assert rc == 0, stderr[-3000:]
  v0, s0, p0 = _digest(tmp_path / "multi_digest.0")
  v1, s1, p1 = _digest(tmp_path / "multi_digest.1")
  assert (v0, s0) == (v1, s1) == (3, 3)
  np.testing.assert_array_equal(p0, p1)
  # Only process 0 writes the run's files.
  summary = json.load(open(multi / "summary.json"))
  assert summary["optimizer_steps"] == 3 and summary["policy_version"] == 3

  single = tmp_path / "single"
  p = subprocess.run(
      [sys.executable, TRAIN, *TINY, "--workdir", str(single)], cwd=ROOT, timeout=240,
      env=_env(RL_JAX_DIGEST=str(tmp_path / "single_digest")), capture_output=True, text=True)
  assert p.returncode == 0, p.stderr[-3000:]
  v, s, params = _digest(tmp_path / "single_digest.0")
  assert (v, s) == (3, 3)
  np.testing.assert_allclose(params, p0, rtol=1e-5, atol=1e-5)
  ref = json.load(open(single / "summary.json"))
  for key in ("rollouts_generated", "rollouts_trained", "completion_lengths",
              "heldout_reward_final"):
    assert ref[key] == summary[key], key

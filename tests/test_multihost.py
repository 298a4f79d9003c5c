"""Two processes on localhost run launch/train.py as one multi-controller JAX job.

Each process gets 4 CPU devices; the sampler and trainer meshes (colocated on all 8, or
split 4 + 4) span both processes, so every train step and decode step is a cross-process
computation (gloo collectives), launched in the order process 0 logs.
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
    # Sizes the default's CPU tuning may change, pinned small.
    "--config.sampler.max_concurrent_decodes=64", "--config.verifier.workers=8",
    "--config.rl.filter_groups=none", "--config.rl.queue_maxsize=64",
]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# The session's persistent compilation cache (tests/conftest.py) is kept: compiling is
# most of a tiny run, and later runs (and process 1, once process 0 wrote an entry) load
# the programs earlier runs compiled.
_CACHE = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


def _env(**extra) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k in _CACHE or not k.startswith(("JAX_", "XLA_", "SLURM_", "OMPI_", "TPU_"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **extra)
  return env


def _xla_flags(devices: int) -> str:
  """This session's XLA_FLAGS (tests/conftest.py: the fast-compile ones) with `devices`
  host devices instead of 8."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  return " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])


def _launch(flags_by_process, workdir, timeout=240, **extra):
  """Starts one train.py per entry of flags_by_process; returns their CompletedProcess-like
  (returncode, stdout, stderr) tuples."""
  port = _free_port()
  procs = []
  for i, flags in enumerate(flags_by_process):
    env = _env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES=str(len(flags_by_process)), JAX_PROCESS_ID=str(i),
               XLA_FLAGS=_xla_flags(4), **extra)
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
             XLA_FLAGS=_xla_flags(4))
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


def _digest(path):
  d = json.load(open(path))
  return d["policy_version"], d["optimizer_steps"], np.asarray(d["params"])


def _with(flags, **overrides):
  keys = tuple(f"--config.{k}=" for k in overrides)
  return [f for f in flags if not f.startswith(keys)] + [
      f"--config.{k}={v}" for k, v in overrides.items()]


# The default layout: sampler and trainer on disjoint halves of the 8 devices, so with two
# processes each sub-mesh spans both and weight sync copies within each process.
SPLIT = dict(**{"mesh.colocated": False, "mesh.sampler.data": 4, "mesh.trainer.data": 4})


def _run_single(flags, tmp_path, name):
  # The session's compile flags, as the two processes have them: the reference compiles
  # as cheaply and with the same XLA options as the run it is compared with.
  p = subprocess.run(
      [sys.executable, TRAIN, *flags, "--workdir", str(tmp_path / name)], cwd=ROOT,
      timeout=300, env=_env(RL_JAX_DIGEST=str(tmp_path / f"{name}_digest"),
                            XLA_FLAGS=_xla_flags(8)),
      capture_output=True, text=True)
  assert p.returncode == 0, p.stderr[-3000:]
  return _digest(tmp_path / f"{name}_digest.0"), json.load(open(tmp_path / name / "summary.json"))


def _run_two(flags, tmp_path, name):
  results = _launch([flags, flags], tmp_path / name,
                    RL_JAX_DIGEST=str(tmp_path / f"{name}_digest"))
  for rc, _, stderr in results:
    assert rc == 0, stderr[-3000:]
  d0, d1 = _digest(tmp_path / f"{name}_digest.0"), _digest(tmp_path / f"{name}_digest.1")
  # Both processes hold the same versions and bitwise the same params.
  assert d0[:2] == d1[:2]
  np.testing.assert_array_equal(d0[2], d1[2])
  # Only process 0 writes the run's files.
  summary = json.load(open(tmp_path / name / "summary.json"))
  return d0, summary


def test_two_process_sync_split_meshes_match_single_process(tmp_path):
  """Also with zero-variance filtering: process 1 drops the groups process 0 filtered."""
  flags = _with(TINY, **SPLIT, **{"rl.filter_groups": "zero_variance",
                                  "rl.max_oversample": 2})
  (v, s, p_multi), summary = _run_two(flags, tmp_path, "multi")
  assert (v, s) == (3, 3)
  assert summary["optimizer_steps"] == 3 and summary["policy_version"] == 3
  (v1, s1, p_single), ref = _run_single(flags, tmp_path, "single")
  assert (v1, s1) == (3, 3)
  np.testing.assert_allclose(p_single, p_multi, rtol=1e-5, atol=1e-5)
  for key in ("rollouts_generated", "rollouts_trained", "completion_lengths",
              "heldout_reward_final", "staleness_histogram", "groups_filtered_zero_variance",
              "groups_uniform_capped"):
    assert ref[key] == summary[key], key
  assert summary["groups_filtered_zero_variance"] > 0


def test_two_process_async_agrees_and_matches_single_process(tmp_path):
  """Async across processes: process 0 schedules, process 1 replays; in-flight weight
  updates and bounded staleness as in one process. Which groups form each batch depends
  on timing, so the single-process run matches within tolerance, not bitwise."""
  flags = _with(TINY, **{"rl.mode": "async", "rl.total_steps": 6, "rl.max_staleness": 2,
                         "rl.inflight_weight_updates": True, "checkpoint.every": 3})
  (v, s, p_multi), summary = _run_two(flags, tmp_path, "multi")
  assert (v, s) == (6, 6)
  # checkpoints are saved by both processes together, at the steps process 0 logged
  assert sorted(os.listdir(tmp_path / "multi" / "checkpoints")) == ["0", "3", "6"]
  hist = {int(k): n for k, n in summary["staleness_histogram"].items()}
  assert max(hist) <= 2 and sum(hist.values()) == 6 * 4
  assert summary["rollouts_trained"] == 6 * 4 * 2
  (v1, s1, p_single), ref = _run_single(flags, tmp_path, "single")
  assert (v1, s1) == (6, 6) and ref["rollouts_trained"] == summary["rollouts_trained"]
  np.testing.assert_allclose(p_multi, p_single, rtol=2e-2, atol=1e-2)
  assert abs(ref["heldout_reward_final"] - summary["heldout_reward_final"]) <= 0.25


def test_leader_failure_stops_every_process_with_one_line(tmp_path):
  """Every verifier call fails on process 0: it gives up after rl.verifier_patience_s and
  process 1, which replays its log, stops with it instead of hanging."""
  flags = _with(TINY, **SPLIT, **{"rl.mode": "async", "verifier.failure_prob": 1.0,
                                  "verifier.retries": 0, "rl.verifier_patience_s": 3})
  (rc0, _, err0), (rc1, _, err1) = _launch([flags, flags], tmp_path, timeout=200)
  assert rc0 != 0 and rc1 != 0
  assert _last_line(err0).startswith("error: the verifier returned no ok result in 3s"), err0[-2000:]
  assert _last_line(err1).startswith("error: process 0 stopped the run: "), err1[-2000:]


def test_split_layout_without_local_shards_is_refused_on_every_process(tmp_path):
  """Sampler tensor=2 over both processes, trainer tensor=4: a sampler half spans two
  trainer quarters, so no process can copy it locally; every process says so at start."""
  flags = _with(TINY, **{"mesh.colocated": False, "mesh.sampler.data": 2,
                         "mesh.sampler.tensor": 2, "mesh.trainer.data": 1,
                         "mesh.trainer.tensor": 4})
  for rc, _, stderr in _launch([flags, flags], tmp_path, timeout=120):
    assert rc != 0
    line = _last_line(stderr)
    assert line.startswith("error: weight sync: no trainer device of process 0 holds the "
                           "shard [0:64, 0:128] of parameter ['embed']"), stderr[-2000:]
    assert "mesh.sampler.tensor equal to mesh.trainer.tensor" in line

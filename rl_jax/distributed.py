"""Multi-process start-up: `jax.distributed.initialize()` from the environment.

A run is multi-process when one of the standard launchers' variables is present:
JAX_COORDINATOR_ADDRESS (plain, with JAX_NUM_PROCESSES / JAX_PROCESS_ID), SLURM
(SLURM_NTASKS > 1), Open MPI (OMPI_COMM_WORLD_SIZE > 1), or a Cloud TPU pod slice
(TPU_WORKER_HOSTNAMES with more than one host). Otherwise initialisation is a no-op,
so the same command runs on a laptop and on every host of a pod.

Start-up failures are one line each, on every process: a coordinator that does not
answer within RL_JAX_INIT_TIMEOUT_S seconds (default 300), and processes started with
different configs (`check_same_config` compares a hash of each process's config JSON).
"""
from __future__ import annotations

import hashlib
import os
import socket
import time

from rl_jax.errors import UserError

_initialized = False
DEFAULT_INIT_TIMEOUT_S = 300


class DistributedError(UserError, RuntimeError):
  """Multi-process start-up cannot proceed: one sentence for the user."""


def init_timeout_s(environ=None) -> int:
  env = os.environ if environ is None else environ
  raw = env.get("RL_JAX_INIT_TIMEOUT_S", "")
  if not raw:
    return DEFAULT_INIT_TIMEOUT_S
  try:
    value = int(raw)
  except ValueError:
    value = 0
  if value <= 0:
    raise DistributedError(f"RL_JAX_INIT_TIMEOUT_S must be a positive number of seconds, got {raw!r}")
  return value


def multi_process_env(environ=None) -> bool:
  env = os.environ if environ is None else environ
  if env.get("JAX_COORDINATOR_ADDRESS"):
    return True
  for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    try:
      if int(env.get(key, "1")) > 1:
        return True
    except ValueError:
      pass
  hosts = env.get("TPU_WORKER_HOSTNAMES", "")
  return len([h for h in hosts.split(",") if h.strip()]) > 1


def initialize(environ=None, timeout_s: int | None = None) -> bool:
  """Initialises jax.distributed when the environment asks for it. Returns whether it did.

  Must run before anything touches a JAX backend. `timeout_s` defaults to
  RL_JAX_INIT_TIMEOUT_S; past it, a missing coordinator or peer is a DistributedError.
  """
  global _initialized
  env = os.environ if environ is None else environ
  if _initialized or not multi_process_env(env):
    return False
  timeout_s = init_timeout_s(env) if timeout_s is None else int(timeout_s)
  address = env.get("JAX_COORDINATOR_ADDRESS", "")
  if address and env.get("JAX_PROCESS_ID", "0") != "0":
    _wait_for_coordinator(address, timeout_s)
  import jax
  # CPU computations that span processes need a collectives backend, which XLA's CPU
  # client lacks by default; the setting does not affect GPU or TPU devices.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")

  kwargs = {}
  if env.get("JAX_COORDINATOR_ADDRESS"):
    kwargs["coordinator_address"] = env["JAX_COORDINATOR_ADDRESS"]
    if env.get("JAX_NUM_PROCESSES"):
      kwargs["num_processes"] = int(env["JAX_NUM_PROCESSES"])
    if env.get("JAX_PROCESS_ID"):
      kwargs["process_id"] = int(env["JAX_PROCESS_ID"])
  try:
    jax.distributed.initialize(initialization_timeout=timeout_s, **kwargs)
  except Exception as e:  # the coordinator is unreachable or the env is inconsistent
    first = (str(e).strip().splitlines() or [""])[0][:200]
    where = env.get("JAX_COORDINATOR_ADDRESS") or "the launcher's coordinator"
    raise DistributedError(
        f"jax.distributed.initialize could not reach {where} within {timeout_s}s "
        f"(RL_JAX_INIT_TIMEOUT_S) or the environment is inconsistent: "
        f"{type(e).__name__}: {first}") from None
  _initialized = True
  return True


def _wait_for_coordinator(address: str, timeout_s: int) -> None:
  """Polls the coordinator's TCP port. jax's own connection timeout aborts the process
  from C++ with a stack dump, so a missing coordinator is detected here first."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
        return
    except (OSError, ValueError):
      if time.monotonic() >= deadline:
        raise DistributedError(
            f"jax.distributed.initialize could not reach {address} within {timeout_s}s "
            f"(RL_JAX_INIT_TIMEOUT_S): is process 0 running and JAX_COORDINATOR_ADDRESS "
            f"its reachable host:port?") from None
      time.sleep(0.25)


def config_digest(config_json: str) -> str:
  return hashlib.sha256(config_json.encode()).hexdigest()


def check_same_config(config_json: str) -> None:
  """Raises DistributedError on every process unless all processes hold the same config.

  Every process runs the same program and must issue the same computations, so a run
  whose processes were started with different flags would deadlock or silently diverge.
  """
  import jax
  if jax.process_count() == 1:
    return
  import numpy as np
  from jax.experimental import multihost_utils
  mine = np.frombuffer(bytes.fromhex(config_digest(config_json)), np.uint8)
  every = np.asarray(multihost_utils.process_allgather(mine))
  differ = [i for i in range(every.shape[0]) if not np.array_equal(every[i], every[0])]
  if differ:
    raise DistributedError(
        f"processes were started with different configs (process {differ[0]} differs from "
        f"process 0; this is process {jax.process_index()}): start every process with the "
        f"same --config and flags")


def process_index() -> int:
  import jax
  return jax.process_index()


def process_count() -> int:
  import jax
  return jax.process_count()


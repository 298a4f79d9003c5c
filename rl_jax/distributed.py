"""Multi-process start-up: `jax.distributed.initialize()` from the environment.

A run is multi-process when one of the standard launchers' variables is present:
JAX_COORDINATOR_ADDRESS (plain, with JAX_NUM_PROCESSES / JAX_PROCESS_ID), SLURM
(SLURM_NTASKS > 1), Open MPI (OMPI_COMM_WORLD_SIZE > 1), or a Cloud TPU pod slice
(TPU_WORKER_HOSTNAMES with more than one host). Otherwise initialisation is a no-op,
so the same command runs on a laptop and on every host of a pod.
"""
from __future__ import annotations

import os

_initialized = False


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


def initialize(environ=None, timeout_s: int = 300) -> bool:
  """Initialises jax.distributed when the environment asks for it. Returns whether it did."""
  global _initialized
  env = os.environ if environ is None else environ
  if _initialized or not multi_process_env(env):
    return False
  import jax

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
    raise RuntimeError(
        f"jax.distributed.initialize failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
        f"check JAX_COORDINATOR_ADDRESS / SLURM / TPU environment") from None
  _initialized = True
  return True


def process_index() -> int:
  import jax
  return jax.process_index()


def process_count() -> int:
  import jax
  return jax.process_count()


def is_main_process() -> bool:
  return process_index() == 0

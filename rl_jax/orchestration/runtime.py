"""Process start-up shared by launch scripts: device setup before JAX initialises."""
from __future__ import annotations

import math
import os


def prepare_host_devices(cfg) -> None:
  """Gives a CPU-only process as many host devices as the config's mesh needs.

  XLA's host platform exposes one device unless told otherwise; the flag only affects
  the CPU platform, so it is harmless on GPU/TPU hosts. It must be set before JAX
  creates its backends (importing jax is fine, calling jax.devices() is not).
  """
  from rl_jax import sharding  # importing jax creates no backend
  need = sharding.mesh_devices(cfg.mesh)[2]
  try:
    processes = max(int(os.environ.get("JAX_NUM_PROCESSES", "1")), 1)
  except ValueError:
    processes = 1
  # Each process contributes its own host devices to the global mesh.
  need = math.ceil(need / processes)
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={need}".strip()

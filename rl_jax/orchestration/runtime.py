"""Process start-up: device setup before JAX initialises, and a note on sizes that
make no sense for the backend."""
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


def cpu_size_note(cfg, model_cfg, backend: str) -> str | None:
  """One line when a config sized for an accelerator runs on a CPU backend (None
  otherwise): a KV pool far beyond what every decode slot at full length can use (the
  pool is zero-filled host memory) and bfloat16 compute, which a CPU emulates."""
  import jax.numpy as jnp
  from rl_jax.sampler import page_table as pt
  from rl_jax.sampler.engine import resolve_dtype
  if backend != "cpu":
    return None
  s = cfg.sampler
  dtype = resolve_dtype(s.dtype, backend)
  page = pt.page_bytes(num_layers=model_cfg.num_layers, num_kv_heads=model_cfg.num_kv_heads,
                       head_dim=model_cfg.head_dim, page_size=s.page_size,
                       dtype_bytes=jnp.dtype(dtype).itemsize)
  pool = (int(s.num_pages) or int(s.kv_cache_bytes) // page) * page
  length = s.max_prefill_length + s.max_new_tokens
  need = (s.max_concurrent_decodes * pt.pages_for(length, s.page_size) + 1) * page
  notes = []
  if pool > max(2 * need, 2 ** 28):
    notes.append(f"a KV pool of {pool / 2 ** 20:,.0f} MiB (sampler.kv_cache_bytes) where "
                 f"{s.max_concurrent_decodes} slots of {length} tokens use at most "
                 f"{need / 2 ** 20:,.1f} MiB")
  bf16 = [f"{k}.dtype" for k, v in (("model", cfg.model.dtype), ("sampler", dtype))
          if v == "bfloat16"]
  if bf16:
    notes.append(f"bfloat16 compute ({', '.join(bf16)}), which a CPU emulates (float32 "
                 "is faster)")
  if not notes:
    return None
  return f"note: this config is sized for an accelerator and runs on CPU: {'; '.join(notes)}"

"""A short async GRPO run through orchestration.loop, on one colocated device.

The config starts from an experiment file (configs/default.py by default) and changes
only what the preset and a single device need: the model shape and dtypes, a
colocated 1 x 1 mesh, a KV pool that holds every slot at full length (no preemption),
one trainer length bucket (one compilation), no warm-up or intermediate evaluation, no
TensorBoard or console output,
and the suite's e2e sizes. Random weights rarely emit EOS, so with a real preset every
completion runs to max_new_tokens: a fixed, worst-case decode load.

Needs grain (prompt pipeline) and ml_collections (configs); `missing_modules` lets
the suite skip the section with a note where they are not installed.
"""
from __future__ import annotations

import importlib.util
import json
import os

NEEDS = ("grain", "ml_collections")


def missing_modules() -> list[str]:
  missing = []
  for name in NEEDS:
    try:
      found = importlib.util.find_spec(name) is not None
    except ImportError:  # an import hook that refuses the module
      found = False
    if not found:
      missing.append(name)
  return missing


def _round_up(n: int, m: int) -> int:
  return -(-int(n) // m) * m


def make_config(config_path: str, *, preset: str, dtype: str, sizes):
  from rl_jax import config as config_lib
  from rl_jax import model
  from rl_jax.sampler import page_table as pt
  from rl_jax.bench.measure import kv_bytes_per_token

  cfg = config_lib.load_file(config_path)
  cfg.model.preset = preset
  cfg.model.path = ""
  cfg.model.dtype = dtype
  cfg.model.param_dtype = "float32"
  cfg.sampler.dtype = dtype
  cfg.mesh.colocated = True
  cfg.mesh.sampler.data = cfg.mesh.sampler.tensor = 1
  cfg.mesh.trainer.data = cfg.mesh.trainer.fsdp = cfg.mesh.trainer.tensor = 1
  s = cfg.sampler
  s.max_concurrent_decodes = sizes.e2e_slots
  s.max_new_tokens = sizes.e2e_max_new_tokens
  s.steps_per_call = sizes.e2e_steps_per_call
  s.num_pages = 0
  pages = pt.pages_for(s.max_prefill_length + s.max_new_tokens, s.page_size)
  s.kv_cache_bytes = (sizes.e2e_slots * pages + 1) * s.page_size * kv_bytes_per_token(
      model.get_preset(preset), dtype)
  # Random weights run every completion to max_new_tokens, so one bucket just above
  # prompt + completion wastes little padding (a power of two could waste half).
  cfg.trainer.length_buckets = (_round_up(cfg.data.max_prompt_length + s.max_new_tokens, 64),)
  cfg.trainer.micro_batch_size = sizes.e2e_micro_batch
  cfg.warmstart.steps = 0
  cfg.rl.mode = "async"
  cfg.rl.total_steps = sizes.e2e_steps
  cfg.rl.groups_per_step = sizes.e2e_groups_per_step
  cfg.rl.group_size = sizes.e2e_group_size
  cfg.rl.eval_every = 0
  # Compiling a new slot bucket mid-run can stall verification for tens of seconds.
  cfg.rl.verifier_patience_s = 600.0
  cfg.task.heldout_size = sizes.e2e_heldout
  cfg.metrics.tensorboard = False
  cfg.metrics.console = False
  return cfg


def run(config_path: str, workdir: str, *, preset: str, dtype: str, sizes) -> dict:
  """loop.run on the adapted config; figures read back from <workdir>/summary.json."""
  from rl_jax.orchestration import loop

  cfg = make_config(config_path, preset=preset, dtype=dtype, sizes=sizes)
  loop.run(cfg, workdir)
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  wall = max(summary["wall_time_s"], 1e-9)
  return dict(
      workdir=workdir, mode=summary["mode"], steps=summary["optimizer_steps"],
      wall_time_s=summary["wall_time_s"], steps_per_hour=3600 * summary["optimizer_steps"] / wall,
      sampler_busy_frac=summary["sampler_busy_frac"],
      trainer_busy_frac=summary["trainer_busy_frac"],
      sampler_tokens_per_s=summary["sampler_tokens_per_s"],
      trainer_tokens_per_s=summary["trainer_tokens_per_s"],
      weight_sync_s_mean=summary["weight_sync_s_mean"],
      rollouts_generated=summary["rollouts_generated"],
      rollouts_trained=summary["rollouts_trained"],
      rollouts_discarded_stale=summary["rollouts_discarded_stale"],
      staleness_histogram=summary["staleness_histogram"],
      groups_per_step=cfg.rl.groups_per_step, group_size=cfg.rl.group_size,
      max_new_tokens=cfg.sampler.max_new_tokens, slots=cfg.sampler.max_concurrent_decodes)

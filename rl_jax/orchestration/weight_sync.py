"""Trainer -> sampler weight transfer: the only place params cross between the roles.

  1. cast the fp32 master params to the sampler dtype and lay them out in the sampler's
     shard shapes, still on the trainer mesh (one jitted program);
  2. `jax.device_put` onto the sampler mesh: equal shard shapes make this a
     device-to-device copy (different shard shapes would fall back to a host copy);
  3. the caller publishes the whole tree with its version in one reference swap, so a
     sampler sees all leaves of a version or none.

What moves is what the trainer publishes (`WeightSync.for_policy`): the full params, or
for a LoRA policy (model.lora.rank > 0) its adapters alone (rl_jax.model.lora layout),
which the sampler merges into the base it holds (rl_jax/sampler/lora_merge.py). `bytes`
counts the published tree in the sampler dtype.

Colocated (both roles on the same devices) copies with `may_alias=False`: the train step
donates its params, so the sampler must never hold a buffer that aliases them.

Multi-process split meshes (sub-meshes that span processes, on disjoint devices): jax
on CPU and GPU has no cross-process device_put between disjoint device sets. Step 2 then
follows a plan made once from the two shardings: every sampler device receives its shard
from a trainer device of its own process whose staged shard contains it (a slice when the
staged shard is larger), by a single-device `device_put`, and the shards are assembled
into the global sampler array without moving data. The staging jit in step 1 is where
data crosses processes (collectives among trainer devices, e.g. ICI or NVLink); the copy
itself never leaves a host and never touches host memory (checked with transfer guards on
every call). A layout in which some sampler shard has no such trainer device in its
process is refused when the plan is made, naming the parameter.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from rl_jax import model as model_lib
from rl_jax import sharding as sharding_lib
from rl_jax.model import lora
from rl_jax.sampler.engine import resolve_dtype


@dataclasses.dataclass
class SyncStats:
  duration_s: float
  bytes: int
  version: int


class LayoutError(ValueError):
  """Sampler and trainer layouts that a process-local copy cannot connect: one sentence."""


def _contains(outer, inner) -> bool:
  return all(o.start <= i.start and i.stop <= o.stop for o, i in zip(outer, inner))


def _norm(index, shape) -> tuple:
  """A shard index with every slice made explicit: slice(start, stop)."""
  return tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(index, shape))


@functools.lru_cache(maxsize=None)
def _slicer(bounds: tuple):
  """A jitted static slice (eager lax.slice would move its indices from the host)."""
  return jax.jit(lambda x: jax.lax.slice(x, [b[0] for b in bounds], [b[1] for b in bounds]))


def local_copy_plan(shapes, staged_shardings, sampler_shardings, names=None) -> list:
  """For every leaf, [(sampler device, trainer device, slice within that trainer device's
  shard or None)] over the sampler devices of this process. Every process's part is
  checked, so all processes raise the same LayoutError (naming the first parameter whose
  shard no trainer device of the sampler device's process holds) or none does."""
  plan = []
  leaves = jax.tree.leaves(shapes)
  staged = jax.tree.leaves(staged_shardings)
  target = jax.tree.leaves(sampler_shardings)
  names = names or [f"leaf {i}" for i in range(len(leaves))]
  me = jax.process_index()
  for name, shape, st, sa in zip(names, leaves, staged, target):
    dims = shape.shape
    have = {d: _norm(i, dims) for d, i in st.devices_indices_map(dims).items()}
    uses: dict = {d: 0 for d in have}
    moves = []
    for d_s, idx in sorted(sa.devices_indices_map(dims).items(), key=lambda kv: kv[0].id):
      want = _norm(idx, dims)
      holders = [d for d, h in have.items()
                 if d.process_index == d_s.process_index and _contains(h, want)]
      if not holders:
        raise LayoutError(
            f"weight sync: no trainer device of process {d_s.process_index} holds the "
            f"shard [{', '.join(f'{w.start}:{w.stop}' for w in want)}] of parameter {name} "
            f"that sampler device {d_s.id} needs; use "
            f"mesh.sampler.tensor equal to mesh.trainer.tensor, or mesh.colocated=True")
      # Exact matches first, then the least used holder (spreads the copies).
      d_t = min(holders, key=lambda d: (have[d] != want, uses[d], d.id))
      uses[d_t] += 1
      if d_s.process_index != me:
        continue
      rel = None
      if have[d_t] != want:
        rel = tuple(slice(w.start - h.start, w.stop - h.start)
                    for w, h in zip(want, have[d_t]))
      moves.append((d_s, d_t, rel))
    plan.append(moves)
  return plan


class WeightSync:
  """Moves trainer params to the sampler mesh in the sampler's dtype and layout."""

  def __init__(self, *, logical_axes, param_shapes, trainer_shardings, sampler_mesh,
               sampler_dtype: str, colocated: bool,
               sampler_rules=sharding_lib.SAMPLE_RULES, local_copy: bool | None = None):
    dtype = jnp.dtype(resolve_dtype(sampler_dtype))
    cast_shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), param_shapes)
    self.sampler_shardings = sharding_lib.tree_shardings(
        logical_axes, cast_shapes, sampler_mesh, sampler_rules)
    trainer_mesh = jax.tree.leaves(trainer_shardings)[0].mesh
    # The sampler's partition specs, applied on the trainer mesh. They are valid there
    # because both meshes carry the same axis names; shard shapes then match whenever the
    # sampled axes have the same size on both meshes (the usual layout).
    self.staged_shardings = jax.tree.map(
        lambda s: NamedSharding(trainer_mesh, s.spec), self.sampler_shardings)
    self.colocated = colocated
    self.bytes = sum(s.size * dtype.itemsize for s in jax.tree.leaves(cast_shapes))
    # Colocated with a dtype change, the cast itself writes fresh buffers in the sampler's
    # layout (same devices), so one pass suffices. Without a cast, jit may hand back the
    # input buffers, so an explicit non-aliasing copy follows.
    self._one_pass = colocated and any(
        s.dtype != dtype for s in jax.tree.leaves(param_shapes))
    self._stage = jax.jit(
        lambda p: jax.tree.map(lambda x: x.astype(dtype), p),
        in_shardings=(trainer_shardings,),
        out_shardings=self.sampler_shardings if self._one_pass else self.staged_shardings,
    )
    if local_copy is None:
      local_copy = not colocated and jax.process_count() > 1
    self._plan = None
    if local_copy and not colocated:
      names = [jax.tree_util.keystr(p) for p, _ in
               jax.tree_util.tree_leaves_with_path(cast_shapes)]
      self._plan = local_copy_plan(cast_shapes, self.staged_shardings,
                                   self.sampler_shardings, names)
    self._treedef = jax.tree.structure(cast_shapes)
    self._shapes = [s.shape for s in jax.tree.leaves(cast_shapes)]

  @classmethod
  def for_policy(cls, model_cfg, policy_shapes, **kwargs) -> WeightSync:
    """The WeightSync of the trainer's published tree `policy_shapes` (arrays or
    ShapeDtypeStructs): the full params' logical axes, or with LoRA the adapters' (the
    tree must then be the adapter tree, lora.adapter_shapes). kwargs as __init__."""
    if not lora.enabled(model_cfg):
      return cls(logical_axes=model_lib.param_logical_axes(model_cfg),
                 param_shapes=policy_shapes, **kwargs)
    want = lora.adapter_shapes(model_cfg)
    got = jax.tree.map(lambda x: tuple(x.shape), policy_shapes)
    if got != jax.tree.map(lambda x: tuple(x.shape), want):
      raise ValueError(f"weight sync: with model.lora.rank={model_cfg.lora_rank} the trainer "
                       f"publishes the LoRA adapters of {list(model_cfg.lora_targets)} "
                       f"(lora.adapter_shapes), got a tree with keys {sorted(policy_shapes)}")
    return cls(logical_axes=lora.logical_axes(model_cfg), param_shapes=policy_shapes, **kwargs)

  def start(self, params, version: int) -> tuple[Any, Callable[[], SyncStats]]:
    """Launches the copy without waiting: (sampler_params, a function that blocks until
    it has landed and returns the SyncStats)."""
    t0 = time.perf_counter()
    staged = self._stage(params)
    if self._one_pass:
      moved = staged
    elif self._plan is None:
      moved = jax.device_put(staged, self.sampler_shardings, may_alias=False)
    else:
      moved = self._local_copy(staged)

    def finish() -> SyncStats:
      jax.block_until_ready(moved)
      return SyncStats(time.perf_counter() - t0, self.bytes, int(version))
    return moved, finish

  def transfer(self, params, version: int):
    """Returns (sampler_params, SyncStats). Blocks until the copy has landed."""
    moved, finish = self.start(params, version)
    return moved, finish()

  def _local_copy(self, staged):
    out = []
    with jax.transfer_guard_device_to_host("disallow"), \
         jax.transfer_guard_host_to_device("disallow"):
      for x, moves, shape, target in zip(jax.tree.leaves(staged), self._plan, self._shapes,
                                         jax.tree.leaves(self.sampler_shardings)):
        shards = {s.device: s.data for s in x.addressable_shards}
        pieces = []
        for d_s, d_t, rel in moves:
          piece = shards[d_t]
          if rel is not None:
            piece = _slicer(tuple((r.start, r.stop) for r in rel))(piece)
          pieces.append(jax.device_put(piece, d_s, may_alias=False))
        out.append(jax.make_array_from_single_device_arrays(shape, target, pieces))
    return jax.tree.unflatten(self._treedef, out)

"""Trainer -> sampler weight transfer: the only place params cross between the roles.

  1. cast the fp32 master params to the sampler dtype and lay them out in the sampler's
     shard shapes, still on the trainer mesh (one jitted program);
  2. `jax.device_put` onto the sampler mesh: equal shard shapes make this a
     device-to-device copy (different shard shapes would fall back to a host copy);
  3. the caller publishes the whole tree with its version in one reference swap, so a
     sampler sees all leaves of a version or none.

Colocated (both roles on the same devices) copies with `may_alias=False`: the train step
donates its params, so the sampler must never hold a buffer that aliases them.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from rl_jax import sharding as sharding_lib


@dataclasses.dataclass
class SyncStats:
  duration_s: float
  bytes: int
  version: int


class WeightSync:
  """Moves trainer params to the sampler mesh in the sampler's dtype and layout."""

  def __init__(self, *, logical_axes, param_shapes, trainer_shardings, sampler_mesh,
               sampler_dtype: str, colocated: bool,
               sampler_rules=sharding_lib.SAMPLE_RULES):
    dtype = jnp.dtype(sampler_dtype)
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

  def transfer(self, params, version: int):
    """Returns (sampler_params, SyncStats). Blocks until the copy has landed."""
    t0 = time.perf_counter()
    staged = self._stage(params)
    moved = staged if self._one_pass else jax.device_put(
        staged, self.sampler_shardings, may_alias=False)
    jax.block_until_ready(moved)
    return moved, SyncStats(time.perf_counter() - t0, self.bytes, int(version))

"""Meshes, the sampler/trainer split, logical-axis rules, and cross-mesh transfer."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rl_jax import distributed, sharding


def mesh_cfg(sampler, trainer, colocated=False):
  return ml_collections.ConfigDict(dict(colocated=colocated, sampler=sampler, trainer=trainer))


def test_split_is_disjoint_with_requested_shapes():
  m = sharding.make_meshes(mesh_cfg(dict(data=2, tensor=1), dict(data=1, fsdp=3, tensor=2)))
  assert dict(m.sampler.shape) == {"data": 2, "fsdp": 1, "tensor": 1}
  assert dict(m.trainer.shape) == {"data": 1, "fsdp": 3, "tensor": 2}
  s_ids = {d.id for d in m.sampler.devices.flat}
  t_ids = {d.id for d in m.trainer.devices.flat}
  assert not s_ids & t_ids
  assert len(s_ids) == 2 and len(t_ids) == 6
  assert m.trainer_dp == 3 and m.sampler_dp == 2 and not m.colocated


def test_colocated_shares_devices():
  m = sharding.make_meshes(mesh_cfg(dict(data=1, tensor=1), dict(data=1, fsdp=1, tensor=1), True))
  assert list(m.sampler.devices.flat) == list(m.trainer.devices.flat)
  with pytest.raises(sharding.MeshError, match="same devices"):
    sharding.make_meshes(mesh_cfg(dict(data=2, tensor=1), dict(data=1, fsdp=1, tensor=1), True))


def test_too_many_devices_is_clear():
  with pytest.raises(sharding.MeshError, match="asks for 10 devices .* only 8 exist"):
    sharding.make_meshes(mesh_cfg(dict(data=2, tensor=2), dict(data=1, fsdp=3, tensor=2)))


def test_rules_to_partition_specs():
  mesh = sharding.make_mesh((2, 2, 2), jax.devices())
  spec = lambda axes, shape: sharding.logical_to_spec(axes, sharding.TRAIN_RULES, mesh, shape)
  assert spec(("embed", "heads", "head_dim"), (64, 4, 16)) == P("fsdp", "tensor", None)
  assert spec(("layers", "embed", "mlp"), (2, 64, 256)) == P(None, "fsdp", "tensor")
  assert spec(("batch", "length"), (8, 32)) == P(("data", "fsdp"), None)
  # a dimension that does not divide is replicated rather than failing
  assert spec(("embed", "kv_heads", "head_dim"), (64, 1, 16)) == P("fsdp", None, None)
  sspec = lambda axes, shape: sharding.logical_to_spec(axes, sharding.SAMPLE_RULES, mesh, shape)
  # sampling never shards "embed" (no FSDP gather per decode token)
  assert sspec(("embed", "heads", "head_dim"), (64, 4, 16)) == P(None, "tensor", None)
  assert sspec(("vocab", "embed"), (128, 64)) == P("tensor", None)
  # without a mesh the raw rules apply, but a mesh axis is never used twice
  assert sharding.logical_to_spec(("batch", "embed"), sharding.TRAIN_RULES) == P(("data", "fsdp"), None)
  assert sharding.logical_to_spec(("embed", "mlp"), sharding.TRAIN_RULES) == P("fsdp", "tensor")


def test_tree_shardings_and_cross_mesh_move_without_host_round_trip():
  m = sharding.make_meshes(mesh_cfg(dict(data=2, tensor=2), dict(data=1, fsdp=2, tensor=2)))
  logical = {"w": ("embed", "mlp"), "b": ("mlp",), "e": ("vocab", "embed")}
  shapes = {"w": jax.ShapeDtypeStruct((16, 32), jnp.float32),
            "b": jax.ShapeDtypeStruct((32,), jnp.float32),
            "e": jax.ShapeDtypeStruct((64, 16), jnp.float32)}
  t_sh = sharding.tree_shardings(logical, shapes, m.trainer, sharding.TRAIN_RULES)
  s_sh = sharding.tree_shardings(logical, shapes, m.sampler, sharding.SAMPLE_RULES)
  assert t_sh["w"].spec == P("fsdp", "tensor") and s_sh["w"].spec == P(None, "tensor")
  rng = np.random.default_rng(0)
  host = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in shapes.items()}
  tree = jax.device_put(host, t_sh)
  # Lay out in the sampler's shard shapes on the trainer mesh first, then move.
  same_shape = jax.tree.map(lambda s: NamedSharding(m.trainer, s.spec), s_sh)
  with jax.transfer_guard_device_to_host("disallow_explicit"), \
       jax.transfer_guard_host_to_device("disallow_explicit"):
    staged = jax.jit(lambda x: x, out_shardings=same_shape)(tree)
    moved = jax.device_put(staged, s_sh)
    jax.block_until_ready(moved)
  for k in host:
    assert moved[k].sharding == s_sh[k]
    assert {d.id for d in moved[k].devices()} <= {d.id for d in m.sampler.devices.flat}
    np.testing.assert_array_equal(np.asarray(moved[k]), host[k])


def test_distributed_env_detection():
  assert not distributed.multi_process_env({})
  assert not distributed.multi_process_env({"SLURM_NTASKS": "1"})
  assert distributed.multi_process_env({"SLURM_NTASKS": "4"})
  assert distributed.multi_process_env({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
  assert distributed.multi_process_env({"TPU_WORKER_HOSTNAMES": "a,b"})
  assert not distributed.multi_process_env({"TPU_WORKER_HOSTNAMES": "a"})
  assert distributed.initialize({}) is False

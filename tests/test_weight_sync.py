"""Weight sync: sampler dtype and layout, no host round trip, no aliasing when colocated."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rl_jax import model, sharding
from rl_jax.orchestration.weight_sync import WeightSync

CFG = model.get_preset("tiny_char").replace(num_layers=2, hidden_size=64, intermediate_size=128,
                                             num_heads=4, num_kv_heads=2, head_dim=16)


def _setup(mesh_cfg):
  meshes = sharding.make_meshes(ml_collections.ConfigDict(mesh_cfg))
  shapes = jax.eval_shape(lambda: model.init_params(CFG, jax.random.PRNGKey(0)))
  axes = model.param_logical_axes(CFG)
  t_sh = sharding.tree_shardings(axes, shapes, meshes.trainer, sharding.TRAIN_RULES)
  params = jax.jit(lambda: model.init_params(CFG, jax.random.PRNGKey(0)), out_shardings=t_sh)()
  return meshes, shapes, axes, t_sh, params


def test_split_transfer_is_device_to_device_and_cast():
  meshes, shapes, axes, t_sh, params = _setup(dict(
      colocated=False, sampler=dict(data=2, tensor=2), trainer=dict(data=1, fsdp=2, tensor=2)))
  ws = WeightSync(logical_axes=axes, param_shapes=shapes, trainer_shardings=t_sh,
                  sampler_mesh=meshes.sampler, sampler_dtype="bfloat16", colocated=False)
  ws.transfer(params, 0)  # compile outside the guard
  with jax.transfer_guard_device_to_host("disallow_explicit"), \
       jax.transfer_guard_host_to_device("disallow_explicit"):
    out, stats = ws.transfer(params, 1)
  sampler_ids = {d.id for d in meshes.sampler.devices.flat}
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(params)):
    assert a.dtype == jnp.bfloat16, path
    assert {d.id for d in a.devices()} == sampler_ids, path
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))
  # sampler layout: tensor-parallel only, never sharded over the (absent) fsdp axis
  for s in jax.tree.leaves(ws.sampler_shardings):
    assert "fsdp" not in jax.tree.leaves(tuple(s.spec))
  n = sum(x.size for x in jax.tree.leaves(shapes))
  assert stats.bytes == 2 * n and stats.version == 1 and stats.duration_s > 0


@pytest.mark.parametrize("sampler_dtype", ["float32", "bfloat16"])
def test_colocated_copy_does_not_alias_donated_params(sampler_dtype):
  meshes, shapes, axes, t_sh, params = _setup(dict(
      colocated=True, sampler=dict(data=1, tensor=1), trainer=dict(data=1, fsdp=1, tensor=1)))
  ws = WeightSync(logical_axes=axes, param_shapes=shapes, trainer_shardings=t_sh,
                  sampler_mesh=meshes.sampler, sampler_dtype=sampler_dtype, colocated=True)
  out, _ = ws.transfer(params, 1)
  expected = jax.tree.map(lambda x: np.asarray(x.astype(sampler_dtype)), params)
  # A train step donates its params: after deleting them the sampler copy must still be valid.
  donate = jax.jit(lambda p: jax.tree.map(lambda x: x * 0.0, p), donate_argnums=0)
  # The check can fail: an aliasing copy dies with the donated params.
  _, _, _, _, other = _setup(dict(
      colocated=True, sampler=dict(data=1, tensor=1), trainer=dict(data=1, fsdp=1, tensor=1)))
  aliased = jax.device_put(other, t_sh)
  donate(other)
  assert all(a.is_deleted() for a in jax.tree.leaves(aliased))
  donate(params)
  for a, b, s in zip(jax.tree.leaves(out), jax.tree.leaves(expected),
                     jax.tree.leaves(ws.sampler_shardings)):
    assert not a.is_deleted()
    assert a.sharding == s
    np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("sampler,trainer", [
    (dict(data=2, tensor=2), dict(data=1, fsdp=2, tensor=2)),  # equal shards: plain copies
    (dict(data=1, tensor=4), dict(data=2, fsdp=1, tensor=2)),  # trainer halves -> quarters
    (dict(data=4, tensor=1), dict(data=1, fsdp=4, tensor=1)),  # replicated sampler
])
def test_process_local_copy_matches_device_put(sampler, trainer):
  """The multi-process split-mesh path (a plan of single-device copies) gives the same
  arrays, shardings and bytes as the device_put path, without touching the host."""
  meshes, shapes, axes, t_sh, params = _setup(dict(colocated=False, sampler=sampler,
                                                   trainer=trainer))
  kw = dict(logical_axes=axes, param_shapes=shapes, trainer_shardings=t_sh,
            sampler_mesh=meshes.sampler, sampler_dtype="bfloat16", colocated=False)
  plain = WeightSync(**kw, local_copy=False)
  local = WeightSync(**kw, local_copy=True)
  assert local._plan is not None and plain._plan is None  # pylint: disable=protected-access
  sliced = any(rel is not None for moves in local._plan for _, _, rel in moves)  # pylint: disable=protected-access
  assert sliced == (sampler["tensor"] > trainer["tensor"])
  expected, _ = plain.transfer(params, 1)
  local.transfer(params, 0)  # compile outside the guard
  with jax.transfer_guard_device_to_host("disallow_explicit"), \
       jax.transfer_guard_host_to_device("disallow_explicit"):
    out, stats = local.transfer(params, 1)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(expected)):
    assert a.sharding == b.sharding, path
    assert a.dtype == jnp.bfloat16, path
    for sa, sb in zip(sorted(a.addressable_shards, key=lambda s: s.device.id),
                      sorted(b.addressable_shards, key=lambda s: s.device.id)):
      assert sa.index == sb.index
      np.testing.assert_array_equal(np.asarray(sa.data), np.asarray(sb.data))
  # every copy lands on the sampler device from a trainer device
  for moves in local._plan:  # pylint: disable=protected-access
    for d_s, d_t, _ in moves:
      assert d_s in set(meshes.sampler.devices.flat) and d_t in set(meshes.trainer.devices.flat)
  assert stats.bytes == plain.bytes and stats.version == 1


def _default_model(rank: int):
  from configs import default
  cfg = default.get_config()
  cfg.model.lora.rank = rank
  return model.from_run_config(cfg.model)[0]


def test_lora_publishes_only_the_adapters_device_to_device():
  """With model.lora.rank > 0 a publication moves the adapters alone: bytes = the
  adapter leaves' bytes in the sampler dtype, <= 10% of the full policy's for the
  default model at rank 8 on every projection (issue #27)."""
  from rl_jax.model import lora
  cfg, full_cfg = _default_model(8), _default_model(0)
  assert cfg.lora_targets == lora.TARGETS and full_cfg.lora_rank == 0
  meshes = sharding.make_meshes(ml_collections.ConfigDict(dict(
      colocated=False, sampler=dict(data=2, tensor=2), trainer=dict(data=1, fsdp=2, tensor=2))))
  ad_shapes = lora.adapter_shapes(cfg)
  t_sh = sharding.tree_shardings(lora.logical_axes(cfg), ad_shapes, meshes.trainer,
                                 sharding.TRAIN_RULES)
  adapters = jax.jit(lambda: lora.init_adapters(cfg, jax.random.PRNGKey(0)), out_shardings=t_sh)()
  kw = dict(trainer_shardings=t_sh, sampler_mesh=meshes.sampler, sampler_dtype="bfloat16",
            colocated=False)
  ws = WeightSync.for_policy(cfg, ad_shapes, **kw)
  ws.transfer(adapters, 0)  # compile outside the guard
  with jax.transfer_guard_device_to_host("disallow_explicit"), \
       jax.transfer_guard_host_to_device("disallow_explicit"):
    out, stats = ws.transfer(adapters, 1)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(adapters)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))
  adapter_bytes = sum(2 * x.size for x in jax.tree.leaves(adapters))
  assert stats.bytes == ws.bytes == adapter_bytes
  full_shapes = jax.eval_shape(lambda: model.init_params(full_cfg, jax.random.PRNGKey(0)))
  full_sh = sharding.tree_shardings(model.param_logical_axes(full_cfg), full_shapes,
                                    meshes.trainer, sharding.TRAIN_RULES)
  full = WeightSync.for_policy(full_cfg, full_shapes, **{**kw, "trainer_shardings": full_sh})
  assert full.bytes == sum(2 * x.size for x in jax.tree.leaves(full_shapes))
  assert adapter_bytes <= 0.10 * full.bytes, (adapter_bytes, full.bytes)
  with pytest.raises(ValueError, match="publishes the LoRA adapters"):
    WeightSync.for_policy(cfg, full_shapes, **{**kw, "trainer_shardings": full_sh})

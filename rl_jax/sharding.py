"""Meshes, the sampler/trainer split, and logical-axis rules.

Every mesh in rl_jax has the same three axis names, `MESH_AXES = ("data", "fsdp",
"tensor")`; a sampler mesh simply has fsdp=1. Model code names only logical axes
(`LOGICAL_AXES`), and the rule sets here map them to mesh axes:

  training: FSDP over "embed" plus tensor parallelism over heads / mlp / vocab,
            batch over (data, fsdp);
  sampling: tensor parallelism only, so no parameter is gathered per decode token,
            batch (decode slots) over data.

A logical axis whose dimension does not divide by the mesh axes it maps to is
replicated instead (a tiny model on a wide mesh still runs).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_jax.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis names used by model parameters and activations.
LOGICAL_AXES = (
    "batch", "length", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp",
    "layers", "pages", "page_slot",
)

Rules = tuple[tuple[str, Any], ...]

TRAIN_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", None),
)

SAMPLE_RULES: Rules = (
    ("batch", "data"),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("layers", None),
    ("pages", None),
    ("page_slot", None),
)


class MeshError(UserError, ValueError):
  """A mesh request that the available devices cannot satisfy."""


@dataclasses.dataclass(frozen=True)
class Meshes:
  """The two role meshes. `colocated` means they are the same devices."""
  sampler: Mesh
  trainer: Mesh
  colocated: bool

  @property
  def sampler_dp(self) -> int:
    return self.sampler.shape["data"]

  @property
  def trainer_dp(self) -> int:
    return self.trainer.shape["data"] * self.trainer.shape["fsdp"]


def _shape(sub) -> tuple[int, int, int]:
  get = (lambda k: int(sub.get(k, 1))) if hasattr(sub, "get") else (lambda k: int(getattr(sub, k, 1)))
  return get("data"), get("fsdp"), get("tensor")


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device]) -> Mesh:
  """A ("data", "fsdp", "tensor") mesh over `devices` in the given order."""
  n = math.prod(shape)
  if n != len(devices):
    raise MeshError(f"mesh shape {tuple(shape)} needs {n} devices, got {len(devices)}")
  return Mesh(np.asarray(devices, dtype=object).reshape(tuple(shape)), MESH_AXES)


def mesh_devices(mesh_cfg) -> tuple[int, int, int]:
  """(sampler devices, trainer devices, devices the mesh needs): a role's devices are the
  product of its axis sizes; colocated roles share devices, split roles do not."""
  s = math.prod(_shape(mesh_cfg.sampler))
  t = math.prod(_shape(mesh_cfg.trainer))
  return s, t, (max(s, t) if mesh_cfg.colocated else s + t)


def make_meshes(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Meshes:
  """Split `devices` (default: all) into a sampler and a trainer mesh.

  Split mode: the first prod(sampler shape) devices form the sampler mesh, the
  next prod(trainer shape) the trainer mesh; they are disjoint. Colocated mode:
  both meshes are built over the same devices (each shape must use all of them).
  """
  devices = list(jax.devices() if devices is None else devices)
  s_shape, t_shape = _shape(mesh_cfg.sampler), _shape(mesh_cfg.trainer)
  if s_shape[1] != 1:
    raise MeshError("mesh.sampler.fsdp must be 1: the sampler shards by tensor only")
  need = mesh_devices(mesh_cfg)[2]
  if need > len(devices):
    raise MeshError(
        f"mesh asks for {need} devices (sampler {s_shape}, trainer {t_shape}, "
        f"colocated={bool(mesh_cfg.colocated)}) but only {len(devices)} exist")
  if mesh_cfg.colocated:
    ns, nt = math.prod(s_shape), math.prod(t_shape)
    if ns != nt:
      raise MeshError(
          f"colocated meshes must cover the same devices: sampler uses {ns}, trainer {nt}")
    devs = devices[:ns]
    return Meshes(make_mesh(s_shape, devs), make_mesh(t_shape, devs), True)
  ns = math.prod(s_shape)
  return Meshes(
      make_mesh(s_shape, devices[:ns]),
      make_mesh(t_shape, devices[ns:ns + math.prod(t_shape)]),
      False,
  )


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules,
                    mesh: Mesh | None = None,
                    shape: Sequence[int] | None = None) -> P:
  """PartitionSpec for one array from its logical axis names.

  With `mesh` and `shape`, a dimension that the mapped mesh axes do not divide is
  replicated, and a mesh axis is never used twice.
  """
  table = dict(rules)
  used: set[str] = set()
  out = []
  for i, name in enumerate(logical_axes):
    target = table.get(name) if name is not None else None
    if target is None:
      out.append(None)
      continue
    axes = (target,) if isinstance(target, str) else tuple(target)
    axes = tuple(a for a in axes if a not in used)
    if mesh is not None:
      axes = tuple(a for a in axes if mesh.shape[a] > 1)
      if shape is not None:
        size = math.prod(mesh.shape[a] for a in axes)
        if size == 0 or shape[i] % size:
          axes = ()
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*out)


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def tree_shardings(logical_tree, shapes_tree, mesh: Mesh, rules: Rules):
  """NamedShardings for a pytree given a matching pytree of logical-axis tuples.

  `shapes_tree` holds arrays or jax.ShapeDtypeStruct (e.g. from jax.eval_shape).
  """
  def one(axes, x):
    return NamedSharding(mesh, logical_to_spec(axes, rules, mesh, x.shape))
  return jax.tree.map(one, logical_tree, shapes_tree, is_leaf=_is_axes)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
  """Leading axis over the rules' "batch" axes, the rest replicated."""
  return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))

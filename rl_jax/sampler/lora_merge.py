"""LoRA on the sampler: the frozen base kept once, adapters merged into the decode weights.

A LoRA policy publishes only its adapters (rl_jax.model.lora layout: a[t] (l, *in_t, r),
b[t] (l, r, *out_t) per target t). The engine holds the base once, in the sampler
dtype and its decode layout (Engine.set_base), and turns each published adapter tree
into decode weights with one jitted program on the sampler's devices:

  W[t] = W0[t] + (alpha / r) A[t] B[t]    (lora.merge_params: float32, stored in W0's dtype)

for every target t and layer. Only the target weights are new buffers: the other leaves
(embeddings, norms, untargeted projections) are the base's own, so the decode weights
have exactly the structure, dtypes and shardings Engine.load_params gives full params,
and every compiled decode program is reused as is. Given the previous merge's decode
weights (`reuse`, which the caller will not read again), the program donates their
target buffers and writes the new weights in place: sampler weight memory is the base
plus one set of merged target weights per Generator (the RL sampler's and the held-out
evaluator's), as without LoRA each holds its own decode weights.

Each merge is timed on its own (dispatch to ready, after waiting for `after`) and the
seconds are kept in `Merger.seconds` for the weight_sync/merge_s metric. The Generator
merges when it swaps in a publication, in the sampler thread, after its decode call on
the device has finished: once per publication, the host's preparation of the next call
does not overlap a device call.
"""
from __future__ import annotations

import collections
import functools
import time

import jax
import jax.numpy as jnp

from rl_jax import sharding as shd
from rl_jax.model import lora


def is_adapters(tree) -> bool:
  """Whether `tree` is a LoRA adapter tree ({target: {"a", "b"}}) rather than params."""
  return (isinstance(tree, dict) and bool(tree) and set(tree) <= set(lora.TARGETS) and
          all(isinstance(v, dict) and set(v) == {"a", "b"} for v in tree.values()))


def targets_of(decode_params, targets) -> tuple | dict:
  """The target weights of decode params: per layer (a tuple of {t: W_l}) with unrolled
  layers, else {t: W} stacked over layers."""
  layers = decode_params["layers"]
  if isinstance(layers, (tuple, list)):
    return tuple({t: layer[t] for t in targets} for layer in layers)
  return {t: layers[t] for t in targets}


def with_targets(decode_params, new) -> dict:
  """decode_params with its target weights replaced by `new` (targets_of's layout)."""
  layers = decode_params["layers"]
  if isinstance(layers, (tuple, list)):
    layers = tuple({**layer, **n} for layer, n in zip(layers, new))
  else:
    layers = {**layers, **new}
  return {**decode_params, "layers": layers}


def _merge_layer(cfg, w, ab):
  """One layer: {t: W0} and {t: {"a", "b"}} (no layer axis) -> {t: W0 + (alpha/r) A B}."""
  one = lora.merge_params(cfg, {"layers": jax.tree.map(lambda x: x[None], w)},
                          jax.tree.map(lambda x: x[None], ab))["layers"]
  return jax.tree.map(lambda x: x[0], one)


def merge_targets(cfg, base_t, adapters) -> tuple | dict:
  """W0 + (alpha/r) A B for the target weights `base_t` (targets_of's layout), one layer
  after another: the float32 products of a single layer are live at a time (merging
  every layer at once would hold them all, 2x the target weights' bf16 bytes)."""
  if not isinstance(base_t, tuple):
    return jax.lax.map(lambda wa: _merge_layer(cfg, *wa), (base_t, adapters))
  out = []
  for i, w in enumerate(base_t):
    ab = jax.tree.map(lambda x, i=i: x[i], adapters)
    if out:  # layer i starts once layer i - 1 is written
      w, ab, _ = jax.lax.optimization_barrier((w, ab, out[-1]))
    out.append(_merge_layer(cfg, w, ab))
  return tuple(out)


class Merger:
  """The base in decode layout and the merge programs (with and without reuse)."""

  def __init__(self, cfg, base, param_shardings, *, mesh, rules):
    if not lora.enabled(cfg) or not cfg.lora_targets:
      raise ValueError("a LoRA base needs model.lora.rank > 0 and at least one target")
    self.cfg, self.base = cfg, base
    self.targets = tuple(cfg.lora_targets)
    dtype = jnp.dtype(cfg.dtype)
    self.adapter_shardings = shd.tree_shardings(
        lora.logical_axes(cfg), lora.adapter_shapes(cfg, dtype), mesh, rules)
    target_sh = targets_of(param_shardings, self.targets)
    fn = functools.partial(merge_targets, cfg)
    base_t = targets_of(base, self.targets)
    ads = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                       lora.adapter_shapes(cfg, dtype), self.adapter_shardings)
    # Compiled here, so merge_s times the merge alone. The previous target weights are an
    # unused argument donated to the outputs of the same shapes and shardings
    # (keep_unused: jit would otherwise drop it).
    self._fresh = jax.jit(fn, in_shardings=(target_sh, self.adapter_shardings),
                          out_shardings=target_sh).lower(base_t, ads).compile()
    self._into = jax.jit(lambda b, a, old: fn(b, a), keep_unused=True, donate_argnums=(2,),
                         in_shardings=(target_sh, self.adapter_shardings, target_sh),
                         out_shardings=target_sh).lower(base_t, ads, base_t).compile()
    self.seconds: collections.deque = collections.deque(maxlen=256)

  def merge(self, adapters, *, reuse=None, after=None):
    """Decode weights for `adapters` (any placement; cast to the sampler dtype). `reuse`:
    decode weights from an earlier merge that nobody reads again (donated). `after`:
    arrays to wait for before the merge is timed."""
    dtype = jnp.dtype(self.cfg.dtype)
    adapters = jax.tree.map(lambda x, s: jax.device_put(x.astype(dtype), s), adapters,
                            self.adapter_shardings)
    if after is not None:
      jax.block_until_ready(after)
    base_t = targets_of(self.base, self.targets)
    t0 = time.perf_counter()
    if reuse is None:
      new = self._fresh(base_t, adapters)
    else:
      new = self._into(base_t, adapters, targets_of(reuse, self.targets))
    jax.block_until_ready(new)
    self.seconds.append(time.perf_counter() - t0)
    return with_targets(self.base, new)

"""Low-rank adapters (LoRA) on the decoder layers' projections.

For a target projection with frozen weight W0 (input axes I, output axes O) the layer
computes

  y = x W0 + (alpha / r) * (dropout(x) A) B,    A: (I..., r), B: (r, O...)

so the effective weight is W = W0 + (alpha / r) * A B (`merge_params`). A starts
N(0, 1/r) and B at zero, so an initialised adapter leaves the base model unchanged.
Dropout (model.lora.dropout) applies to the low-rank path's input only, in training.

Adapters are a plain nested dict beside the params, one entry per target, each leaf with
the scanned leading `l` (layers) axis like params["layers"]:

  adapters[t]["a"]  (l, *in_t, r)    adapters[t]["b"]  (l, r, *out_t)

with in/out per target (shape letters as in transformer.py):

  q  (e,) -> (h, d)     k, v  (e,) -> (k, d)     o  (h, d) -> (e,)
  gate, up  (e,) -> (f,)     down  (f,) -> (e,)

Hugging Face / PEFT store lora_A.weight as (r, in) and lora_B.weight as (out, r) per
layer with in/out flattened; rl_jax.model.hf_io converts.

Why not qwix: qwix adds its low-rank path by intercepting the einsum / dot_general
calls of Flax modules, matched by module path. The decode loop runs `layer_forward`
outside any module (per-layer weights, unrolled), and adapter-only weight sync,
checkpoints and the PEFT export all need the adapters as one explicit pytree with known
axes; an explicit path in the one pure layer function gives both with no interception.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rl_jax.model.presets import LORA_TARGETS as TARGETS


def _axes(cfg) -> dict[str, tuple[tuple, tuple, tuple, tuple]]:
  """target -> (in_shape, out_shape, in_logical_axes, out_logical_axes)."""
  e, h, kh, d, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                    cfg.intermediate_size)
  return {
      "q": ((e,), (h, d), ("embed",), ("heads", "head_dim")),
      "k": ((e,), (kh, d), ("embed",), ("kv_heads", "head_dim")),
      "v": ((e,), (kh, d), ("embed",), ("kv_heads", "head_dim")),
      "o": ((h, d), (e,), ("heads", "head_dim"), ("embed",)),
      "gate": ((e,), (f,), ("embed",), ("mlp",)),
      "up": ((e,), (f,), ("embed",), ("mlp",)),
      "down": ((f,), (e,), ("mlp",), ("embed",)),
  }


def enabled(cfg) -> bool:
  return cfg.lora_rank > 0


def scale(cfg) -> float:
  """alpha / r, the factor on the low-rank product."""
  return float(cfg.lora_alpha) / cfg.lora_rank


def adapter_shapes(cfg, dtype=jnp.float32) -> dict:
  """Adapters' ShapeDtypeStructs (nothing allocated)."""
  l, r = cfg.num_layers, cfg.lora_rank
  out = {}
  for t in cfg.lora_targets:
    ins, outs, _, _ = _axes(cfg)[t]
    out[t] = {"a": jax.ShapeDtypeStruct((l, *ins, r), dtype),
              "b": jax.ShapeDtypeStruct((l, r, *outs), dtype)}
  return out


def logical_axes(cfg) -> dict:
  """Adapters-shaped tree of logical axis tuples (rank axis unsharded: None)."""
  out = {}
  for t in cfg.lora_targets:
    _, _, in_ax, out_ax = _axes(cfg)[t]
    out[t] = {"a": ("layers", *in_ax, None), "b": ("layers", None, *out_ax)}
  return out


def init_adapters(cfg, rng: jax.Array) -> dict:
  """A ~ N(0, 1/r) (float32), B = 0: the adapted model equals the base at step 0."""
  shapes = adapter_shapes(cfg)
  keys = jax.random.split(rng, len(shapes))
  std = 1.0 / math.sqrt(cfg.lora_rank)
  return {t: {"a": std * jax.random.normal(k, s["a"].shape, jnp.float32),
              "b": jnp.zeros(s["b"].shape, jnp.float32)}
          for k, (t, s) in zip(keys, sorted(shapes.items()))}


def num_adapter_params(cfg) -> int:
  return sum(math.prod(s.shape) for s in jax.tree.leaves(adapter_shapes(cfg)))


def low_rank(x: jax.Array, a: jax.Array, b: jax.Array, n_in: int, factor: float,
             dtype) -> jax.Array:
  """factor * (x A) B for one layer: x (..., *in), a (*in, r), b (r, *out) -> (..., *out)
  in `dtype` (A and B are cast to it; the matmuls accumulate in float32)."""
  a, b = a.astype(dtype), b.astype(dtype)
  xa = jnp.tensordot(x, a, axes=n_in, preferred_element_type=jnp.float32).astype(dtype)
  y = jnp.tensordot(xa, b, axes=1, preferred_element_type=jnp.float32)
  return (factor * y).astype(dtype)


def delta(cfg, layer_adapters: dict | None, target: str, x: jax.Array,
          dropout_key: jax.Array | None = None) -> jax.Array:
  """The low-rank term of `target` (which must have an adapter) for input x (compute
  dtype). `dropout_key` turns on dropout (rate cfg.lora_dropout) of x."""
  ab = layer_adapters[target]
  if dropout_key is not None and cfg.lora_dropout > 0:
    key = jax.random.fold_in(dropout_key, TARGETS.index(target))
    keep = jax.random.bernoulli(key, 1.0 - cfg.lora_dropout, x.shape)
    x = jnp.where(keep, x / (1.0 - cfg.lora_dropout), 0).astype(x.dtype)
  n_in = len(_axes(cfg)[target][0])
  return low_rank(x, ab["a"], ab["b"], n_in, scale(cfg), x.dtype)


def merge_params(cfg, params: dict, adapters: dict) -> dict:
  """params with every targeted layer weight replaced by W0 + (alpha/r) A B, computed in
  float32 and stored in W0's dtype. Works on stacked params["layers"] (leading l axis)."""
  layers = dict(params["layers"])
  for t, ab in adapters.items():
    w = layers[t]
    a = ab["a"].astype(jnp.float32)
    b = ab["b"].astype(jnp.float32)
    # Batched over l: (l, *in, r) x (l, r, *out) -> (l, *in, *out).
    prod = jax.vmap(lambda ai, bi: jnp.tensordot(ai, bi, axes=1))(a, b)
    layers[t] = (w.astype(jnp.float32) + scale(cfg) * prod).astype(w.dtype)
  return {**params, "layers": layers}

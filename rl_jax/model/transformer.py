"""Decoder-only transformer (Llama 3 / Qwen2 family) in Flax linen, layers scanned.

Shape letters:
  b batch, t query positions, s key positions, e embed (hidden), h query heads,
  k kv heads, g query heads per kv head (h = k * g), d head_dim, f mlp hidden,
  v vocab, l layers.

The math follows Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM so checkpoints load
without permutation: RoPE rotates the two halves of each head (rotate_half), RMSNorm
takes its variance in float32 and applies the weight after casting back, and attention
softmax runs in float32. Parameters live in `param_dtype` and are cast to the compute
`dtype` where they are used; logits are always float32.

Parameters (a plain dict; every layer leaf has a leading `l` axis from nn.scan):

  embed        (v, e)        ("vocab", "embed")
  layers/attn_norm (l, e)    ("layers", "embed")
  layers/q     (l, e, h, d)  ("layers", "embed", "heads", "head_dim")
  layers/k, v  (l, e, k, d)  ("layers", "embed", "kv_heads", "head_dim")
  layers/q_bias (l, h, d), layers/k_bias, v_bias (l, k, d)   only with qkv_bias
  layers/o     (l, h, d, e)  ("layers", "heads", "head_dim", "embed")
  layers/mlp_norm (l, e)
  layers/gate, up (l, e, f)  ("layers", "embed", "mlp")
  layers/down  (l, f, e)     ("layers", "mlp", "embed")
  final_norm   (e,)          ("embed",)
  lm_head      (e, v)        ("embed", "vocab")   only without tie_embeddings

Attention is pluggable (`forward(attn_fn=...)`) so the sampler's paged KV cache runs
the same layer code as training. The default, full-sequence causal attention (training,
prefill) uses the kernel named by `cfg.attention` (rl_jax.model.attention). `cfg.remat`
picks the layer rematerialisation policy (none, full, dots: see presets.ModelConfig).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rl_jax.model import attention
from rl_jax.model import lora
from rl_jax.model.presets import ModelConfig

# attn_fn(q_bthd, k_btkd, v_btkd, layer_cache, attn_ctx) -> (out_bthd, new_layer_cache)
AttnFn = Callable[[jax.Array, jax.Array, jax.Array, Any, Any], tuple[jax.Array, Any]]


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse rotary frequencies, (d/2,) float32, including Llama 3 scaling.

  Computed in float32 like Hugging Face so positions far out rotate identically.
  Llama 3 scaling keeps high frequencies (wavelength < original_ctx / high_freq_factor),
  divides low frequencies (wavelength > original_ctx / low_freq_factor) by `factor`,
  and interpolates linearly in original_ctx / wavelength in between.
  """
  d = cfg.head_dim
  inv = np.float32(1.0) / np.float32(cfg.rope_theta) ** (
      np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
  sc = cfg.rope_scaling
  if sc is None:
    return inv.astype(np.float32)
  factor, low, high = (np.float32(sc[k]) for k in ("factor", "low_freq_factor",
                                                     "high_freq_factor"))
  ctx = np.float32(sc["original_max_position_embeddings"])
  wavelen = np.float32(2 * math.pi) / inv
  divided = np.where(wavelen > ctx / low, inv / factor, inv)
  smooth = (ctx / wavelen - low) / (high - low)
  blended = (1 - smooth) * divided / factor + smooth * divided
  medium = (wavelen >= ctx / high) & (wavelen <= ctx / low)
  return np.where(medium, blended, divided).astype(np.float32)


def rope_tables(positions_bt: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """cos_btd, sin_btd (float32) for rotate_half RoPE: the frequencies repeat twice."""
  angle = positions_bt[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
  angle_btd = jnp.concatenate([angle, angle], axis=-1)
  return jnp.cos(angle_btd), jnp.sin(angle_btd)


def apply_rope(x_bthd: jax.Array, cos_btd: jax.Array, sin_btd: jax.Array) -> jax.Array:
  """x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1] over the halves."""
  x1, x2 = jnp.split(x_bthd, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_bthd * cos_btd[:, :, None, :] + rotated * sin_btd[:, :, None, :]


def rms_norm(x_bte: jax.Array, scale_e: jax.Array, eps: float) -> jax.Array:
  """x / rms(x) * scale; the variance is taken in float32, the weight applied after."""
  x32 = x_bte.astype(jnp.float32)
  normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return scale_e.astype(x_bte.dtype) * normed.astype(x_bte.dtype)


def gqa_attention(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array,
                  mask_bts: jax.Array | None) -> jax.Array:
  """softmax(q k^T / sqrt(d) masked) v with grouped kv heads; out_bthd in v's dtype.

  Query head i uses kv head i // g (Hugging Face's repeat_kv order). Scores and the
  softmax are float32. A fully masked row yields the mean of v rather than NaN.
  """
  b, t, h, d = q_bthd.shape
  kh = k_bskd.shape[2]
  q_btkgd = q_bthd.reshape(b, t, kh, h // kh, d)
  scores_bkgts = jnp.einsum("btkgd,bskd->bkgts", q_btkgd, k_bskd,
                            preferred_element_type=jnp.float32) * (d ** -0.5)
  if mask_bts is not None:
    scores_bkgts = jnp.where(mask_bts[:, None, None], scores_bkgts,
                             jnp.finfo(jnp.float32).min)
  probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(v_bskd.dtype)
  out_btkgd = jnp.einsum("bkgts,bskd->btkgd", probs_bkgts, v_bskd)
  return out_btkgd.reshape(b, t, h, d)


def _jnp_causal_attention(q_bthd, k_btkd, v_btkd, mask_bts=None):
  t = q_bthd.shape[1]
  causal_bts = jnp.tril(jnp.ones((t, t), dtype=bool))[None]
  if mask_bts is not None:
    causal_bts = causal_bts & mask_bts
  return gqa_attention(q_bthd, k_btkd, v_btkd, causal_bts)


def causal_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array,
                     mask_bts: jax.Array | None = None, *, implementation: str = "auto",
                     segment_ids_bt: jax.Array | None = None) -> jax.Array:
  """Causal self-attention over one sequence, or over each segment of a packed row
  (segment_ids_bt int32 [b, t]); out_bthd in v's dtype.

  `implementation` is one of presets.ATTENTION_IMPLS (rl_jax.model.attention explains
  each; "auto" picks by backend and q's dtype). `mask_bts` further restricts keys and
  always takes the materialised jnp path.
  """
  impl = attention.resolve(implementation, q_bthd, k_btkd)
  if segment_ids_bt is not None and impl == "jnp":
    same_bts = attention.same_segment_bts(segment_ids_bt)
    mask_bts = same_bts if mask_bts is None else mask_bts & same_bts
  if impl == "jnp" or mask_bts is not None:
    return _jnp_causal_attention(q_bthd, k_btkd, v_btkd, mask_bts)
  return attention.fused_causal_attention(q_bthd, k_btkd, v_btkd, implementation=impl,
                                          segment_ids_bt=segment_ids_bt)


def _causal_attn_fn(q_bthd, k_btkd, v_btkd, layer_cache, attn_ctx, *, implementation="auto"):
  """Full-sequence causal attention; attn_ctx is None or the packed rows' segment ids."""
  del layer_cache
  return causal_attention(q_bthd, k_btkd, v_btkd, implementation=implementation,
                          segment_ids_bt=attn_ctx), None


_REMAT_POLICY = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def layer_forward(cfg: ModelConfig, lp: dict, x_bte: jax.Array, cos_btd: jax.Array,
                  sin_btd: jax.Array, attend: Callable, adapters: dict | None = None,
                  dropout_key: jax.Array | None = None) -> tuple[jax.Array, Any]:
  """One pre-norm decoder layer as a pure function: (x_bte, whatever `attend` returns second).

  `lp` is one layer's slice of params["layers"] (leaves without the `l` axis).
  attend(q_bthd, k_btkd, v_btkd) -> (out_bthd, aux) gets q/k/v after RoPE; the scanned
  training module and the sampler's unrolled decode loop both run this code.
  `adapters` is this layer's slice of a LoRA adapter tree (rl_jax.model.lora; None: no
  low-rank path) and `dropout_key` turns on the adapters' input dropout.
  """
  dtype = jnp.dtype(cfg.dtype)
  w = {name: p.astype(dtype) for name, p in lp.items()}

  def proj(spec, x, name):
    y = jnp.einsum(spec, x, w[name])
    if adapters is None or name not in adapters:
      return y
    return y + lora.delta(cfg, adapters, name, x, dropout_key)

  hid_bte = rms_norm(x_bte, lp["attn_norm"], cfg.rms_norm_eps)
  q_bthd = proj("bte,ehd->bthd", hid_bte, "q")
  k_btkd = proj("bte,ekd->btkd", hid_bte, "k")
  v_btkd = proj("bte,ekd->btkd", hid_bte, "v")
  if cfg.qkv_bias:
    q_bthd += w["q_bias"]
    k_btkd += w["k_bias"]
    v_btkd += w["v_bias"]
  q_bthd = apply_rope(q_bthd, cos_btd, sin_btd)
  k_btkd = apply_rope(k_btkd, cos_btd, sin_btd)
  out_bthd, aux = attend(q_bthd, k_btkd, v_btkd)
  x_bte = x_bte + proj("bthd,hde->bte", out_bthd.astype(dtype), "o")

  hid_bte = rms_norm(x_bte, lp["mlp_norm"], cfg.rms_norm_eps)
  gate_btf = proj("bte,ef->btf", hid_bte, "gate")
  up_btf = proj("bte,ef->btf", hid_bte, "up")
  x_bte = x_bte + proj("btf,fe->bte", jax.nn.silu(gate_btf) * up_btf, "down")
  return x_bte, aux


def lm_logits(cfg: ModelConfig, params: dict, x_bte: jax.Array) -> jax.Array:
  """Final RMSNorm and vocabulary projection: logits_btv float32."""
  dtype = jnp.dtype(cfg.dtype)
  x_bte = rms_norm(x_bte, params["final_norm"], cfg.rms_norm_eps)
  if cfg.tie_embeddings:
    return jnp.einsum("bte,ve->btv", x_bte, params["embed"].astype(dtype),
                      preferred_element_type=jnp.float32).astype(jnp.float32)
  return jnp.einsum("bte,ev->btv", x_bte, params["lm_head"].astype(dtype),
                    preferred_element_type=jnp.float32).astype(jnp.float32)


def _normal(stddev: float):
  return nn.initializers.normal(stddev=stddev)


class _Layer(nn.Module):
  """One pre-norm decoder layer; scanned, so `carry` threads the residual stream."""
  cfg: ModelConfig
  attn_fn: AttnFn

  def _param(self, name, shape, axes, init):
    return self.param(name, nn.with_logical_partitioning(init, axes), shape,
                      jnp.dtype(self.cfg.param_dtype))

  @nn.compact
  def __call__(self, carry, cos_btd, sin_btd, attn_ctx, lora_xs):
    cfg = self.cfg
    e, h, kh, d, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.intermediate_size)
    # Residual-branch outputs are scaled down by sqrt(2 * layers) so the residual
    # stream's variance does not grow with depth at init.
    out_std = 1.0 / math.sqrt(2 * cfg.num_layers)
    ones, zeros = nn.initializers.ones, nn.initializers.zeros
    attn_norm = self._param("attn_norm", (e,), ("embed",), ones)
    wq = self._param("q", (e, h, d), ("embed", "heads", "head_dim"), _normal(e ** -0.5))
    wk = self._param("k", (e, kh, d), ("embed", "kv_heads", "head_dim"), _normal(e ** -0.5))
    wv = self._param("v", (e, kh, d), ("embed", "kv_heads", "head_dim"), _normal(e ** -0.5))
    wo = self._param("o", (h, d, e), ("heads", "head_dim", "embed"),
                     _normal(out_std / math.sqrt(h * d)))
    mlp_norm = self._param("mlp_norm", (e,), ("embed",), ones)
    wg = self._param("gate", (e, f), ("embed", "mlp"), _normal(e ** -0.5))
    wu = self._param("up", (e, f), ("embed", "mlp"), _normal(e ** -0.5))
    wd = self._param("down", (f, e), ("mlp", "embed"), _normal(out_std / math.sqrt(f)))

    lp = dict(attn_norm=attn_norm, q=wq, k=wk, v=wv, o=wo, mlp_norm=mlp_norm, gate=wg,
              up=wu, down=wd)
    if cfg.qkv_bias:
      lp["q_bias"] = self._param("q_bias", (h, d), ("heads", "head_dim"), zeros)
      lp["k_bias"] = self._param("k_bias", (kh, d), ("kv_heads", "head_dim"), zeros)
      lp["v_bias"] = self._param("v_bias", (kh, d), ("kv_heads", "head_dim"), zeros)

    x_bte, cache, layer = carry
    layer_cache = None
    if cache is not None:
      layer_cache = jax.tree.map(lambda c: lax.dynamic_index_in_dim(c, layer, keepdims=False),
                                 cache)
    adapters, dropout_key = lora_xs if lora_xs is not None else (None, None)
    x_bte, new_layer_cache = layer_forward(
        cfg, lp, x_bte, cos_btd, sin_btd,
        lambda q, k, v: self.attn_fn(q, k, v, layer_cache, attn_ctx), adapters, dropout_key)

    if cache is None:
      # Without an input cache whatever attn_fn returns is stacked by the scan.
      return (x_bte, None, layer + 1), new_layer_cache
    # With a cache, write the layer's slice back into the carried stack: XLA updates
    # a while-loop carry in place, so a donated cache is never copied whole.
    if (jax.tree.structure(new_layer_cache) != jax.tree.structure(layer_cache) or
        any(n.shape != c.shape for n, c in zip(jax.tree.leaves(new_layer_cache),
                                                jax.tree.leaves(layer_cache)))):
      raise ValueError(
          "attn_fn must return a layer cache with the same structure and shapes as the "
          f"one it received: got {jax.tree.map(jnp.shape, new_layer_cache)}, "
          f"expected {jax.tree.map(jnp.shape, layer_cache)}")
    cache = jax.tree.map(
        lambda c, n: lax.dynamic_update_index_in_dim(c, n.astype(c.dtype), layer, 0),
        cache, new_layer_cache)
    return (x_bte, cache, layer + 1), None


class Transformer(nn.Module):
  """tokens_bt, positions_bt -> (logits_btv float32, new_cache); with return_hidden the
  final-normed hidden states x_bte (compute dtype) replace the logits."""
  cfg: ModelConfig
  attn_fn: AttnFn = _causal_attn_fn

  @nn.compact
  def __call__(self, tokens_bt, positions_bt, cache=None, attn_ctx=None, return_hidden=False,
               lora_xs=None):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.dtype)
    pdtype = jnp.dtype(cfg.param_dtype)
    e, vocab = cfg.hidden_size, cfg.vocab_size
    embed_ve = self.param(
        "embed", nn.with_logical_partitioning(_normal(e ** -0.5), ("vocab", "embed")),
        (vocab, e), pdtype)
    # Clip rather than jnp.take's default NaN fill: an out-of-vocabulary sentinel (say an
    # empty decode slot) must not put NaNs into activations or gradients.
    x_bte = jnp.take(embed_ve, tokens_bt, axis=0, mode="clip").astype(dtype)
    cos_btd, sin_btd = rope_tables(positions_bt, rope_inv_freq(cfg))
    cos_btd, sin_btd = cos_btd.astype(dtype), sin_btd.astype(dtype)

    layer_cls = _Layer
    if cfg.remat != "none":
      layer_cls = nn.remat(_Layer, prevent_cse=False, policy=_REMAT_POLICY[cfg.remat])
    layers = nn.scan(
        layer_cls,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0),
        length=cfg.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(cfg=cfg, attn_fn=self.attn_fn, name="layers")
    (x_bte, cache, _), stacked = layers((x_bte, cache, jnp.int32(0)), cos_btd, sin_btd,
                                        attn_ctx, lora_xs)

    head = {"embed": embed_ve}
    head["final_norm"] = self.param(
        "final_norm", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (e,),
        pdtype)
    if not cfg.tie_embeddings:
      head["lm_head"] = self.param(
          "lm_head", nn.with_logical_partitioning(_normal(e ** -0.5), ("embed", "vocab")),
          (e, vocab), pdtype)
    if return_hidden:
      return (rms_norm(x_bte, head["final_norm"], cfg.rms_norm_eps),
              (stacked if cache is None else cache))
    logits_btv = lm_logits(cfg, head, x_bte)
    return logits_btv, (stacked if cache is None else cache)


def _boxed_params(model_cfg: ModelConfig, rng):
  tokens_bt = jnp.zeros((1, 1), jnp.int32)
  return Transformer(cfg=model_cfg).init(rng, tokens_bt, tokens_bt)["params"]


# Jitted because eager init dispatches every random draw and re-traces the layer scan
# on each call (seconds even for a tiny model); compiled once per config instead.
@jax.jit
def init_params(model_cfg: ModelConfig, rng) -> dict:
  """Random parameters as a plain nested dict of `param_dtype` arrays.

  jit it with `out_shardings` from `param_logical_axes` to initialise directly sharded.
  """
  return nn.unbox(_boxed_params(model_cfg, rng))


def _is_partitioned(x) -> bool:
  return isinstance(x, nn.Partitioned)


def param_logical_axes(model_cfg: ModelConfig) -> dict:
  """Params-shaped pytree whose leaves are tuples of logical axis names.

  Tuples are pytree nodes, so map over it with
  `is_leaf=lambda x: isinstance(x, tuple)` (rl_jax.sharding.tree_shardings does).
  Traced with eval_shape: nothing is allocated.
  """
  boxed = jax.eval_shape(lambda: _boxed_params(model_cfg, jax.random.key(0)))
  return jax.tree.map(lambda p: tuple(p.names), boxed, is_leaf=_is_partitioned)


def forward(model_cfg: ModelConfig, params: dict, tokens_bt: jax.Array,
            positions_bt: jax.Array, *, attn_fn: AttnFn | None = None, cache: Any = None,
            attn_ctx: Any = None, return_hidden: bool = False, adapters: dict | None = None,
            dropout_rng: jax.Array | None = None) -> tuple[jax.Array, Any]:
  """(logits_btv float32, new_cache) with a pluggable attention; with return_hidden,
  (x_bte, new_cache): the final-normed hidden states before the vocabulary projection.

  attn_fn(q_bthd, k_btkd, v_btkd, layer_cache, attn_ctx) -> (out_bthd, new_layer_cache)
  gets q/k/v after RoPE (k/v with num_kv_heads heads). `cache` leaves have a leading
  num_layers axis; layer i sees slice i as `layer_cache` and its returned cache (same
  structure and shapes) is written back to slice i. With cache=None the per-layer
  returns are stacked along a new leading axis instead. `attn_ctx` reaches every layer
  unchanged. attn_fn=None is causal attention with model_cfg.attention's kernel and
  returns new_cache=None; its attn_ctx is None or segment ids int32 [b, t] (packed rows:
  attention stays within a segment). `adapters` (rl_jax.model.lora layout, leading l
  axis) adds the low-rank path to the frozen `params`; `dropout_rng` turns on its dropout.
  """
  if attn_fn is None:
    if cache is not None:
      raise ValueError("forward got a cache but no attn_fn to read or write it")
    attn_fn = functools.partial(_causal_attn_fn, implementation=model_cfg.attention)
  lora_xs = None
  if adapters is not None:
    keys = (None if dropout_rng is None or model_cfg.lora_dropout == 0 else
            jax.random.split(dropout_rng, model_cfg.num_layers))
    lora_xs = (adapters, keys)
  module = Transformer(cfg=model_cfg, attn_fn=attn_fn)
  return module.apply({"params": params}, tokens_bt, positions_bt, cache, attn_ctx,
                      return_hidden, lora_xs)


def apply(model_cfg: ModelConfig, params: dict, tokens_bt: jax.Array,
          positions_bt: jax.Array | None = None,
          segment_ids_bt: jax.Array | None = None, adapters: dict | None = None) -> jax.Array:
  """Causal full-sequence logits_btv (float32); positions default to 0..t-1. With
  segment_ids_bt (packed rows) each segment attends only within itself; give positions
  that restart at 0 in every segment."""
  if positions_bt is None:
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32),
                                    tokens_bt.shape)
  return forward(model_cfg, params, tokens_bt, positions_bt, attn_ctx=segment_ids_bt,
                 adapters=adapters)[0]


def hidden_states(model_cfg: ModelConfig, params: dict, tokens_bt: jax.Array,
                  positions_bt: jax.Array | None = None,
                  segment_ids_bt: jax.Array | None = None, adapters: dict | None = None,
                  dropout_rng: jax.Array | None = None) -> jax.Array:
  """Causal full-sequence final-normed hidden states x_bte (compute dtype), the input of
  the vocabulary projection (rl_jax.model.head computes from them in chunks); packed
  rows as in `apply`."""
  if positions_bt is None:
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32),
                                    tokens_bt.shape)
  return forward(model_cfg, params, tokens_bt, positions_bt, attn_ctx=segment_ids_bt,
                 return_hidden=True, adapters=adapters, dropout_rng=dropout_rng)[0]

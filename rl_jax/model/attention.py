"""Fused full-sequence causal self-attention (training and prefill), kernel chosen by backend.

Shape letters: b batch, t positions (queries and keys: self-attention), h query heads,
k kv heads, g = h // k query heads per kv head, d head_dim, n padded positions.

Query head i reads kv head i // g (Hugging Face's repeat_kv order) in every kernel.
Implementations (ModelConfig.attention; `jnp` lives in rl_jax.model.transformer):

  jnp     scores materialised in float32 [b, k, g, t, t] (transformer.gqa_attention): the
          exact reference, any dtype, any backend.
  xla     jax.nn.dot_product_attention(implementation="xla"): XLA's own materialised
          attention (float32 scores and softmax).
  cudnn   jax.nn.dot_product_attention(implementation="cudnn"): cuDNN flash attention,
          GPU only, native GQA, the causal mask skips the upper triangle, no t x t
          buffer. cuDNN takes 16-bit inputs only, so float32 q/k/v fall back to `xla`.
  splash  Pallas TPU splash attention (jax.experimental.pallas.ops.tpu.splash_attention)
          vmapped over b and k with its multi-query kernel (g query heads share one kv
          head). Off TPU it runs in Pallas interpret mode: correct but slow, for tests.
          Positions are right padded to a multiple of the block size; with the causal
          mask the padded keys come after every real query, so they change nothing.
  auto    GPU: cudnn for 16-bit inputs (falling back to jnp, with a warning, if cuDNN
          rejects the shapes at trace time), jnp for float32 (measured 4.36 ms against
          xla's 5.41 ms per layer fwd+bwd on an H200); TPU: splash; otherwise xla.

Padding: the trainer's rows and the sampler's prefill prompts are right padded, so under
the causal mask no real position ever attends to a padded one and no length mask is
needed (tests/test_attention.py checks this for every implementation).
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

_SPLASH_BLOCKS = (512, 256, 128)


def resolve(implementation: str, dtype, backend: str | None = None) -> str:
  """The concrete kernel for `implementation` at q/k/v dtype `dtype` on `backend`."""
  backend = backend or jax.default_backend()
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  if implementation == "auto":
    if backend in ("gpu", "cuda", "rocm"):
      return "cudnn" if half else "jnp"
    return "splash" if backend == "tpu" else "xla"
  if implementation == "cudnn" and not half:
    return "xla"
  return implementation


def fused_causal_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, *,
                           implementation: str, fallback=None) -> jax.Array:
  """Causal attention out_bthd (v's dtype) with a fused or library kernel.

  `implementation` is a resolved name (xla, cudnn, splash). With `fallback` (a function
  of q, k, v) a cuDNN rejection at trace time (unsupported shape, cuDNN version) runs
  `fallback` instead of raising; only `auto` passes one.
  """
  if implementation == "xla":
    return jax.nn.dot_product_attention(q_bthd, k_btkd, v_btkd, is_causal=True,
                                        implementation="xla").astype(v_btkd.dtype)
  if implementation == "cudnn":
    try:
      return jax.nn.dot_product_attention(q_bthd, k_btkd, v_btkd, is_causal=True,
                                          implementation="cudnn")
    except Exception as e:  # noqa: BLE001  (auto only: any trace-time rejection)
      if fallback is None:
        raise
      _warn_once(f"cuDNN attention unavailable ({type(e).__name__}: {e}); using jnp")
      return fallback(q_bthd, k_btkd, v_btkd)
  if implementation == "splash":
    return splash_causal_attention(q_bthd, k_btkd, v_btkd)
  raise ValueError(f"unknown fused attention implementation {implementation!r}")


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
  logging.warning(message)


def _splash_block(n: int) -> int:
  return next(b for b in _SPLASH_BLOCKS if n % b == 0)


def _splash_kernel(n: int, g: int, interpret: bool):
  """Multi-query splash kernel for n positions and g query heads, causal mask. Built per
  trace, not cached: the kernel holds its mask tables as arrays of the current trace."""
  try:
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk, splash_attention_mask as sm)
  except ImportError as e:
    raise ValueError(
        f"model.attention='splash' needs jax.experimental.pallas.ops.tpu.splash_attention, "
        f"which this jax ({jax.__version__}) does not provide: {e}") from None
  mask = sm.MultiHeadMask([sm.CausalMask((n, n)) for _ in range(g)])
  blk = _splash_block(n)
  sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk,
                        block_kv_dkv=blk, block_kv_dkv_compute=blk, block_q_dq=blk,
                        block_kv_dq=blk)
  return sk.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_causal_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array,
                            segment_ids_bt: jax.Array | None = None) -> jax.Array:
  """Splash attention, one multi-query kernel call per (row, kv head); out_bthd.
  With segment_ids_bt (int32) a query sees only keys of its own segment (packed
  sequences, e.g. the sampler's prefill lane); padding positions form segment -1."""
  b, t, h, d = q_bthd.shape
  kh = k_btkd.shape[2]
  g = h // kh
  n = -(-t // _SPLASH_BLOCKS[-1]) * _SPLASH_BLOCKS[-1]
  pad = ((0, 0), (0, n - t), (0, 0), (0, 0))
  # Splash does not scale the scores: fold 1/sqrt(d) into q.
  q_bnhd = jnp.pad(q_bthd * jnp.asarray(d ** -0.5, q_bthd.dtype), pad)
  k_bnkd, v_bnkd = jnp.pad(k_btkd, pad), jnp.pad(v_btkd, pad)
  q_bkgnd = q_bnhd.reshape(b, n, kh, g, d).transpose(0, 2, 3, 1, 4)
  k_bknd, v_bknd = k_bnkd.transpose(0, 2, 1, 3), v_bnkd.transpose(0, 2, 1, 3)
  kernel = _splash_kernel(n, g, jax.default_backend() != "tpu")
  if segment_ids_bt is None:
    out_bkgnd = jax.vmap(jax.vmap(kernel))(q_bkgnd, k_bknd, v_bknd)
  else:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    seg_bn = jnp.pad(segment_ids_bt.astype(jnp.int32), ((0, 0), (0, n - t)),
                     constant_values=-1)

    def row(q_kgnd, k_knd, v_knd, seg_n):
      ids = sk.SegmentIds(q=seg_n, kv=seg_n)
      return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=ids))(q_kgnd, k_knd, v_knd)

    out_bkgnd = jax.vmap(row)(q_bkgnd, k_bknd, v_bknd, seg_bn)
  out_bnhd = out_bkgnd.transpose(0, 3, 1, 2, 4).reshape(b, n, h, d)
  return out_bnhd[:, :t].astype(v_btkd.dtype)


"""Fused full-sequence causal self-attention (training and prefill), kernel chosen by backend.

Shape letters: b batch, t positions (queries and keys: self-attention), h query heads,
k kv heads, g = h // k query heads per kv head, d head_dim, n padded positions.

Query head i reads kv head i // g (Hugging Face's repeat_kv order) in every kernel.
Implementations (ModelConfig.attention; `jnp` lives in rl_jax.model.transformer):

  jnp     scores materialised in float32 [b, k, g, t, t] (transformer.gqa_attention): the
          exact reference, any dtype, any backend.
  xla     materialised attention in plain XLA ops (materialised_causal_attention): float32
          scores and softmax, and its four GEMMs (QK^T, PV, and their transposes in the
          backward) take compute-dtype operands with float32 accumulation, like a flash
          kernel's: the scores' and the output's cotangents are rounded to the compute
          dtype before the backward GEMMs, so in bf16 every attention matmul runs at the
          bf16 rate.
  cudnn   jax.nn.dot_product_attention(implementation="cudnn"): cuDNN flash attention,
          GPU only, 16-bit inputs only, native GQA, the causal mask skips the upper
          triangle, no t x t buffer.
  splash  Pallas TPU splash attention (jax.experimental.pallas.ops.tpu.splash_attention)
          vmapped over b and k with its multi-query kernel (g query heads share one kv
          head). Off TPU it runs in Pallas interpret mode: correct but slow, for tests.
          Positions are right padded to a multiple of the block size; with the causal
          mask the padded keys come after every real query, so they change nothing.
  auto    GPU: cudnn for 16-bit inputs, jnp for float32 (measured 4.36 ms against
          jax's XLA attention's 5.41 ms per layer fwd+bwd on an H200); TPU: splash;
          otherwise xla.

Choice (`select`): the kernel is resolved once per (request, dtype, backend, shape) and
the result (kernel, request, fallback reason) is what runs and what the trainer records.
An explicit cudnn or splash that cannot run raises AttentionUnavailable, one line naming
why (cuDNN off GPU, on float32 inputs, or rejected by the cuDNN it finds: probed by
compiling the kernel's forward and backward at the shape). `auto` falls back, with one
warning line naming the reason, from cudnn to xla and from splash to xla.

Padding: the trainer's rows and the sampler's prefill prompts are right padded, so under
the causal mask no real position ever attends to a padded one and no length mask is
needed (tests/test_attention.py checks this for every implementation).

Packed rows (the trainer's sequence packing, rl_jax.trainer.buckets): with segment ids
seg_bt a query attends only to earlier keys of its own segment,
mask_bts = (s <= t) & (seg_bt[t] == seg_bt[s]), a block-diagonal causal mask. jnp and xla
take it as a mask, splash as its SegmentIds. cuDNN has no packed form in the public
jax.nn.dot_product_attention (read in jax 0.10.2 and in jax's source at 0.11.1: query /
key lengths only cut each row's tail; segment offsets exist only in the private
jax._src.cudnn module), so SEGMENT_KERNELS leaves it out and the trainer trains padded
rows there.
"""
from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rl_jax.errors import UserError

_SPLASH_BLOCKS = (512, 256, 128)
# Resolved kernels that take segment ids (packed rows).
SEGMENT_KERNELS = ("jnp", "xla", "splash")


class AttentionUnavailable(UserError, ValueError):
  """An explicitly requested kernel cannot run here; the message is one line naming why."""


class Kernel(NamedTuple):
  """The resolved attention kernel: what runs, what was asked for, and why auto fell back
  ("" when it did not)."""
  name: str  # jnp | xla | cudnn | splash
  requested: str  # ModelConfig.attention
  fallback_reason: str

  def record(self) -> dict[str, str]:
    """As summary.json, metrics and the bench JSON record it."""
    return dict(attention_kernel=self.name, attention_requested=self.requested,
                attention_fallback=self.fallback_reason)


def _is_half(dtype) -> bool:
  return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _splash_missing() -> str:
  try:
    from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: F401
        splash_attention_kernel, splash_attention_mask)
  except ImportError as e:
    return (f"this jax ({jax.__version__}) has no "
            f"jax.experimental.pallas.ops.tpu.splash_attention ({e})")
  return ""


def _cudnn_rejection(dtype, shape_thkd) -> str:
  """"" when cuDNN flash attention compiles forward and backward at q [1, t, h, d], k / v
  [1, t, k, d] on the default GPU; otherwise the error, on one line."""
  t, h, kh, d = shape_thkd
  q = jax.ShapeDtypeStruct((1, t, h, d), dtype)
  kv = jax.ShapeDtypeStruct((1, t, kh, d), dtype)
  loss = lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn").astype(jnp.float32))
  try:
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
  except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
    # jax's cuDNN path reports a missing or old cuDNN, an unsupported shape or dtype
    # with these types; anything else is a bug and propagates.
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"
  return ""


@functools.lru_cache(maxsize=None)
def select(implementation: str, dtype, backend: str, shape_thkd: tuple[int, int, int, int]
           ) -> Kernel:
  """The kernel for `implementation` at q/k/v dtype `dtype` on `backend` ("cpu", "gpu",
  "tpu") for t positions, h query and k kv heads of width d; cached, so each choice is
  made (and an auto fallback warned about) once per process."""
  dtype = jnp.dtype(dtype)
  gpu = backend in ("gpu", "cuda", "rocm")
  if implementation == "auto":
    if gpu and _is_half(dtype):
      reason = _cudnn_rejection(dtype, shape_thkd)
      if reason:
        _warn(f"model.attention=auto: cuDNN attention cannot run ({reason}); using xla")
        return Kernel("xla", implementation, f"cudnn: {reason}")
      return Kernel("cudnn", implementation, "")
    if backend == "tpu":
      reason = _splash_missing()
      if reason:
        _warn(f"model.attention=auto: splash attention cannot run ({reason}); using xla")
        return Kernel("xla", implementation, f"splash: {reason}")
      return Kernel("splash", implementation, "")
    return Kernel("jnp" if gpu else "xla", implementation, "")
  if implementation == "cudnn":
    if not gpu:
      raise AttentionUnavailable(f"model.attention='cudnn' needs a GPU; the backend is "
                                 f"{backend}")
    if not _is_half(dtype):
      raise AttentionUnavailable(f"model.attention='cudnn' takes bfloat16 or float16 "
                                 f"inputs; the compute dtype is {dtype.name}")
    reason = _cudnn_rejection(dtype, shape_thkd)
    if reason:
      raise AttentionUnavailable(f"model.attention='cudnn' cannot run at "
                                 f"(t, h, k, d) = {shape_thkd}: {reason}")
  if implementation == "splash" and _splash_missing():
    raise AttentionUnavailable(f"model.attention='splash' cannot run: {_splash_missing()}")
  return Kernel(implementation, implementation, "")


def resolve(implementation: str, q_bthd: jax.Array, k_btkd: jax.Array,
            backend: str | None = None) -> str:
  """The kernel name `select` picks for these q / k (their dtype and shapes)."""
  t, h, d = q_bthd.shape[1:]
  return select(implementation, jnp.dtype(q_bthd.dtype), backend or jax.default_backend(),
                (t, h, k_btkd.shape[2], d)).name


def same_segment_bts(segment_ids_bt: jax.Array) -> jax.Array:
  """bool [b, t, s]: query t and key s lie in the same segment."""
  return segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]


def fused_causal_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, *,
                           implementation: str,
                           segment_ids_bt: jax.Array | None = None) -> jax.Array:
  """Causal attention out_bthd (v's dtype) with a fused or library kernel;
  `implementation` is a resolved name (xla, cudnn, splash). `segment_ids_bt` (int32
  [b, t], packed rows) keeps attention within a segment; cudnn does not take it."""
  if segment_ids_bt is not None and implementation not in SEGMENT_KERNELS:
    raise ValueError(f"attention kernel {implementation!r} has no packed (segment ids) "
                     f"form; train padded rows (trainer.packing='off')")
  if implementation == "xla":
    mask_bts = None if segment_ids_bt is None else same_segment_bts(segment_ids_bt)
    return materialised_causal_attention(q_bthd, k_btkd, v_btkd, mask_bts)
  if implementation == "cudnn":
    return jax.nn.dot_product_attention(q_bthd, k_btkd, v_btkd, is_causal=True,
                                        implementation="cudnn")
  if implementation == "splash":
    return splash_causal_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt)
  raise ValueError(f"unknown fused attention implementation {implementation!r}")


@functools.lru_cache(maxsize=None)
def _warn(message: str) -> None:
  logging.warning(message)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_f32acc(spec: str, a, b):
  """einsum(spec, a, b) accumulated and returned in float32; the backward rounds the
  cotangent to a's dtype and runs both transposed GEMMs on operands of that dtype."""
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _einsum_f32acc_fwd(spec, a, b):
  return _einsum_f32acc(spec, a, b), (a, b)


def _einsum_f32acc_bwd(spec, residuals, ct):
  a, b = residuals
  a_spec, b_spec, out_spec = spec.replace("->", ",").split(",")
  ct = ct.astype(a.dtype)
  da = jnp.einsum(f"{out_spec},{b_spec}->{a_spec}", ct, b, preferred_element_type=jnp.float32)
  db = jnp.einsum(f"{a_spec},{out_spec}->{b_spec}", a, ct, preferred_element_type=jnp.float32)
  return da.astype(a.dtype), db.astype(b.dtype)


_einsum_f32acc.defvjp(_einsum_f32acc_fwd, _einsum_f32acc_bwd)


def materialised_causal_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array,
                                  mask_bts: jax.Array | None = None) -> jax.Array:
  """softmax(q k^T / sqrt(d), causal and `mask_bts`) v; scores and softmax float32, every
  GEMM on compute-dtype operands forward and backward (module docstring); out_bthd."""
  b, t, h, d = q_bthd.shape
  kh = k_btkd.shape[2]
  q_btkgd = q_bthd.reshape(b, t, kh, h // kh, d)
  s_bkgts = _einsum_f32acc("btkgd,bskd->bkgts", q_btkgd, k_btkd) * (d ** -0.5)
  keep_bts = jnp.tril(jnp.ones((t, t), dtype=bool))[None]
  if mask_bts is not None:
    keep_bts = keep_bts & mask_bts
  s_bkgts = jnp.where(keep_bts[:, None, None], s_bkgts, jnp.finfo(jnp.float32).min)
  p_bkgts = jax.nn.softmax(s_bkgts, axis=-1).astype(v_btkd.dtype)
  out_btkgd = _einsum_f32acc("bkgts,bskd->btkgd", p_bkgts, v_btkd)
  return out_btkgd.reshape(b, t, h, d).astype(v_btkd.dtype)


def _splash_block(n: int) -> int:
  return next(b for b in _SPLASH_BLOCKS if n % b == 0)


def _splash_kernel(n: int, g: int, interpret: bool):
  """Multi-query splash kernel for n positions and g query heads, causal mask. Built per
  trace, not cached: the kernel holds its mask tables as arrays of the current trace."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as sk, splash_attention_mask as sm)
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
  sequences: the trainer's packed rows, the sampler's prefill lane); the block padding
  forms segment -1."""
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


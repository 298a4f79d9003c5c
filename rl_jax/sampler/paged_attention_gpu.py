"""Paged flash-decoding attention for GPUs: a Pallas kernel (Triton lowering) that reads
each slot's live pages in place, sampler.attention = "pallas_gpu".

Shape letters (as in decode.py): b decode slots, h query heads, k kv heads, g = h // k
query heads per kv head, n pages in the pool, p tokens per page, d head_dim, w page-table
columns, plus: r = g padded to a power of two >= 16 (the smallest tile a Triton matmul
takes), c pages per compute block, t = c p tokens per block, s sequence splits.

Computes, for every slot b and query head i (kv head i // g, Hugging Face's order),
  out[b, i] = sum_j softmax_j(q[b, i] . K[b, j] / sqrt(d)) V[b, j],  j < kv_len_b,
where position j of slot b sits at row j % p of page page_table_bw[b, j // p].

Grid (b, k, s): one program per (slot, kv head, split). It keeps the slot's g query
heads of that kv head as an [r, d] tile and walks its share of the slot's page-table
columns in blocks of c pages, up to the block holding the slot's last live position:
pages are read in place through the page table (no gathered copy), each live page once
per kv head, and one K/V tile feeds all g query heads (GQA-native). Columns past that
block are never read, nor the pages they name; inside it, positions >= kv_len_b are
masked out of the scores and zeroed out of V (whatever a dead page holds, even NaN).
Online softmax per block in float32, from bf16 (or fp32) K/V:
  m' = max(m, max_j s_j),  l' = e^(m - m') l + sum_j e^(s_j - m'),
  acc' = e^(m - m') acc + sum_j e^(s_j - m') V_j.
Each split writes (acc, m, l) in float32; the splits combine outside the kernel:
  out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s,  M = max_s m_s.
Splits exist so that a small batch still fills the GPU (flash-decoding): s is the
smallest power of two giving >= `min_programs` programs, capped by the blocks a row has.
A slot with kv_len 0 gets 0 (decode never has one: kv_len = position + 1).

On a device mesh (custom_partitioning) every device runs the kernel for the slots of
its q batch shard over the kv heads of its pool shard, with no collective; the pools'
pages must be whole on every device, as the sampler's sharding rules keep them.

Constraints of the Triton lowering: d and p powers of two, d >= 16. Off a GPU the kernel
runs in Pallas interpret mode (tests); decode.resolve_attention refuses "pallas_gpu" on
any other backend with one line (check_backend).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from rl_jax.errors import UserError

NULL_PAGE = 0  # page_table.NULL_PAGE: padding columns point at it; masked, never used
_MIN_ROWS = 16  # Triton's smallest matmul tile side
_GPU_BACKENDS = ("gpu", "cuda", "rocm")


class KernelUnavailableError(UserError, ValueError):
  """sampler.attention names a kernel this backend or jax cannot run."""


def check_backend(backend: str | None = None) -> None:
  """Raises KernelUnavailableError (one line) unless this process can run the kernel:
  a GPU backend and a jax with the Pallas Triton lowering."""
  backend = backend or jax.default_backend()
  if backend not in _GPU_BACKENDS:
    raise KernelUnavailableError(
        f"sampler.attention='pallas_gpu' needs a GPU (Pallas Triton kernel); this "
        f"process's JAX backend is {backend!r}: use 'auto', 'jnp' or 'ragged'")
  try:
    from jax.experimental.pallas import triton  # noqa: F401
  except ImportError as e:
    raise KernelUnavailableError(
        f"sampler.attention='pallas_gpu' needs jax.experimental.pallas.triton, which "
        f"this jax ({jax.__version__}) cannot import ({e}): use 'auto', 'jnp' or "
        f"'ragged'") from None


def _pow2_at_least(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def plan(*, batch: int, kv_heads: int, q_per_kv: int, page_size: int, head_dim: int,
         width: int, tokens_per_block: int = 128, min_programs: int = 512) -> dict:
  """Static tiling for one call: rows r, pages per block c, blocks per split, splits s,
  padded table width; KernelUnavailableError (naming the field) for shapes Triton
  cannot tile."""
  for name, value, least in (("sampler.page_size", page_size, 1),
                             ("model head_dim", head_dim, _MIN_ROWS)):
    if value < least or value & (value - 1):
      raise KernelUnavailableError(f"sampler.attention='pallas_gpu' needs {name} to be a "
                                   f"power of two >= {least}, got {value}")
  pages = max(_pow2_at_least(tokens_per_block) // page_size, 1, _MIN_ROWS // page_size)
  blocks = -(-width // pages)
  want = _pow2_at_least(-(-min_programs // (batch * kv_heads)))
  per_split = -(-blocks // min(want, blocks))
  splits = -(-blocks // per_split)
  return dict(rows=max(_pow2_at_least(q_per_kv), _MIN_ROWS), pages_per_block=pages,
              blocks_per_split=per_split, splits=splits,
              table_width=splits * per_split * pages)


def _kernel(len_ref, table_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *,
            page_size: int, pages_per_block: int, blocks_per_split: int, scale: float):
  """One (slot, kv head, split): refs len [1], table [w'], q [r, d], k/v [n, p, d];
  writes acc [r, d], m [r], l [r] (float32) over the split's live blocks."""
  tokens = pages_per_block * page_size
  length = len_ref[0]
  live_blocks = pl.cdiv(pl.cdiv(length, page_size), pages_per_block)
  first = pl.program_id(2) * blocks_per_split
  count = jnp.clip(live_blocks - first, 0, blocks_per_split)
  q_rd = q_ref[...]
  rows, d = q_rd.shape
  neg = jnp.finfo(jnp.float32).min

  def block(i, carry):
    acc_rd, m_r, l_r = carry
    col = (first + i) * pages_per_block
    pages_c = table_ref[pl.ds(col, pages_per_block)]
    live_t = col * page_size + lax.broadcasted_iota(jnp.int32, (tokens,), 0) < length
    k_td = k_ref[pages_c].reshape(tokens, d)
    v_td = jnp.where(live_t[:, None], v_ref[pages_c].reshape(tokens, d), 0)
    s_rt = lax.dot_general(q_rd, k_td, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32) * scale
    s_rt = jnp.where(live_t[None, :], s_rt, neg)
    m_new_r = jnp.maximum(m_r, s_rt.max(axis=1))
    alpha_r = jnp.exp(m_r - m_new_r)
    e_rt = jnp.where(live_t[None, :], jnp.exp(s_rt - m_new_r[:, None]), 0.0)
    pv_rd = lax.dot_general(e_rt.astype(v_td.dtype), v_td, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return (alpha_r[:, None] * acc_rd + pv_rd, m_new_r,
            alpha_r * l_r + e_rt.sum(axis=1))

  init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), neg, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  acc_rd, m_r, l_r = lax.fori_loop(0, count, block, init)
  acc_ref[...] = acc_rd
  m_ref[...] = m_r
  l_ref[...] = l_r


def paged_attention(q_bhd, k_pages_knpd, v_pages_knpd, page_table_bw, kv_len_b, *,
                    tokens_per_block: int = 128, min_programs: int = 512,
                    num_warps: int = 4, num_stages: int = 2,
                    interpret: bool | None = None):
  """out_bhd (the pools' dtype): attention of q over each slot's first kv_len_b cached
  positions, read in place from the [k, n, p, d] pools through page_table_bw [b, w].

  tokens_per_block (t = c p), min_programs, num_warps and num_stages tune the kernel;
  interpret None runs the Pallas interpreter off a GPU and the Triton kernel on one.
  On a multi-device mesh each device runs the kernel on its own slots and kv heads
  (_partition); on one device the kernel is called directly.
  """
  options = (("tokens_per_block", tokens_per_block), ("min_programs", min_programs),
             ("num_warps", num_warps), ("num_stages", num_stages), ("interpret", interpret))
  return _sharded_attention(q_bhd, k_pages_knpd, v_pages_knpd, page_table_bw, kv_len_b,
                            options)


def _local_attention(q_bhd, k_pages_knpd, v_pages_knpd, page_table_bw, kv_len_b, *,
                     tokens_per_block, min_programs, num_warps, num_stages, interpret):
  """paged_attention on one device's arrays."""
  b, h, d = q_bhd.shape
  kh, n, p, _ = k_pages_knpd.shape
  g = h // kh
  w = page_table_bw.shape[1]
  tile = plan(batch=b, kv_heads=kh, q_per_kv=g, page_size=p, head_dim=d, width=w,
              tokens_per_block=tokens_per_block, min_programs=min_programs)
  rows, splits = tile["rows"], tile["splits"]
  if interpret is None:
    interpret = jax.default_backend() not in _GPU_BACKENDS
  q_bkrd = jnp.pad(q_bhd.astype(k_pages_knpd.dtype).reshape(b, kh, g, d),
                   ((0, 0), (0, 0), (0, rows - g), (0, 0)))
  table_bw = jnp.pad(page_table_bw.astype(jnp.int32), ((0, 0), (0, tile["table_width"] - w)),
                     constant_values=NULL_PAGE)
  kernel = functools.partial(_kernel, page_size=p, pages_per_block=tile["pages_per_block"],
                             blocks_per_split=tile["blocks_per_split"], scale=d ** -0.5)
  itemsize = k_pages_knpd.dtype.itemsize
  kv_bytes = 2 * b * kh * tile["table_width"] * p * d * itemsize  # upper bound: full width
  out_bytes = b * kh * splits * rows * (d + 2) * 4
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  acc_bksrd, m_bksr, l_bksr = pl.pallas_call(
      kernel,
      grid=(b, kh, splits),
      in_specs=[
          pl.BlockSpec((None, 1), lambda i, j, s: (i, 0)),
          pl.BlockSpec((None, tile["table_width"]), lambda i, j, s: (i, 0)),
          pl.BlockSpec((None, None, rows, d), lambda i, j, s: (i, j, 0, 0)),
          pl.BlockSpec((None, n, p, d), lambda i, j, s: (j, 0, 0, 0)),
          pl.BlockSpec((None, n, p, d), lambda i, j, s: (j, 0, 0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, rows, d), lambda i, j, s: (i, j, s, 0, 0)),
          pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0)),
          pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((b, kh, splits, rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, splits, rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, splits, rows), jnp.float32)],
      compiler_params=params,
      interpret=interpret,
      cost_estimate=pl.CostEstimate(
          flops=4 * b * kh * rows * tile["table_width"] * p * d,
          transcendentals=b * kh * rows * tile["table_width"] * p,
          bytes_accessed=kv_bytes + q_bkrd.size * itemsize + out_bytes),
      name="rl_jax_paged_decode",
  )(kv_len_b.astype(jnp.int32)[:, None], table_bw, q_bkrd, k_pages_knpd, v_pages_knpd)
  weight_bksr = jnp.exp(m_bksr - m_bksr.max(axis=2, keepdims=True))
  num_bkrd = (acc_bksrd * weight_bksr[..., None]).sum(axis=2)
  den_bkr = (l_bksr * weight_bksr).sum(axis=2)
  out_bkrd = num_bkrd / jnp.maximum(den_bkr, jnp.finfo(jnp.float32).tiny)[..., None]
  return out_bkrd[:, :, :g].reshape(b, h, d).astype(v_pages_knpd.dtype)


@functools.partial(custom_partitioning, static_argnums=(5,))
def _sharded_attention(q_bhd, k_pages_knpd, v_pages_knpd, page_table_bw, kv_len_b, options):
  return _local_attention(q_bhd, k_pages_knpd, v_pages_knpd, page_table_bw, kv_len_b,
                          **dict(options))


def _specs(mesh, arg_shapes):
  """(slot axes, kv-head axes): the slots split as q's batch dim is, the kv heads as the
  pools' head dim is; pages, rows and head_dim stay whole on every device."""
  q_spec, k_spec = (tuple(a.sharding.spec) for a in arg_shapes[:2])
  return (q_spec[0] if q_spec else None), (k_spec[0] if k_spec else None)


def _infer(options, mesh, arg_shapes, result_shape):
  slots, heads = _specs(mesh, arg_shapes)
  return NamedSharding(mesh, P(slots, heads, None))


def _partition(options, mesh, arg_shapes, result_shape):
  """Every device attends for its slots (q's batch shards, with their page-table rows
  and lengths) over its kv heads (the pools' head shards, with the q heads they serve:
  head i reads kv head i // g, so a contiguous block of kv heads owns a contiguous block
  of q heads). No collective: the pools' pages are whole on every device already."""
  slots, heads = _specs(mesh, arg_shapes)
  pool = NamedSharding(mesh, P(heads, None, None, None))
  args = (NamedSharding(mesh, P(slots, heads, None)), pool, pool,
          NamedSharding(mesh, P(slots, None)), NamedSharding(mesh, P(slots)))

  def local(*arrays):
    return _local_attention(*arrays, **dict(options))
  return mesh, local, NamedSharding(mesh, P(slots, heads, None)), args


def _sharding_rule(options, mesh, value_types, result_types):
  """Shardy's rule: h = (k g), so q's heads follow the pools' kv heads."""
  g = value_types[0].shape[1] // value_types[1].shape[0]
  return "b (k g) d, k n p d, k n p d, b w, b -> b (k g) d", {"g": g}


_sharded_attention.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                                 sharding_rule=_sharding_rule)

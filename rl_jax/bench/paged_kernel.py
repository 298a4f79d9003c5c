"""The GPU check of the Pallas paged decode kernel (sampler.attention = "pallas_gpu"),
run by launch/check_paged_kernel.py on one GPU; every section returns a JSON-able dict.

Shape letters: b slots, h query heads, k kv heads, n pages, p tokens per page, d
head_dim, w page-table columns.

correctness  The kernel against the jnp route (sampler.attention = "jnp") at the preset's
             attention shapes, batch b, every slot at a random length in [1, ctx], slots
             sharing prefix pages in pairs: max |kernel - jnp| in the pool dtype (bf16)
             and in float32, and each against the jnp route in float32 on the same
             (bf16-rounded) values (*_err_vs_f32).
attention    Decode attention at every slot holding `ctx` tokens, timed over a chain of
             CHAIN layers' distinct pools per call: ms per layer for the jnp route and
             for the kernel at a few tilings, and the kernel's effective bandwidth,
             live KV bytes / time, live KV bytes = 2 (K, V) x b x ctx x k x d x
             itemsize per layer; then both routes (default tiling) with every slot at
             ctx / 8 over the same table width.
decode       measure.decode (an Engine, `steps_per_call` steps per call, tokens/s) with
             attention jnp and pallas_gpu at each batch.
ptx          No GPU needed: each tiling lowered for CUDA, its Triton module compiled to
             PTX for `arch` by the CUDA plugin's Triton compiler (jax-cuda12-plugin of
             jaxlib's version installed; jax._src.lib.triton, a private API), giving
             shared memory per program, and, where ptxas is found (PATH or the
             nvidia-cuda-nvcc-cu12 wheel), registers per thread and spill bytes.
"""
from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.bench import measure
from rl_jax.sampler import decode as decode_lib
from rl_jax.sampler import paged_attention_gpu as kernel_lib

# (tokens_per_block, min_programs, num_warps, num_stages); the first is the default.
TILINGS = ((128, 512, 4, 2), (64, 512, 4, 2), (256, 512, 8, 2), (128, 1024, 4, 3),
           (128, 256, 4, 2), (128, 1, 4, 2))
CHAIN = 8  # distinct layer pools per timed call (see attention)


def _inputs(model_cfg, *, batch: int, ctx: int, page_size: int, dtype, seed: int,
            length: int = 0, layers: int = 1):
  """(q_bhd, k pools, v pools, table_bw, lengths_b): `layers` distinct [k, n, p, d]
  pools each over ctx / page_size table columns, slot 2i+1 sharing slot 2i's first
  half of pages; every length `length`, or uniform in [1, ctx] with length 0."""
  c = model_cfg
  w = ctx // page_size
  n = 1 + batch * w
  rng = np.random.default_rng(seed)
  keys = jax.random.split(jax.random.key(seed), 2 * layers + 1)
  pool = (c.num_kv_heads, n, page_size, c.head_dim)
  k, v = ([jax.random.normal(key, pool, jnp.float32).astype(dtype) for key in half]
          for half in (keys[:layers], keys[layers:-1]))
  q = jax.random.normal(keys[-1], (batch, c.num_heads, c.head_dim), jnp.float32).astype(dtype)
  table = 1 + rng.permutation(n - 1)[:batch * w].reshape(batch, w)
  table[1::2, :w // 2] = table[0:batch - 1:2, :w // 2]
  lengths = np.full((batch,), length) if length else rng.integers(1, ctx + 1, batch)
  return q, tuple(k), tuple(v), jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32)


def correctness(model_cfg, *, batches, ctx: int, page_size: int) -> dict:
  rows = []
  run_kernel = jax.jit(kernel_lib.paged_attention)
  run_jnp = jax.jit(decode_lib.paged_attention_jnp)
  for batch in batches:
    for dtype in (jnp.bfloat16, jnp.float32):
      q, (k,), (v,), table, lengths = _inputs(model_cfg, batch=batch, ctx=ctx,
                                              page_size=page_size, dtype=dtype, seed=batch)
      got = np.asarray(run_kernel(q, k, v, table, lengths), np.float32)
      want = np.asarray(run_jnp(q, k, v, table, lengths), np.float32)
      f32 = [a.astype(jnp.float32) for a in (q, k, v)]
      ref = np.asarray(run_jnp(*f32, table, lengths), np.float32)
      rows.append(dict(batch=batch, dtype=jnp.dtype(dtype).name,
                       max_abs_err_vs_jnp=float(np.abs(got - want).max()),
                       kernel_err_vs_f32=float(np.abs(got - ref).max()),
                       jnp_err_vs_f32=float(np.abs(want - ref).max()),
                       finite=bool(np.isfinite(got).all())))
  return dict(rows=rows)


def _chained(attend):
  """One jitted call attending over each layer's pools in turn, each layer's output the
  next one's query (as in a decode step): one dispatch per CHAIN kernels, and CHAIN
  distinct pools, so neither host dispatch nor the L2 cache flatters a ~10 us kernel."""
  def run(q_bhd, ks, vs, table_bw, lengths_b):
    for k, v in zip(ks, vs):
      q_bhd = attend(q_bhd, k, v, table_bw, lengths_b)
    return q_bhd
  return jax.jit(run)


def attention(model_cfg, *, batches, ctx: int, page_size: int, repeats: int) -> dict:
  """ms per layer (a chain of CHAIN layers per call, divided by CHAIN)."""
  rows = []
  c = model_cfg
  for batch in batches:
    args = _inputs(model_cfg, batch=batch, ctx=ctx, page_size=page_size,
                   dtype=jnp.bfloat16, seed=batch, length=ctx, layers=CHAIN)
    kv_bytes = 2 * batch * ctx * c.num_kv_heads * c.head_dim * 2
    run_jnp = _chained(decode_lib.paged_attention_jnp)

    def per_layer_ms(fn, inputs):
      return 1e3 * measure._seconds_per_call(lambda: fn(*inputs), repeats) / CHAIN

    row = dict(batch=batch, ctx=ctx, page_size=page_size, layers_per_call=CHAIN,
               live_kv_bytes_per_layer=kv_bytes, jnp_ms=per_layer_ms(run_jnp, args))
    tilings = []
    for tpb, programs, warps, stages in TILINGS:
      fn = _chained(functools.partial(kernel_lib.paged_attention, tokens_per_block=tpb,
                                      min_programs=programs, num_warps=warps,
                                      num_stages=stages))
      entry = dict(tokens_per_block=tpb, min_programs=programs, num_warps=warps,
                   num_stages=stages)
      try:
        ms = per_layer_ms(fn, args)
        entry.update(ms=ms, gbps=kv_bytes / ms / 1e6)
      except Exception as e:  # noqa: BLE001  (a tiling Triton rejects is a result too)
        entry.update(error=f"{type(e).__name__}: {str(e)[:300]}")
      tilings.append(entry)
    row["kernel"] = tilings
    timed = [t for t in tilings if "ms" in t]
    if timed:
      best = min(timed, key=lambda t: t["ms"])
      row.update(best_kernel_ms=best["ms"], best_kernel_gbps=best["gbps"],
                 jnp_over_best_kernel=row["jnp_ms"] / best["ms"])
    # The same table width with every slot at ctx / 8: reading only live pages, the
    # kernel's time should fall towards 1/8 (the jnp route reads the whole width).
    del args
    short = _inputs(model_cfg, batch=batch, ctx=ctx, page_size=page_size,
                    dtype=jnp.bfloat16, seed=batch, length=max(ctx // 8, 1), layers=CHAIN)
    row.update(short_len=max(ctx // 8, 1), short_jnp_ms=per_layer_ms(run_jnp, short),
               short_kernel_ms=per_layer_ms(_chained(kernel_lib.paged_attention), short))
    rows.append(row)
  return dict(rows=rows)


def decode(model_cfg, *, batches, ctx: int, page_size: int, steps_per_call: int,
           calls: int, copy_gbps: float | None) -> dict:
  mesh = measure.one_device_mesh()
  params = measure.sampler_params(model_cfg, mesh, "bfloat16")
  rows = []
  for batch in batches:
    pair = {}
    for attention in ("jnp", "pallas_gpu"):
      try:
        pair[attention] = measure.decode(
            model_cfg, params, mesh, batch=batch, ctx=ctx, page_size=page_size,
            steps_per_call=steps_per_call, calls=calls, dtype="bfloat16",
            copy_gbps=copy_gbps, ref_gbps=0.0, attention=attention)
      except Exception as e:  # noqa: BLE001  (the other route's row still counts)
        pair[attention] = dict(batch=batch, attention=attention,
                               error=f"{type(e).__name__}: {str(e)[:1000]}")
      rows.append(pair[attention])
    if all("tokens_per_s" in r for r in pair.values()):
      rows.append(dict(batch=batch, kernel_over_jnp_tokens_per_s=(
          pair["pallas_gpu"]["tokens_per_s"] / pair["jnp"]["tokens_per_s"])))
  return dict(rows=rows)


def _triton_calls(fn, args) -> list[tuple[bytes, int, int]]:
  """(Triton module bytecode, num_warps, num_stages) of each Pallas Triton call in
  `fn` lowered for CUDA (from any backend)."""
  module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir()
  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          attrs = child.attributes
          if child.operation.name == "stablehlo.custom_call" and "mhlo.backend_config" in attrs:
            cfg = attrs["mhlo.backend_config"]
            found.append((bytes(cfg["ir"].value_bytes), int(cfg["num_warps"].value),
                          int(cfg["num_stages"].value)))
          walk(child.operation)
  walk(module.operation)
  return found


def _ptxas() -> str | None:
  import importlib.util
  spec = importlib.util.find_spec("nvidia")
  wheel = [p for d in (spec.submodule_search_locations if spec else [])
           for p in glob.glob(os.path.join(d, "cuda_nvcc", "bin", "ptxas"))]
  return shutil.which("ptxas") or (wheel[0] if wheel else None)


def ptx(model_cfg, *, batches, ctx: int, page_size: int, arch: str = "9.0") -> dict:
  from jax._src.lib import triton
  jax.devices()  # initialises the backends, and with them the CUDA plugin if installed
  if not triton.has_compilation_handler("CUDA"):
    raise RuntimeError("no Triton compiler for CUDA: install jax-cuda12-plugin and "
                       f"jax-cuda12-pjrt {jax.__version__} (no GPU needed)")
  c, ptxas, rows = model_cfg, _ptxas(), []
  s = jax.ShapeDtypeStruct
  for batch in batches:
    w = ctx // page_size
    pool = s((c.num_kv_heads, 1 + batch * w, page_size, c.head_dim), jnp.bfloat16)
    args = (s((batch, c.num_heads, c.head_dim), jnp.bfloat16), pool, pool,
            s((batch, w), jnp.int32), s((batch,), jnp.int32))
    for tpb, programs, warps, stages in TILINGS:
      fn = functools.partial(kernel_lib.paged_attention, tokens_per_block=tpb,
                             min_programs=programs, num_warps=warps, num_stages=stages,
                             interpret=False)
      [(module, warps, stages)] = _triton_calls(fn, args)
      out = triton.compile("CUDA", module, arch, num_warps=warps, num_ctas=1,
                           num_stages=stages)
      row = dict(batch=batch, tokens_per_block=tpb, min_programs=programs,
                 num_warps=warps, num_stages=stages, arch=arch, smem_bytes=out.smem_bytes,
                 ptx_chars=len(out.asm))
      if ptxas:
        target = re.search(r"\.target\s+(\w+)", out.asm).group(1)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
          f.write(out.asm)
          f.flush()
          log = subprocess.run([ptxas, f"-arch={target}", "-v", f.name, "-o", os.devnull],
                               capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", log)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        row.update(registers=int(regs.group(1)) if regs else None,
                   spill_bytes=sum(map(int, spills.groups())) if spills else None,
                   ptxas_target=target)
      rows.append(row)
  return dict(ptxas=ptxas, rows=rows)

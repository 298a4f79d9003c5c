"""Timed measurements of rl_jax's own programs on one device, and the device probes
they are judged against.

Probes. Copy bandwidth is a jitted `jnp.copy` of one large bf16 array, counted as
bytes read + bytes written (2 x size) per copy, the way device-to-device copy figures
are quoted. Peak is a jitted bf16 n x n x n matmul at 2 n^3 FLOPs.

Decode. An Engine with `batch` slots, each holding about `ctx` cached tokens (pages
filled with zeros: decode cost does not depend on the values), runs `steps_per_call`
steps per generate call with temperature-1 sampling, as the RL sampler does. The
memory floor of one step is
  bytes_step = weight bytes + batch x mean cached tokens x KV bytes per token,
  KV bytes per token = 2 (K and V) x layers x kv heads x head_dim x itemsize,
and roofline_frac = (bytes_step / copy bandwidth) / measured step time.

Long-tail decode. The same engine with most slots short (ctx / 8 cached tokens) and
one slot in eight near `ctx`, as in RL rollouts late in a batch. Its floor counts only
the KV positions slots really hold; `pages_read_frac` is the share of the page-table
columns read per step that hold live tokens (1.0 would mean reading only live pages).

Every fraction is given against this run's probe (`mfu`, `roofline_frac`,
`frac_of_copy`) and, suffixed `_ref`, against a reference figure from the command line
(DESIGN.md's H200 numbers by default).

Prefill. Engine.prefill of one prompt of `length` tokens (batch 1, as the generator
prefills once per group). Model FLOPs = length x (2 N_mm + 2 L length H D_h), N_mm
without the embedding and the vocabulary projection (prefill computes no logits).

Train. rl_jax.bench.trainer.run_train_benchmark, whose FLOPs formula gives MFU, with
the suite's remat policy, micro-batch rows and lm-head chunk length.

Weight sync. WeightSync.transfer of the whole model, colocated on one device: fp32
trainer params -> sampler dtype. The least traffic it can do is reading the fp32
master once and writing the sampler copy once, so its effective bandwidth is
(fp32 bytes + sampler bytes) / time, compared with the copy probe. A one-pass jitted
cast of the same tree is timed as the plain-JAX floor.
"""
from __future__ import annotations

import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.orchestration.weight_sync import WeightSync
from rl_jax.sampler import engine as engine_lib
from rl_jax.sampler import page_table as pt
from rl_jax.bench import trainer as train_bench

# configs/base.py's trainer section, as a plain namespace: the benchmark path must not
# need ml_collections (tests/test_bench.py checks the two agree).
TRAINER_DEFAULTS = dict(
    learning_rate=1e-4, schedule="constant", warmup_steps=0, weight_decay=0.0, b1=0.9,
    b2=0.99, grad_clip=1.0, micro_batch_size=0, logprob_chunk_len=128, num_minibatches=1,
    length_buckets=(64, 128, 256, 512, 1024, 2048, 4096), loss_agg="token_mean",
    eps_low=0.2, eps_high=0.28, tis_cap=2.0, ratio_level="token", std_normalize=True,
    kl_beta=0.0, kl_estimator="k3", loss_norm_len=0, logprob_save_bytes=4 * 2**30,
    packing="auto")


def trainer_config(**overrides) -> types.SimpleNamespace:
  """configs/base.py's trainer fields, except packing: the bench trains full rows, where
  packing gains nothing, so it measures the padded-rows step (the reference's)."""
  return types.SimpleNamespace(**{**TRAINER_DEFAULTS, "packing": "off", **overrides})


def one_device_mesh():
  return shd.make_mesh((1, 1, 1), jax.devices()[:1])


def tree_bytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def kv_bytes_per_token(model_cfg, dtype: str) -> int:
  c = model_cfg
  return pt.kv_bytes_per_token(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                               head_dim=c.head_dim, dtype_bytes=jnp.dtype(dtype).itemsize)


def _seconds_per_call(fn, repeats: int) -> float:
  """Mean seconds of `repeats` back-to-back calls after one untimed (compiling) call;
  the calls are queued asynchronously and waited for once, so dispatch overlaps."""
  jax.block_until_ready(fn())
  t0 = time.perf_counter()
  for _ in range(repeats):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / repeats


def copy_bandwidth(*, nbytes: int, repeats: int) -> dict:
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  copy = jax.jit(jnp.copy)
  s = _seconds_per_call(lambda: copy(x), repeats)
  return dict(copy_bytes=int(x.nbytes), copy_ms=1e3 * s, copy_gbps=2 * x.nbytes / s / 1e9)


def matmul_peak(*, n: int, repeats: int) -> dict:
  ka, kb = jax.random.split(jax.random.key(0))
  a = (jax.random.normal(ka, (n, n), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
  b = (jax.random.normal(kb, (n, n), jnp.float32) / np.sqrt(n)).astype(jnp.bfloat16)
  matmul = jax.jit(jnp.matmul)
  s = _seconds_per_call(lambda: matmul(a, b), repeats)
  return dict(matmul_n=n, matmul_ms=1e3 * s, matmul_tflops=2 * n ** 3 / s / 1e12)


def sampler_params(model_cfg, mesh, dtype: str):
  """Random weights in the sampler's dtype and shardings (any Engine on `mesh` with
  this model and dtype places its params the same way)."""
  engine = engine_lib.Engine(model_cfg, mesh=mesh, max_concurrent_decodes=1, page_size=16,
                             num_pages=2, max_prefill_length=16, max_new_tokens=1,
                             dtype=dtype)
  return engine.load_params(rng=jax.random.key(0))


def decode_engine(model_cfg, mesh, *, batch: int, ctx: int, page_size: int,
                  steps_per_call: int, dtype: str,
                  attention: str = "auto") -> engine_lib.Engine:
  """An engine whose page table spans exactly `ctx` positions per slot."""
  if ctx % page_size:
    raise ValueError(f"--ctx ({ctx}) must be a multiple of --page-size ({page_size})")
  half = ctx // 2
  return engine_lib.Engine(
      model_cfg, mesh=mesh, max_concurrent_decodes=batch, page_size=page_size,
      num_pages=1 + batch * (ctx // page_size), max_prefill_length=half,
      max_new_tokens=ctx - half, dtype=dtype, steps_per_call=steps_per_call, stop_ids=(),
      attention=attention)


def decode(model_cfg, params, mesh, *, batch: int, ctx: int, page_size: int,
           steps_per_call: int, calls: int, dtype: str, copy_gbps: float | None,
           ref_gbps: float, attention: str = "auto") -> dict:
  engine = decode_engine(model_cfg, mesh, batch=batch, ctx=ctx, page_size=page_size,
                         steps_per_call=steps_per_call, dtype=dtype, attention=attention)
  pages_per_slot = ctx // page_size
  # Start late enough that the warm-up call and the timed calls end inside ctx.
  start = ctx - (calls + 1) * steps_per_call - 1
  if start < 1:
    raise ValueError(f"--ctx ({ctx}) must exceed (--decode-calls + 1) x --steps-per-call "
                     f"+ 1 = {(calls + 1) * steps_per_call + 1}")
  entries = [dict(slot=i, pages=list(range(1 + i * pages_per_slot, 1 + (i + 1) * pages_per_slot)),
                  token=3, length=start, max_new_tokens=2 ** 30, stop_on_eos=False, seed=i,
                  sample_index=0, sampling=engine_lib.Sampling())
             for i in range(batch)]
  state = engine.insert_many(engine.init_decode_state(), entries)
  state, out = engine.generate(params, state)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(calls):
    state, out = engine.generate(params, state)
  jax.block_until_ready(out)
  step_s = (time.perf_counter() - t0) / (calls * steps_per_call)
  # Each step attends over the cached tokens plus the new one.
  mean_len = start + steps_per_call + (calls * steps_per_call - 1) / 2 + 1
  weight_bytes = tree_bytes(params)
  kv_bytes = batch * mean_len * kv_bytes_per_token(model_cfg, dtype)
  bytes_step = weight_bytes + kv_bytes
  row = dict(batch=batch, ctx=ctx, page_size=page_size, steps_per_call=steps_per_call,
             attention=engine.attention, step_ms=1e3 * step_s, tokens_per_s=batch / step_s,
             weight_bytes=weight_bytes, kv_bytes_per_step=int(kv_bytes),
             bytes_per_step=int(bytes_step))
  if ref_gbps:
    row["ref_floor_ms"] = 1e3 * bytes_step / (ref_gbps * 1e9)
    row["roofline_frac_ref"] = bytes_step / (ref_gbps * 1e9) / step_s
  if copy_gbps:
    row["floor_ms"] = 1e3 * bytes_step / (copy_gbps * 1e9)
    row["roofline_frac"] = bytes_step / (copy_gbps * 1e9) / step_s
  return row


def _filled_state(engine, lengths):
  pages_per_slot = engine.pages_per_seq
  entries = [dict(slot=i, pages=list(range(1 + i * pages_per_slot, 1 + (i + 1) * pages_per_slot)),
                  token=3, length=int(n), max_new_tokens=2 ** 30, stop_on_eos=False, seed=i,
                  sample_index=0, sampling=engine_lib.Sampling())
             for i, n in enumerate(lengths)]
  return engine.insert_many(engine.init_decode_state(), entries)


def decode_long_tail(model_cfg, params, mesh, *, batch: int, ctx: int, page_size: int,
                     steps_per_call: int, calls: int, dtype: str, copy_gbps: float | None,
                     ref_gbps: float, attention: str = "auto") -> dict:
  engine = decode_engine(model_cfg, mesh, batch=batch, ctx=ctx, page_size=page_size,
                         steps_per_call=steps_per_call, dtype=dtype, attention=attention)
  long_len = ctx - (calls + 1) * steps_per_call - 1
  lengths = np.full((batch,), max(ctx // 8, 1), np.int64)
  lengths[::8] = long_len  # one slot in eight near the maximum
  state = _filled_state(engine, lengths)
  width = engine.page_bucket(int(lengths.max()) + (calls + 1) * steps_per_call)
  counts = [pt.pages_for(int(n) + steps_per_call * (calls + 1), page_size) for n in lengths]
  live_pages = sum(counts)
  # With ragged attention: the cells busy slots read (the generator passes the same).
  live = (np.repeat(np.arange(batch), counts), np.concatenate([np.arange(c) for c in counts]))
  state, out = engine.generate(params, state, num_pages=width, live=live)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(calls):
    state, out = engine.generate(params, state, num_pages=width, live=live)
  jax.block_until_ready(out)
  step_s = (time.perf_counter() - t0) / (calls * steps_per_call)
  mean_len = float(lengths.mean()) + steps_per_call + (calls * steps_per_call - 1) / 2 + 1
  read = (next(u for u in engine.live_buckets if u >= live_pages)
          if engine.attention == "ragged" else batch * width)
  weight_bytes = tree_bytes(params)
  bytes_step = weight_bytes + batch * mean_len * kv_bytes_per_token(model_cfg, dtype)
  row = dict(batch=batch, ctx=ctx, attention=engine.attention,
             short_len=int(lengths[1]) if batch > 1 else None,
             long_len=long_len, long_slots=int((lengths == long_len).sum()),
             page_width=width, pages_read_frac=live_pages / read,
             step_ms=1e3 * step_s, tokens_per_s=batch / step_s, bytes_per_step=int(bytes_step))
  if ref_gbps:
    row["roofline_frac_ref"] = bytes_step / (ref_gbps * 1e9) / step_s
  if copy_gbps:
    row["roofline_frac"] = bytes_step / (copy_gbps * 1e9) / step_s
  return row


def prefill_flops(model_cfg, length: int) -> float:
  c = model_cfg
  n_mm = model.num_params(c) - c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2)
  return float(length) * (2 * n_mm + 2 * c.num_layers * length * c.num_heads * c.head_dim)


def prefill(model_cfg, params, mesh, *, length: int, page_size: int, repeats: int,
            dtype: str, peak_tflops: float | None, ref_tflops: float) -> dict:
  engine = engine_lib.Engine(
      model_cfg, mesh=mesh, max_concurrent_decodes=1, page_size=page_size,
      num_pages=1 + pt.pages_for(length + 1, page_size), max_prefill_length=length,
      max_new_tokens=1, dtype=dtype)
  tokens_t = jnp.asarray(np.random.default_rng(0).integers(
      3, min(model_cfg.vocab_size, 128), length), jnp.int32)
  s = _seconds_per_call(
      lambda: engine.prefill(params=params, padded_tokens=tokens_t, true_length=length),
      repeats)
  flops = prefill_flops(model_cfg, length)
  row = dict(length=length, ms=1e3 * s, tokens_per_s=length / s,
             achieved_tflops=flops / s / 1e12)
  if ref_tflops:
    row["mfu_ref"] = flops / s / (ref_tflops * 1e12)
  if peak_tflops:
    row["mfu"] = flops / s / (peak_tflops * 1e12)
  return row


def train(model_cfg, *, batch: int, seq: int, steps: int, warmup: int, dtype: str,
          remat: str, micro_batch: int, logprob_chunk_len: int, peak_tflops: float | None,
          ref_tflops: float) -> dict:
  cfg = trainer_config(micro_batch_size=micro_batch, logprob_chunk_len=logprob_chunk_len)
  row = train_bench.run_train_benchmark(
      model_cfg.replace(dtype=dtype, remat=remat), cfg, mesh_shape=(1, 1, 1),
      batch=batch, seq_len=seq, steps=steps, warmup=warmup)
  if ref_tflops:
    row["mfu_ref"] = row["achieved_tflops"] / ref_tflops
  if peak_tflops:
    row["mfu"] = row["achieved_tflops"] / peak_tflops
  return row


def weight_sync(model_cfg, mesh, *, dtype: str, repeats: int,
                copy_gbps: float | None) -> dict:
  master_cfg = model_cfg.replace(dtype="float32", param_dtype="float32")
  shapes = jax.eval_shape(lambda: model.init_params(master_cfg, jax.random.key(0)))
  axes = model.param_logical_axes(master_cfg)
  trainer_sh = shd.tree_shardings(axes, shapes, mesh, shd.TRAIN_RULES)
  params = jax.jit(lambda k: model.init_params(master_cfg, k), out_shardings=trainer_sh)(
      jax.random.key(0))
  sync = WeightSync(logical_axes=axes, param_shapes=shapes, trainer_shardings=trainer_sh,
                    sampler_mesh=mesh, sampler_dtype=dtype, colocated=True)
  moved, _ = sync.transfer(params, 0)
  del moved
  times = []
  for v in range(repeats):
    moved, stats = sync.transfer(params, v + 1)
    times.append(stats.duration_s)
    del moved
  s = float(np.median(times))
  traffic = tree_bytes(params) + sync.bytes
  target = jnp.dtype(dtype)
  cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(target), p),
                 in_shardings=(trainer_sh,), out_shardings=sync.sampler_shardings)
  cast_s = _seconds_per_call(lambda: cast(params), repeats)
  row = dict(master_bytes=tree_bytes(params), sampler_bytes=int(sync.bytes),
             ms_p50=1e3 * s, effective_gbps=traffic / s / 1e9,
             plain_cast_ms=1e3 * cast_s, plain_cast_gbps=traffic / cast_s / 1e9,
             ratio_over_plain_cast=cast_s / s)
  if copy_gbps:
    row["frac_of_copy"] = traffic / s / 1e9 / copy_gbps
  return row

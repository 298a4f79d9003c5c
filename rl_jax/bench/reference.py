"""The plain-JAX reference the benchmark suite compares rl_jax with (its "anchor" section).

A deliberately direct implementation of the same model family (RMSNorm, RoPE, GQA
attention, SwiGLU MLP) with nothing of rl_jax in it: what a careful user would write in
plain JAX. Each figure is measured on the device the suite runs on, at the suite's shapes:

  decode-dense          one greedy decode step per token over a dense KV cache
                        k/v_lbktd [L, B, KVH, CTX, HD]; layers unrolled in Python, STEPS
                        steps per jitted call (lax.fori_loop), the cache donated
  decode-paged-gather   the same step over a paged cache k/v_lnkpd [L, pages, KVH, PAGE, HD]
                        read through a page table (gather, then dense attention)
  train-step-fp32-params  a GRPO-shaped update: fp32 master params cast to DTYPE, forward
                        over [TRAIN_B, TRAIN_T] (layers rematerialised), token log-probs,
                        the ratio loss -mean(A * r * m) with r = exp(logp - stop_gradient(
                        logp)), and Adam
  param-copy-d2d        a jitted copy of the DTYPE weights (read + write bytes / time)

It follows the anchor contract of rl_jax/bench/anchor.py: the shapes are module constants
the loader overrides (V, D, L, H, KVH, HD, F, BATCHES, CTX, PAGE, TRAIN_B, TRAIN_T), BW
(bytes/s) and PEAK (FLOP/s) normalise the roofline and MFU columns, and `main()` writes
{"nparam", "rows"} to $OUT/anchor.json. `--anchor PATH` runs another such script instead.
Roofline of a decode step = (weight bytes + KV bytes read) / BW.
"""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

V, D, L, H, KVH, HD, F = 128, 64, 2, 4, 2, 16, 256
BATCHES, CTX, PAGE = [4], 64, 16
TRAIN_B, TRAIN_T = 2, 32
BW, PEAK = 1e12, 1e14
DTYPE = jnp.bfloat16
STEPS = 8  # decode steps per jitted call
REPEATS = 5  # timed calls per figure (the median is reported)
EPS, THETA = 1e-6, 10000.0


def init(key, dtype):
  """Random weights; layers stacked on a leading L axis. Linear weights are [in, out]."""
  ks = jax.random.split(key, 8)
  n = lambda k, shape, fan: (jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan)).astype(dtype)
  return dict(
      embed=n(ks[0], (V, D), 1.0), head=n(ks[1], (D, V), D),
      norm=jnp.ones((D,), dtype), ln1=jnp.ones((L, D), dtype), ln2=jnp.ones((L, D), dtype),
      wq=n(ks[2], (L, D, H * HD), D), wk=n(ks[3], (L, D, KVH * HD), D),
      wv=n(ks[4], (L, D, KVH * HD), D), wo=n(ks[5], (L, H * HD, D), H * HD),
      wg=n(ks[6], (L, D, F), D), wu=n(ks[7], (L, D, F), D),
      wd=n(jax.random.fold_in(key, 9), (L, F, D), F))


def rms(x, w):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + EPS)).astype(x.dtype) * w


def rope(x, pos):
  """x [..., T, n, HD] rotated by positions pos [..., T] (half-split convention)."""
  freq = THETA ** (-jnp.arange(0, HD, 2, dtype=jnp.float32) / HD)
  ang = pos[..., None].astype(jnp.float32) * freq  # [..., T, HD/2]
  cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]
  a, b = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)


def mlp(p, i, x):
  h = rms(x, p["ln2"][i])
  return x + (jax.nn.silu(h @ p["wg"][i]) * (h @ p["wu"][i])) @ p["wd"][i]


def attend(q_bhd, k_bktd, v_bktd, valid_bt):
  """One query per sequence against its cache; GQA by grouping the H query heads."""
  b = q_bhd.shape[0]
  q = q_bhd.reshape(b, KVH, H // KVH, HD).astype(jnp.float32)
  s = jnp.einsum("bkgd,bktd->bkgt", q, k_bktd.astype(jnp.float32)) / np.sqrt(HD)
  s = jnp.where(valid_bt[:, None, None, :], s, -1e30)
  o = jnp.einsum("bkgt,bktd->bkgd", jax.nn.softmax(s, -1), v_bktd.astype(jnp.float32))
  return o.reshape(b, H * HD).astype(q_bhd.dtype)


def decode_step(p, tok_b, pos, cache, read, write):
  """Next greedy tokens. `write(cache, i, k, v, pos)` stores layer i's new k/v [B, KVH, HD];
  `read(cache, i)` returns its keys and values [B, KVH, CTX, HD]."""
  x = p["embed"][tok_b]
  b = tok_b.shape[0]
  posv = jnp.full((b, 1), pos)
  valid = jnp.arange(CTX)[None, :] <= pos
  for i in range(L):  # unrolled
    h = rms(x, p["ln1"][i])
    q = rope((h @ p["wq"][i]).reshape(b, 1, H, HD), posv)[:, 0]
    k = rope((h @ p["wk"][i]).reshape(b, 1, KVH, HD), posv)[:, 0]
    v = (h @ p["wv"][i]).reshape(b, KVH, HD)
    cache = write(cache, i, k, v, pos)
    kc, vc = read(cache, i)
    x = mlp(p, i, x + attend(q, kc, vc, jnp.broadcast_to(valid, (b, CTX))) @ p["wo"][i])
  return jnp.argmax(rms(x, p["norm"]) @ p["head"], -1).astype(jnp.int32), cache


def dense_cache(b, dtype):
  shape = (L, b, KVH, CTX, HD)  # k and v in separate buffers: both are donated
  return dict(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def dense_write(cache, i, k, v, pos):
  at = (i, 0, 0, pos, 0)
  return dict(k=jax.lax.dynamic_update_slice(cache["k"], k[None, :, :, None], at),
              v=jax.lax.dynamic_update_slice(cache["v"], v[None, :, :, None], at))


def dense_read(cache, i):
  return cache["k"][i], cache["v"][i]


def paged_cache(b, dtype):
  """Pages shuffled so that a sequence's pages are not contiguous (as in a real pool)."""
  per_seq = CTX // PAGE
  shape = (L, b * per_seq, KVH, PAGE, HD)
  table = np.random.default_rng(0).permutation(b * per_seq).reshape(b, per_seq)
  return dict(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
              table=jnp.asarray(table, jnp.int32))


def paged_write(cache, i, k, v, pos):
  page = cache["table"][:, pos // PAGE]
  off = pos % PAGE
  return dict(cache, k=cache["k"].at[i, page, :, off].set(k),
              v=cache["v"].at[i, page, :, off].set(v))


def paged_read(cache, i):
  b, per_seq = cache["table"].shape
  gather = lambda x: x[i][cache["table"]].transpose(0, 2, 1, 3, 4).reshape(b, KVH, CTX, HD)
  return gather(cache["k"]), gather(cache["v"])


def make_decoder(read, write):
  def run(p, tok_b, cache, start):
    def body(s, carry):
      tok, cache = carry
      return decode_step(p, tok, (start + s) % CTX, cache, read, write)
    return jax.lax.fori_loop(0, STEPS, body, (tok_b, cache))
  return jax.jit(run, donate_argnums=(2,))


def train_layer(p, i, x):
  """Layer i over a whole sequence x [B, T, D] with causal attention."""
  b, t, _ = x.shape
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  h = rms(x, p["ln1"][i])
  q = rope((h @ p["wq"][i]).reshape(b, t, H, HD), pos)
  k = rope((h @ p["wk"][i]).reshape(b, t, KVH, HD), pos)
  v = (h @ p["wv"][i]).reshape(b, t, KVH, HD)
  q = q.reshape(b, t, KVH, H // KVH, HD).astype(jnp.float32)
  s = jnp.einsum("bqkgd,bskd->bkgqs", q, k.astype(jnp.float32)) / np.sqrt(HD)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
  o = jnp.einsum("bkgqs,bskd->bqkgd", jax.nn.softmax(s, -1), v.astype(jnp.float32))
  return mlp(p, i, x + o.reshape(b, t, H * HD).astype(x.dtype) @ p["wo"][i])


def forward(p, tok_bt, remat=False):
  """Logits [B, T, V] (training: no cache); `remat` recomputes each layer in the backward
  pass instead of keeping its [B, KVH, G, T, T] attention weights."""
  layer = jax.checkpoint(train_layer, static_argnums=(1,)) if remat else train_layer
  x = p["embed"][tok_bt]
  for i in range(L):
    x = layer(p, i, x)
  return (rms(x, p["norm"]) @ p["head"]).astype(jnp.float32)


def train_step(master, m, v, tok_bt, adv_b, mask_bt, lr=1e-5):
  """One GRPO-shaped Adam update of fp32 master params; returns (master, m, v, loss)."""
  def loss_fn(w):
    logits = forward(jax.tree.map(lambda x: x.astype(DTYPE), w), tok_bt, remat=True)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tok_bt[:, 1:, None], -1)[..., 0]
    ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
    mk = mask_bt[:, 1:]
    return -jnp.sum(adv_b[:, None] * ratio * mk) / jnp.maximum(mk.sum(), 1)
  loss, g = jax.value_and_grad(loss_fn)(master)
  m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
  v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
  master = jax.tree.map(lambda w, a, b: w - lr * a / (jnp.sqrt(b) + 1e-8), master, m, v)
  return master, m, v, loss


def _median_s(fn, repeats=REPEATS):
  jax.block_until_ready(fn())  # compile and warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _decode_row(kind, p, wbytes, b, make_cache, read, write):
  run = make_decoder(read, write)
  state = {"cache": make_cache(b, DTYPE), "tok": jnp.zeros((b,), jnp.int32), "start": 0}

  def call():
    state["tok"], state["cache"] = run(p, state["tok"], state["cache"], state["start"])
    state["start"] = (state["start"] + STEPS) % CTX
    return state["tok"]
  t = _median_s(call) / STEPS
  kv_read = 2 * L * b * KVH * CTX * HD * jnp.dtype(DTYPE).itemsize
  return dict(kind=kind, B=b, ctx=CTX, step_ms=t * 1e3, tok_s=b / t,
              roofline_frac=(wbytes + kv_read) / BW / t)


def main():
  p = init(jax.random.key(0), DTYPE)
  nparam = int(sum(x.size for x in jax.tree.leaves(p)))
  wbytes = nparam * jnp.dtype(DTYPE).itemsize
  rows = []
  for b in BATCHES:
    rows.append(_decode_row("decode-dense", p, wbytes, b, dense_cache, dense_read, dense_write))
    rows.append(_decode_row("decode-paged-gather", p, wbytes, b, paged_cache, paged_read,
                            paged_write))
  master = init(jax.random.key(1), jnp.float32)
  zeros = jax.tree.map(jnp.zeros_like, master)
  rng = np.random.default_rng(0)
  tok = jnp.asarray(rng.integers(0, V, (TRAIN_B, TRAIN_T)), jnp.int32)
  adv = jnp.asarray(rng.normal(size=TRAIN_B), jnp.float32)
  mask = jnp.ones((TRAIN_B, TRAIN_T), jnp.float32)
  step = jax.jit(train_step, donate_argnums=(0, 1, 2))
  state = [master, zeros, jax.tree.map(jnp.zeros_like, master)]

  def train_call():
    master, m, v, loss = step(*state, tok, adv, mask)
    state[:] = [master, m, v]
    return loss
  t = _median_s(train_call)
  ntok = TRAIN_B * TRAIN_T
  flops = 6 * nparam * ntok + 6 * L * H * HD * TRAIN_T * ntok  # matmuls + attention, fwd+bwd
  rows.append(dict(kind="train-step-fp32-params", B=TRAIN_B, T=TRAIN_T, step_ms=t * 1e3,
                   tok_s=ntok / t, mfu=flops / t / PEAK))
  copy = jax.jit(lambda w: jax.tree.map(lambda x: x * jnp.asarray(1, x.dtype), w))
  t = _median_s(lambda: copy(p))
  rows.append(dict(kind="param-copy-d2d", bytes=wbytes, ms=t * 1e3, GBps=2 * wbytes / t / 1e9))
  result = dict(nparam=nparam, rows=rows)
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, "anchor.json"), "w") as f:
      json.dump(result, f, indent=1)
  return result

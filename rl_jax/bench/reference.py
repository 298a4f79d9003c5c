"""The plain-JAX reference the benchmark suite compares rl_jax with (its "anchor" section).

A deliberately direct implementation of the same model family (RMSNorm, RoPE, GQA
attention, SwiGLU MLP) with nothing of rl_jax in it: what a careful user would write in
plain JAX for an accelerator. Weights are a list of per-layer dicts and every layer loop
is a Python loop (unrolled in the program). Matmuls take DTYPE operands and accumulate
in float32 (preferred_element_type), attention scores and softmax are float32, and no
cache is ever upcast. Each figure is measured on the device the suite runs on, at the
suite's shapes:

  decode-dense          one greedy decode step per token: per-layer caches k/v [B, KVH,
                        CTX, HD], the new K/V scattered at each slot's own position,
                        masked dense attention, argmax; STEPS steps per jitted call
                        (lax.fori_loop), the caches donated
  decode-paged-gather   the same step over per-layer page pools [KVH, pages, PAGE, HD]
                        (rl_jax's layout) read through a page table: pool[:, table]
                        gathers [KVH, B, CTX, HD] per layer, then the same attention
  train-step-bf16       a GRPO-shaped update: fp32 master params cast to DTYPE (bf16
                        unless the suite runs another dtype; the row says), forward
                        over [TRAIN_B, TRAIN_T] (layers rematerialised) with
                        jax.nn.dot_product_attention (cuDNN flash attention on GPU, XLA
                        elsewhere; the row's "attention" says which ran), token log-probs
                        from a head chunked over HEAD_CHUNK positions (no [B, T, V] fp32
                        logits), the ratio loss -sum(A r m) / sum(m) with r = exp(logp -
                        stop_gradient(logp)), and Adam
  param-copy-d2d        a jitted copy of the DTYPE weights (read + write bytes / time)

It follows the anchor contract of rl_jax/bench/anchor.py: the shapes are module constants
the loader overrides (V, D, L, H, KVH, HD, F, BATCHES, CTX, PAGE, TRAIN_B, TRAIN_T, and
STEPS, TIE, DTYPE where given), BW (bytes/s) and PEAK (FLOP/s) normalise the roofline
and MFU columns, and `main()` writes {"nparam", "rows"} to $OUT/anchor.json. The suite's
cost section compiles `decoder(kind, 1)` from `abstract_inputs(kind, b)` (no
allocation). Roofline of a decode step = (weight bytes + KV bytes read) / BW.
"""
from __future__ import annotations

import functools
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
TIE = True  # the lm head is the embedding (Qwen2.5-0.5B, Llama 3.2 1B)
STEPS = 16  # decode steps per jitted call: rl_jax's (the suite sets its own)
HEAD_CHUNK = 128  # train-step positions per lm-head chunk
REPEATS = 5  # timed calls per figure (the median is reported)
EPS, THETA = 1e-6, 10000.0
KINDS = ("decode-dense", "decode-paged-gather")


def init(key, dtype):
  """Random weights: embed [V, D], head [D, V] unless TIE, norm [D], and per layer
  wq [D, H HD], wk / wv [D, KVH HD], wo [H HD, D], wg / wu [D, F], wd [F, D], ln1/ln2."""
  keys = iter(jax.random.split(key, 2 + 7 * L))
  n = lambda shape, fan: (jax.random.normal(next(keys), shape, jnp.float32) /
                          np.sqrt(fan)).astype(dtype)
  p = dict(embed=n((V, D), 1.0), norm=jnp.ones((D,), dtype))
  head = n((D, V), D)
  if not TIE:
    p["head"] = head
  p["layers"] = [dict(wq=n((D, H * HD), D), wk=n((D, KVH * HD), D), wv=n((D, KVH * HD), D),
                      wo=n((H * HD, D), H * HD), wg=n((D, F), D), wu=n((D, F), D),
                      wd=n((F, D), F), ln1=jnp.ones((D,), dtype), ln2=jnp.ones((D,), dtype))
                 for _ in range(L)]
  return p


def mm(x, w):
  """x @ w with float32 accumulation, result in x's dtype."""
  return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


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


def mlp(lp, x):
  h = rms(x, lp["ln2"])
  return x + mm(jax.nn.silu(mm(h, lp["wg"])) * mm(h, lp["wu"]), lp["wd"])


def head_weight(p):
  """[D, V]: the tied embedding's transpose or the separate head."""
  return p["head"] if "head" in p else p["embed"].T


def attend(q_bhd, k, v, pos_b, kv):
  """One query per slot against its first pos_b + 1 cached positions (GQA: the H query
  heads in KVH groups); K and V laid out as `kv` ("bktd" or "kbtd"). Scores and softmax
  in float32; K and V stay in their dtype."""
  b, t = q_bhd.shape[0], k.shape[2]
  q = q_bhd.reshape(b, KVH, H // KVH, HD)
  s = jnp.einsum(f"bkgd,{kv}->bkgt", q, k, preferred_element_type=jnp.float32) * HD ** -0.5
  s = jnp.where((jnp.arange(t)[None, :] <= pos_b[:, None])[:, None, None, :], s, -1e30)
  a = jax.nn.softmax(s, -1).astype(v.dtype)
  o = jnp.einsum(f"bkgt,{kv}->bkgd", a, v, preferred_element_type=jnp.float32)
  return o.reshape(b, H * HD).astype(q_bhd.dtype)


def dense_cache(b, dtype):
  """Per-layer caches: k and v, each a list of L [B, KVH, CTX, HD] arrays."""
  z = lambda: jnp.zeros((b, KVH, CTX, HD), dtype)
  return dict(k=[z() for _ in range(L)], v=[z() for _ in range(L)])


def dense_layer(cache, i, k_bkd, v_bkd, pos_b):
  """Writes layer i's new K/V at each slot's position; returns (cache, K, V [B, KVH, CTX, HD])."""
  rows = jnp.arange(k_bkd.shape[0])
  kc = cache["k"][i].at[rows, :, pos_b].set(k_bkd)
  vc = cache["v"][i].at[rows, :, pos_b].set(v_bkd)
  cache = dict(k=cache["k"][:i] + [kc] + cache["k"][i + 1:],
               v=cache["v"][:i] + [vc] + cache["v"][i + 1:])
  return cache, kc, vc


def paged_cache(b, dtype):
  """Per-layer pools [KVH, 1 + B CTX/PAGE, PAGE, HD] (page 0 unused) and a page table
  [B, CTX/PAGE], pages shuffled so that a sequence's pages are not contiguous."""
  per_seq = CTX // PAGE
  n = 1 + b * per_seq
  table = 1 + np.random.default_rng(0).permutation(b * per_seq).reshape(b, per_seq)
  z = lambda: jnp.zeros((KVH, n, PAGE, HD), dtype)
  return dict(k=[z() for _ in range(L)], v=[z() for _ in range(L)],
              table=jnp.asarray(table, jnp.int32))


def paged_layer(cache, i, k_bkd, v_bkd, pos_b):
  """The same as dense_layer through the page table: scatter into each slot's page,
  then gather the slot's pages (an XLA gather) as K, V [KVH, B, CTX, HD]."""
  table = cache["table"]
  b, per_seq = table.shape
  page_b = jnp.take_along_axis(table, (pos_b // PAGE)[:, None], 1)[:, 0]
  off_b = pos_b % PAGE
  kp = cache["k"][i].at[:, page_b, off_b].set(k_bkd.transpose(1, 0, 2))
  vp = cache["v"][i].at[:, page_b, off_b].set(v_bkd.transpose(1, 0, 2))
  cache = dict(cache, k=cache["k"][:i] + [kp] + cache["k"][i + 1:],
               v=cache["v"][:i] + [vp] + cache["v"][i + 1:])
  gather = lambda pool: pool[:, table].reshape(KVH, b, per_seq * PAGE, HD)
  return cache, gather(kp), gather(vp)


# kind -> (cache constructor, layer write + read, layout of the K / V it reads)
CACHES = {"decode-dense": (dense_cache, dense_layer, "bktd"),
          "decode-paged-gather": (paged_cache, paged_layer, "kbtd")}


def decode_step(p, tok_b, pos_b, cache, layer_fn, kv):
  """Greedy next tokens [B] for inputs tok_b at positions pos_b, and the new cache."""
  x = p["embed"][tok_b]
  b = tok_b.shape[0]
  for i, lp in enumerate(p["layers"]):
    h = rms(x, lp["ln1"])
    q = rope(mm(h, lp["wq"]).reshape(b, 1, H, HD), pos_b[:, None])[:, 0]
    k = rope(mm(h, lp["wk"]).reshape(b, 1, KVH, HD), pos_b[:, None])[:, 0]
    v = mm(h, lp["wv"]).reshape(b, KVH, HD)
    cache, kc, vc = layer_fn(cache, i, k, v, pos_b)
    x = mlp(lp, x + mm(attend(q, kc, vc, pos_b, kv), lp["wo"]))
  logits = jnp.matmul(rms(x, p["norm"]), head_weight(p), preferred_element_type=jnp.float32)
  return jnp.argmax(logits, -1).astype(jnp.int32), cache


def decoder(kind, steps=None):
  """jit(p, tok_b, pos_b, cache) -> (tok_b, cache): `steps` (default STEPS) greedy steps
  from positions pos_b in a fori_loop, the cache donated."""
  _, layer_fn, kv = CACHES[kind]
  steps = STEPS if steps is None else steps

  def run(p, tok_b, pos_b, cache):
    def body(s, carry):
      tok, cache = carry
      return decode_step(p, tok, pos_b + s, cache, layer_fn, kv)
    return jax.lax.fori_loop(0, steps, body, (tok_b, cache))
  return jax.jit(run, donate_argnums=(3,))


def abstract_inputs(kind, b):
  """ShapeDtypeStructs of decoder(kind)'s arguments at batch b (nothing allocated)."""
  p = jax.eval_shape(functools.partial(init, dtype=DTYPE), jax.random.key(0))
  vec = jax.ShapeDtypeStruct((b,), jnp.int32)
  return p, vec, vec, jax.eval_shape(functools.partial(CACHES[kind][0], b, DTYPE))


def attention_impl() -> str:
  """The dot_product_attention implementation the train step asks for: cuDNN's fused
  flash attention on GPU, XLA's elsewhere."""
  return "cudnn" if jax.default_backend() == "gpu" else "xla"


def train_layer(lp, x, impl):
  """One layer over whole sequences x [B, T, D] with causal attention."""
  b, t, _ = x.shape
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  h = rms(x, lp["ln1"])
  q = rope(mm(h, lp["wq"]).reshape(b, t, H, HD), pos)
  k = rope(mm(h, lp["wk"]).reshape(b, t, KVH, HD), pos)
  v = mm(h, lp["wv"]).reshape(b, t, KVH, HD)
  o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  return mlp(lp, x + mm(o.reshape(b, t, H * HD), lp["wo"]))


def hidden(p, tok_bt, impl="xla"):
  """Final-norm hidden states [B, T, D]; each layer rematerialised in the backward pass."""
  layer = jax.checkpoint(train_layer, static_argnums=(2,))
  x = p["embed"][tok_bt]
  for lp in p["layers"]:
    x = layer(lp, x, impl)
  return rms(x, p["norm"])


def token_logprobs(p, x_btd, target_bt):
  """log softmax(x W)[target] [B, T] in float32, HEAD_CHUNK positions at a time: each
  chunk's [B, c, V] float32 logits exist only inside its (rematerialised) scan step."""
  b, t, _ = x_btd.shape
  c = min(HEAD_CHUNK, t)
  pad = -t % c
  x = jnp.pad(x_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, c, D).swapaxes(0, 1)
  y = jnp.pad(target_bt, ((0, 0), (0, pad))).reshape(b, -1, c).swapaxes(0, 1)
  w = head_weight(p)

  @jax.checkpoint
  def chunk(_, xy):
    z = jnp.matmul(xy[0], w, preferred_element_type=jnp.float32)  # [B, c, V]
    picked = jnp.take_along_axis(z, xy[1][..., None], -1)[..., 0]
    return None, picked - jax.nn.logsumexp(z, -1)
  _, logp = jax.lax.scan(chunk, None, (x, y))
  return logp.swapaxes(0, 1).reshape(b, -1)[:, :t]


def train_step(master, m, v, tok_bt, adv_b, mask_bt, lr=1e-5, impl="xla"):
  """One GRPO-shaped Adam update of fp32 master params; returns (master, m, v, loss)."""
  def loss_fn(w):
    wc = jax.tree.map(lambda a: a.astype(DTYPE), w)  # bf16 compute, fp32 master
    logp = token_logprobs(wc, hidden(wc, tok_bt, impl)[:, :-1], tok_bt[:, 1:])
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


def _decode_row(kind, p, wbytes, b):
  run = decoder(kind)
  # Start late enough that the warm-up and timed calls stay inside CTX; a slot holds
  # about CTX positions, as the floor below assumes.
  start = max(CTX - (REPEATS + 1) * STEPS - 1, 0)
  state = {"cache": CACHES[kind][0](b, DTYPE), "tok": jnp.zeros((b,), jnp.int32),
           "pos": start}

  def call():
    pos = jnp.full((b,), state["pos"], jnp.int32)
    state["tok"], state["cache"] = run(p, state["tok"], pos, state["cache"])
    state["pos"] = (state["pos"] + STEPS) % (CTX - STEPS + 1)
    return state["tok"]
  t = _median_s(call) / STEPS
  kv_read = 2 * L * b * KVH * CTX * HD * jnp.dtype(DTYPE).itemsize
  return dict(kind=kind, B=b, ctx=CTX, steps_per_call=STEPS, attention="xla", step_ms=t * 1e3,
              tok_s=b / t, roofline_frac=(wbytes + kv_read) / BW / t)


def _train_fn(impl):
  return jax.jit(functools.partial(train_step, impl=impl), donate_argnums=(0, 1, 2))


def _train_row(nparam):
  """The train step with attention_impl(); if that kernel does not compile (cuDNN
  rejects the shapes or dtype), XLA's attention, the reason kept in the row."""
  master = init(jax.random.key(1), jnp.float32)
  rng = np.random.default_rng(0)
  tok = jnp.asarray(rng.integers(0, V, (TRAIN_B, TRAIN_T)), jnp.int32)
  adv = jnp.asarray(rng.normal(size=TRAIN_B), jnp.float32)
  mask = jnp.ones((TRAIN_B, TRAIN_T), jnp.float32)
  impl, note = attention_impl(), ""
  state = [master, jax.tree.map(jnp.zeros_like, master), jax.tree.map(jnp.zeros_like, master)]
  args = (*state, tok, adv, mask)
  try:
    step = _train_fn(impl).lower(*args).compile()
  except Exception as e:  # noqa: BLE001  (recorded in the row, XLA attention instead)
    note = f"{impl} rejected: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    impl = "xla"
    step = _train_fn(impl).lower(*args).compile()

  def call():
    master, m, v, loss = step(*state, tok, adv, mask)
    state[:] = [master, m, v]
    return loss
  t = _median_s(call)
  ntok = TRAIN_B * TRAIN_T
  flops = 6 * nparam * ntok + 6 * L * H * HD * TRAIN_T * ntok  # matmuls + attention, fwd+bwd
  row = dict(kind="train-step-bf16", B=TRAIN_B, T=TRAIN_T, dtype=jnp.dtype(DTYPE).name,
             attention=impl,
             head_chunk=min(HEAD_CHUNK, TRAIN_T), step_ms=t * 1e3, tok_s=ntok / t,
             mfu=flops / t / PEAK)
  if note:
    row["attention_note"] = note
  return row


def main():
  p = init(jax.random.key(0), DTYPE)
  nparam = int(sum(x.size for x in jax.tree.leaves(p)))
  wbytes = nparam * jnp.dtype(DTYPE).itemsize
  rows = [_decode_row(kind, p, wbytes, b) for b in BATCHES for kind in KINDS]
  rows.append(_train_row(nparam))
  copy = jax.jit(lambda w: jax.tree.map(lambda x: x * jnp.asarray(1, x.dtype), w))
  t = _median_s(lambda: copy(p))
  rows.append(dict(kind="param-copy-d2d", bytes=wbytes, ms=t * 1e3, GBps=2 * wbytes / t / 1e9))
  result = dict(nparam=nparam, rows=rows)
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, "anchor.json"), "w") as f:
      json.dump(result, f, indent=1)
  return result

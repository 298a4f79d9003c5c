"""Rollout throughput on a long-tail length mix: recompute vs static dense vs paged
continuous batching (launch/bench.py sampler).

Shape letters: b batch rows, t sequence positions, w padded width, l layers, k kv heads,
d head_dim, v vocab.

All three methods serve the same requests (prompt, forced completion length) with the
same model, parameters and sampling (temperature 1, per-request seeds, eos ignored):
  recompute  static batches of `batch` requests, every step re-runs the whole prefix
             (no cache; widths padded to powers of two);
  static     static batches of `batch` requests over a dense KV cache of
             batch x (max_prompt + max_new) positions; a batch holds its rows until its
             longest sequence ends;
  paged      rl_jax's Generator: continuous batching over a paged pool with the same KV
             bytes as `static`, `slots` decode slots.
Latency of a rollout is from the start of the run (all requests queued at once) to its
last token. kv_pages_used is the peak number of pages held (paged) or the pages the dense
cache occupies (static). Compilation happens in an untimed warm-up pass.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.sampler import decode
from rl_jax.sampler import engine as engine_lib
from rl_jax.sampler import generator as generator_lib
from rl_jax.sampler import page_table as pt


def long_tail_requests(*, num: int, median: int, tail_frac: float, tail_mult: int,
                       prompt_len: tuple[int, int], vocab_size: int, seed: int):
  """[(prompt int32, completion length)]: most lengths uniform in [median/2, 3*median/2],
  a `tail_frac` share exactly tail_mult * median."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(max(median // 2, 1), median + median // 2 + 1, num)
  lengths[rng.random(num) < tail_frac] = tail_mult * median
  return [(rng.integers(3, vocab_size, rng.integers(prompt_len[0], prompt_len[1] + 1))
           .astype(np.int32), int(n)) for n in lengths]


def _keys(seeds_b, pos_b):
  return jax.vmap(lambda s, p: jax.random.key_data(
      jax.random.fold_in(jax.random.key(s), p)))(seeds_b, pos_b)


def _sample(logits_bv, seeds_b, pos_b):
  b = logits_bv.shape[0]
  return engine_lib.sample_tokens(
      logits_bv=logits_bv, keys_br=_keys(seeds_b, pos_b), temperature_b=jnp.ones((b,)),
      top_k_b=jnp.zeros((b,), jnp.int32), top_p_b=jnp.ones((b,)))[0]


def _recompute_step(params, tokens_bw, last_b, seeds_b, *, model_cfg):
  logits_bwv = model.apply(model_cfg, params, tokens_bw)
  return _sample(logits_bwv[jnp.arange(tokens_bw.shape[0]), last_b], seeds_b, last_b)


def _dense_prefill_attention(q_bthd, k_btkd, v_btkd, layer_cache, attn_ctx):
  del layer_cache, attn_ctx
  return model.causal_attention(q_bthd, k_btkd, v_btkd), (k_btkd, v_btkd)


def _dense_decode_attention(q_b1hd, k_b1kd, v_b1kd, layer_cache, attn_ctx):
  pos_b = attn_ctx
  b, t = layer_cache["k"].shape[:2]
  k_btkd = layer_cache["k"].at[jnp.arange(b), pos_b].set(k_b1kd[:, 0])
  v_btkd = layer_cache["v"].at[jnp.arange(b), pos_b].set(v_b1kd[:, 0])
  mask_b1t = (jnp.arange(t)[None] <= pos_b[:, None])[:, None]
  return model.gqa_attention(q_b1hd, k_btkd, v_btkd, mask_b1t), {"k": k_btkd, "v": v_btkd}


def _dense_prefill(params, cache, prompts_bt, *, model_cfg):
  t = prompts_bt.shape[1]
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), prompts_bt.shape)
  _, (k_lbtkd, v_lbtkd) = model.forward(model_cfg, params, prompts_bt, positions,
                                        attn_fn=_dense_prefill_attention)
  return {"k": cache["k"].at[:, :, :t].set(k_lbtkd), "v": cache["v"].at[:, :, :t].set(v_lbtkd)}


def _dense_step(params, cache, tokens_b, pos_b, seeds_b, *, model_cfg):
  logits_b1v, cache = model.forward(model_cfg, params, tokens_b[:, None], pos_b[:, None],
                                    attn_fn=_dense_decode_attention, cache=cache,
                                    attn_ctx=pos_b)
  return cache, _sample(logits_b1v[:, 0], seeds_b, pos_b)


def _pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def run_recompute(requests, *, params, model_cfg, mesh, batch, max_width):
  rep = shd.replicated(mesh)
  step = jax.jit(functools.partial(_recompute_step, model_cfg=model_cfg),
                 in_shardings=rep, out_shardings=rep)
  widths = sorted({_pow2(w) for w in range(1, max_width + 1)})
  for w in widths:  # compile every width outside the timed run
    step(params, np.zeros((batch, w), np.int32), np.zeros((batch,), np.int32),
         np.zeros((batch,), np.int32)).block_until_ready()
  t0, done, tokens = time.perf_counter(), [], 0
  for start in range(0, len(requests), batch):
    chunk = requests[start:start + batch]
    seqs = [list(p) for p, _ in chunk]
    want = [n for _, n in chunk]
    seeds = np.arange(start, start + batch, dtype=np.int32)
    for i in range(max(want)):
      live = [j for j in range(len(chunk)) if i < want[j]]
      w = _pow2(max(len(s) for s in seqs))
      tok = np.zeros((batch, w), np.int32)
      last = np.zeros((batch,), np.int32)
      for j, s in enumerate(seqs):
        tok[j, :len(s)] = s
        last[j] = len(s) - 1
      nxt = np.asarray(step(params, tok, last, seeds))
      now = time.perf_counter() - t0
      for j in live:
        seqs[j].append(int(nxt[j]))
        tokens += 1
        if i + 1 == want[j]:
          done.append(now)
  return time.perf_counter() - t0, tokens, done


def run_static(requests, *, params, model_cfg, mesh, batch, max_prompt, max_new):
  rep = shd.replicated(mesh)
  t_max = max_prompt + max_new
  shape = (model_cfg.num_layers, batch, t_max, model_cfg.num_kv_heads, model_cfg.head_dim)
  zeros = jax.jit(lambda: {"k": jnp.zeros(shape, jnp.float32), "v": jnp.zeros(shape, jnp.float32)},
                  in_shardings=(), out_shardings=rep)
  prefill = jax.jit(functools.partial(_dense_prefill, model_cfg=model_cfg),
                    in_shardings=rep, out_shardings=rep, donate_argnums=(1,))
  step = jax.jit(functools.partial(_dense_step, model_cfg=model_cfg),
                 in_shardings=rep, out_shardings=rep, donate_argnums=(1,))

  def one_batch(chunk, seeds, t0, done):
    cache = zeros()
    prompts = np.zeros((batch, max_prompt), np.int32)
    lens = np.ones((batch,), np.int32)
    for j, (p, _) in enumerate(chunk):
      prompts[j, :len(p)] = p
      lens[j] = len(p)
    want = [n for _, n in chunk]
    cache = prefill(params, cache, prompts)
    tokens_b = prompts[np.arange(batch), lens - 1]
    pos_b = lens - 1
    made = 0
    for i in range(max(want)):
      cache, nxt = step(params, cache, tokens_b, pos_b, seeds)
      tokens_b, pos_b = np.asarray(nxt), pos_b + 1
      now = time.perf_counter() - t0
      for j in range(len(chunk)):
        if i < want[j]:
          made += 1
          if i + 1 == want[j]:
            done.append(now)
    return made

  one_batch(requests[:batch], np.arange(batch, dtype=np.int32), time.perf_counter(), [])
  t0, done, tokens = time.perf_counter(), [], 0
  for start in range(0, len(requests), batch):
    tokens += one_batch(requests[start:start + batch],
                        np.arange(start, start + batch, dtype=np.int32), t0, done)
  return time.perf_counter() - t0, tokens, done


def run_paged(requests, *, engine, params):
  # Warm-up: the same requests once, untimed. Scheduling is deterministic, so the timed
  # run meets exactly the programs compiled here (compiling every slot x width x lane
  # variant instead would be hundreds of unused programs, and on CPU every executable
  # holds memory mappings: enough of them exhaust vm.max_map_count).
  warm = generator_lib.Generator(engine, params)
  for i, (p, n) in enumerate(requests):
    warm.add_group(i, p, 1, seed=i, max_new_tokens=n, stop_on_eos=False)
  while warm.num_active or warm.num_pending:
    warm.step()
  gen = generator_lib.Generator(engine, params)
  for i, (p, n) in enumerate(requests):
    gen.add_group(i, p, 1, seed=i, max_new_tokens=n, stop_on_eos=False)
  t0, done, tokens, peak = time.perf_counter(), [], 0, 0
  while gen.num_active or gen.num_pending:
    out = gen.step()
    peak = max(peak, gen.kv_pages_used)
    now = time.perf_counter() - t0
    for r in out:
      tokens += r.num_tokens
      done.append(now)
  return time.perf_counter() - t0, tokens, done, peak, gen.preemptions


def run_sampler_benchmark(*, preset: str, requests: int, median: int, tail_frac: float,
                          tail_mult: int, batch: int, slots: int, page_size: int,
                          steps_per_call: int, recompute_requests: int = 0,
                          seed: int = 0, layers: str = "auto") -> dict:
  """Runs the three methods on one workload; returns a flat dict of results.

  recompute_requests > 0 runs the (quadratic-cost) recompute method on only the first
  that many requests, whole static batches of the same workload.
  """
  model_cfg = model.get_preset(preset)
  mesh = shd.make_mesh((1, 1, 1), jax.devices()[:1])
  max_prompt = 16
  max_new = tail_mult * median
  reqs = long_tail_requests(num=requests, median=median, tail_frac=tail_frac,
                            tail_mult=tail_mult, prompt_len=(8, max_prompt),
                            vocab_size=min(model_cfg.vocab_size, 128), seed=seed)
  dense_tokens = batch * (max_prompt + max_new)
  num_pages = dense_tokens // page_size + 1  # same KV bytes as the dense cache
  engine = engine_lib.Engine(
      model_cfg, mesh=mesh, max_concurrent_decodes=slots, page_size=page_size,
      num_pages=num_pages, max_prefill_length=max_prompt, max_new_tokens=max_new,
      steps_per_call=steps_per_call, layers=layers)
  params = engine.load_params(rng=jax.random.key(seed))
  stacked = jax.jit(decode.stack_layers)(params)  # the dense baselines' layout

  rows = {}
  wall, tokens, done, peak, preempt = run_paged(reqs, engine=engine, params=params)
  rows["paged"] = dict(wall_s=wall, tokens=tokens, done=done, kv_pages=peak)
  wall, tokens, done = run_static(reqs, params=stacked, model_cfg=engine.model_cfg, mesh=mesh,
                                  batch=batch, max_prompt=max_prompt, max_new=max_new)
  rows["static"] = dict(wall_s=wall, tokens=tokens, done=done,
                        kv_pages=pt.pages_for(dense_tokens, page_size))
  sub = reqs[:recompute_requests] if recompute_requests else reqs
  wall, tokens, done = run_recompute(sub, params=stacked, model_cfg=engine.model_cfg,
                                     mesh=mesh, batch=batch, max_width=max_prompt + max_new)
  rows["recompute"] = dict(wall_s=wall, tokens=tokens, done=done, kv_pages=0)

  lengths = np.asarray([n for _, n in reqs])
  out = dict(device=jax.devices()[0].device_kind, preset=preset, requests=requests,
             median_len=int(np.median(lengths)), max_len=int(lengths.max()),
             tail_frac=float(np.mean(lengths == max_new)), static_batch=batch,
             paged_slots=slots, page_size=page_size, kv_pages_budget=num_pages - 1,
             steps_per_call=steps_per_call, paged_layers=engine.layers,
             paged_dtype=engine.model_cfg.dtype, paged_preemptions=preempt,
             recompute_requests=len(sub))
  for name, r in rows.items():
    lat = np.asarray(r["done"])
    out[f"{name}_tokens_per_s"] = r["tokens"] / r["wall_s"]
    out[f"{name}_wall_s"] = r["wall_s"]
    out[f"{name}_latency_p50_s"] = float(np.percentile(lat, 50))
    out[f"{name}_latency_p99_s"] = float(np.percentile(lat, 99))
    out[f"{name}_kv_pages_used"] = r["kv_pages"]
    served = lengths[:len(sub)] if name == "recompute" else lengths
    assert r["tokens"] == int(served.sum()), (name, r["tokens"], served.sum())
  out["ratio_paged_over_static"] = out["paged_tokens_per_s"] / out["static_tokens_per_s"]
  out["ratio_paged_over_recompute"] = out["paged_tokens_per_s"] / out["recompute_tokens_per_s"]
  return out

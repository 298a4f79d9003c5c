"""The peer workload (launch/bench.py sampler --peer): rl_jax's Generator at several
slot counts and steps per call, side by side in one process with google-tunix's vanilla
Sampler (one jitted while loop over a dense cache) when tunix is installed.

Workload: a Qwen2-shaped model (PEER_MODEL: 4 layers, width 256, GQA 4/2 heads, tied
embeddings, qkv bias), random weights, fp32, `requests` prompts of `prompt_len` tokens,
temperature 1, stop ids ignored. Completion lengths are "uniform" (every request
max_new tokens) or "long_tail" (bench.sampler.long_tail_requests with its maximum at
max_new). tunix serves the requests in static batches of `slots` rows, each batch as
long as its longest request; rl_jax streams them through `slots` decode slots. Tokens/s
counts requested tokens only. Each variant compiles in an untimed warm-up; the timed
runs of all variants are interleaved `repeats` times and the median is reported, so a
loaded machine distorts every variant alike.

CPU time (time.process_time, all threads of this process) is reported beside wall
time: on a shared machine it is less distorted by other processes than wall time.

Deterministic counts per rl_jax variant (Generator counters of one run): generate
calls, decode slot-steps dispatched (slots covered x steps per call), tokens kept, and
their difference, the idle slot-steps; programs compiled by the first (cold) pass and
by the timed ones (0 once warm).
"""
from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.bench import sampler as sampler_bench
from rl_jax.sampler import engine as engine_lib
from rl_jax.sampler import generator as generator_lib
from rl_jax.sampler import page_table as pt

PEER_MODEL = model.ModelConfig(
    vocab_size=2048, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=64, rope_theta=1e6, tie_embeddings=True, qkv_bias=True,
    max_position_embeddings=2048, bos_id=1, eos_id=2, pad_id=0)


def peer_requests(kind: str, *, num: int, max_new: int, prompt_len: int, vocab_size: int,
                  seed: int) -> list[tuple[np.ndarray, int]]:
  """[(prompt int32 [prompt_len], completion length)] of the named length mix."""
  if kind == "uniform":
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, vocab_size, prompt_len).astype(np.int32), max_new)
            for _ in range(num)]
  if kind == "long_tail":
    reqs = sampler_bench.long_tail_requests(
        num=num, median=max_new // 4, tail_frac=0.1, tail_mult=4,
        prompt_len=(prompt_len, prompt_len), vocab_size=vocab_size, seed=seed)
    return reqs
  raise ValueError(f"unknown length mix {kind!r}: uniform or long_tail")


class RlJaxRunner:
  """One Engine + warm-up per (slots, steps per call); `run` times one pass."""

  def __init__(self, *, slots: int, steps_per_call: int, prompt_len: int, max_new: int,
               page_size: int, seed: int):
    mesh = shd.make_mesh((1, 1, 1), jax.devices()[:1])
    pages = slots * pt.pages_for(prompt_len + max_new, page_size) + 1
    self.engine = engine_lib.Engine(
        PEER_MODEL, mesh=mesh, max_concurrent_decodes=slots, page_size=page_size,
        num_pages=pages, max_prefill_length=prompt_len, max_new_tokens=max_new,
        dtype="float32", steps_per_call=steps_per_call, stop_ids=())
    self.params = self.engine.load_params(rng=jax.random.key(seed))
    self.name = f"rl_jax slots={slots} spc={steps_per_call}"

  def warm(self, reqs) -> None:
    """Compiles every program the timed runs use (two full untimed passes); keeps the
    first pass's compile count as cold_compiles."""
    self.cold_compiles = self.run(reqs)["compiles"]
    self.run(reqs)

  def run(self, reqs) -> dict:
    gen = generator_lib.Generator(self.engine, self.params)
    for i, (p, n) in enumerate(reqs):
      gen.add_group(i, p, 1, seed=i, max_new_tokens=n, stop_on_eos=False)
    compiled = self._compiled()
    t0, c0, tokens = time.perf_counter(), time.process_time(), 0
    while gen.num_active or gen.num_pending:
      tokens += sum(r.num_tokens for r in gen.step())
    return dict(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0,
                tokens=tokens, generate_calls=gen.generate_calls,
                slot_steps=gen.slot_steps, idle_slot_steps=gen.slot_steps - tokens,
                compiles=self._compiled() - compiled)

  def _compiled(self) -> int:
    eng = self.engine
    return (sum(f._cache_size() for f in eng._generate.values()) +
            eng._prefill_pages._cache_size() + eng._apply._cache_size())


class TunixRunner:
  """google-tunix's vanilla Sampler on PEER_MODEL's shape, static batches of `slots`."""

  def __init__(self, *, slots: int, prompt_len: int, max_new: int, seed: int):
    from flax import nnx
    from tunix.generate import sampler as tunix_sampler
    from tunix.models.qwen2 import model as tunix_qwen2
    m = PEER_MODEL
    cfg = tunix_qwen2.ModelConfig(
        num_layers=m.num_layers, vocab_size=m.vocab_size, embed_dim=m.hidden_size,
        hidden_dim=m.intermediate_size, num_heads=m.num_heads, head_dim=m.head_dim,
        num_kv_heads=m.num_kv_heads, rope_theta=int(m.rope_theta), norm_eps=m.rms_norm_eps,
        use_tied_embedding=m.tie_embeddings)
    net = tunix_qwen2.Qwen2(cfg, rngs=nnx.Rngs(seed))
    cache = tunix_sampler.CacheConfig(cache_size=prompt_len + max_new + 1,
                                      num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                                      head_dim=m.head_dim)
    self.sampler = tunix_sampler.Sampler(net, _IdTokenizer(), cache)
    self.slots, self.prompt_len = slots, prompt_len
    self.name = f"tunix batch={slots}"

  def warm(self, reqs) -> None:
    self.run(reqs)

  def run(self, reqs) -> dict:
    t0, c0, tokens = time.perf_counter(), time.process_time(), 0
    for start in range(0, len(reqs), self.slots):
      chunk = reqs[start:start + self.slots]
      steps = max(n for _, n in chunk)
      self.sampler([" ".join(map(str, p.tolist())) for p, _ in chunk],
                   max_generation_steps=steps, max_prompt_length=self.prompt_len,
                   temperature=1.0, top_p=1.0, return_logprobs=True, seed=start,
                   eos_tokens=[PEER_MODEL.vocab_size])  # an id never sampled
      tokens += sum(n for _, n in chunk)
    return dict(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0, tokens=tokens)


class _IdTokenizer:
  """Space-separated token ids; tunix's Sampler takes strings."""

  def encode(self, text, **_):
    return [int(x) for x in text.split()]

  def decode(self, ids, **_):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return 0  # falsy: tunix prepends no bos

  def eos_id(self):
    return PEER_MODEL.eos_id

  def pad_id(self):
    return PEER_MODEL.pad_id


def tunix_available() -> bool:
  try:
    import tunix.generate.sampler  # noqa: F401
  except ImportError:
    return False
  return True


def run_peer_benchmark(*, slots: tuple[int, ...], steps_per_call: tuple[int, ...],
                       mixes: tuple[str, ...], requests: int, prompt_len: int, max_new: int,
                       page_size: int, repeats: int, seed: int = 0, peer: bool = True) -> list:
  """Rows {mix, name, slots, steps_per_call, tokens_per_s and tokens_per_cpu_s (medians
  over the repeats), runs (tokens/s of each), counts...}."""
  rows = []
  for mix in mixes:
    reqs = peer_requests(mix, num=requests, max_new=max_new, prompt_len=prompt_len,
                         vocab_size=PEER_MODEL.vocab_size, seed=seed)
    runners = []
    for k in slots:
      if peer:
        runners.append((k, 0, TunixRunner(slots=k, prompt_len=prompt_len, max_new=max_new,
                                           seed=seed)))
      for s in steps_per_call:
        runners.append((k, s, RlJaxRunner(slots=k, steps_per_call=s, prompt_len=prompt_len,
                                          max_new=max_new, page_size=page_size, seed=seed)))
    for _, _, r in runners:
      r.warm(reqs)
    results = {id(r): [] for _, _, r in runners}
    for _ in range(repeats):
      for _, _, r in runners:
        results[id(r)].append(r.run(reqs))
    for k, s, r in runners:
      runs = results[id(r)]
      tps = [x["tokens"] / x["wall_s"] for x in runs]
      row = dict(mix=mix, name=r.name, slots=k, steps_per_call=s,
                 tokens_per_s=statistics.median(tps),
                 tokens_per_cpu_s=statistics.median(x["tokens"] / x["cpu_s"] for x in runs),
                 runs=[round(x) for x in tps])
      row.update({c: runs[-1][c] for c in ("generate_calls", "slot_steps", "idle_slot_steps",
                                           "compiles") if c in runs[-1]})
      if hasattr(r, "cold_compiles"):
        row["cold_compiles"] = r.cold_compiles
      rows.append(row)
  return rows


def table(rows: list) -> str:
  """A table of run_peer_benchmark's rows with each rl_jax row's ratios to tunix (same
  mix and slot count) and to the first steps-per-call of its slot count, by wall time
  and (cpu columns) by CPU time."""
  head = (f"{'mix':<10}{'variant':<24}{'tok/s':>9}{'tok/cpu-s':>11}{'/tunix':>8}"
          f"{'/first spc':>11}{'cpu/tunix':>10}{'cpu/first':>10}{'calls':>7}"
          f"{'slot-steps':>11}{'idle':>7}")
  lines = [head]
  for r in rows:
    same = [x for x in rows if x["mix"] == r["mix"] and x["slots"] == r["slots"]]
    peer = [x for x in same if not x["steps_per_call"]]
    first = next((x for x in same if x["steps_per_call"]), None)
    ratio = lambda other, k="tokens_per_s": (f"{r[k] / other[k]:.2f}" if other is not None
                                             and r["steps_per_call"] else "")
    lines.append(f"{r['mix']:<10}{r['name']:<24}{r['tokens_per_s']:>9,.0f}"
                 f"{r['tokens_per_cpu_s']:>11,.0f}{ratio(peer[0] if peer else None):>8}"
                 f"{ratio(first):>11}"
                 f"{ratio(peer[0] if peer else None, 'tokens_per_cpu_s'):>10}"
                 f"{ratio(first, 'tokens_per_cpu_s'):>10}{r.get('generate_calls', ''):>7}"
                 f"{r.get('slot_steps', ''):>11}{r.get('idle_slot_steps', ''):>7}")
  return "\n".join(lines)

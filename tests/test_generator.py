"""Continuous-batching Generator: correctness against full recompute, prefix sharing,
page accounting, weight updates mid-sequence, running out of pages, abort."""
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.sampler import engine as E
from rl_jax.sampler import generator as G
from rl_jax.sampler import page_table as pt

CFG = model.get_preset("tiny_char")
PAGE = 4
MAX_NEW = 12
PROMPTS = [np.array([1, 5, 6, 7, 8]), np.array([1]), np.array([1, 9, 10, 11]),
           np.arange(20, 33), np.array([1, 40, 41, 42, 43, 44, 45, 46, 47]),
           np.array([1, 50, 51]), np.array([1, 60, 61, 62, 63, 64, 65])]
SAMPLING = E.Sampling(temperature=0.8, top_k=20, top_p=0.9)


def make_engine(num_pages, stop_ids, **kw):
  """An engine whose generate programs are the truncating sampling variant from the
  start: every test of the module (greedy or top-k/top-p) then shares one program per
  (slot, width) bucket instead of compiling both variants, compiling being most of this
  module's time. The non-truncating fused variant is checked against recompute
  elsewhere (test_updates, test_train_step's logprob mismatch)."""
  eng = E.Engine(CFG, mesh=shd.make_mesh((1, 1, 1), jax.devices()[:1]),
                 max_concurrent_decodes=4, page_size=PAGE, num_pages=num_pages,
                 max_prefill_length=16, max_new_tokens=MAX_NEW, stop_ids=stop_ids, **kw)
  eng.truncate = True
  return eng


@functools.lru_cache(maxsize=None)
def _apply_fn():
  return jax.jit(lambda p, t: model.apply(CFG, p, t))


def logits_at(params, seqs):
  """Next-token logits after each sequence (full recompute; rows padded to a multiple of
  16 and width 32, so one program serves every call)."""
  batch = np.zeros((-(-len(seqs) // 16) * 16, 32), np.int32)
  for i, s in enumerate(seqs):
    batch[i, :len(s)] = s
  out = np.asarray(_apply_fn()(params, jnp.asarray(batch)))
  return np.stack([out[i, len(s) - 1] for i, s in enumerate(seqs)])


def log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reference_greedy(params_per_step, prompts, num_tokens, stop_ids=()):
  """Greedy tokens/logprobs per prompt by recompute; params_per_step(i) gives the
  params that produce token i. Each list ends at (and includes) the first stop id."""
  seqs = [list(p) for p in prompts]
  toks = [[] for _ in prompts]
  lps = [[] for _ in prompts]
  for i in range(num_tokens):
    logp = log_softmax(logits_at(params_per_step(i), seqs))
    for j, s in enumerate(seqs):
      if toks[j] and toks[j][-1] in stop_ids:
        continue
      t = int(logp[j].argmax())
      toks[j].append(t)
      lps[j].append(float(logp[j, t]))
      s.append(t)
  return toks, lps


def run(gen, max_steps=500, check=None):
  out = []
  for _ in range(max_steps):
    if not gen.num_active and not gen.num_pending:
      break
    out.extend(gen.step())
    if check:
      check(gen)
  assert not gen.num_active and not gen.num_pending
  return out


def check_pages(gen):
  """Only shared prompt pages have refcount > 1; pages written to are private."""
  counts = gen.allocator.refcounts()
  expected = np.zeros_like(counts)
  private = []
  for seq in gen._slots:
    if seq is None:
      continue
    n = seq.group.num_full
    np.add.at(expected, seq.pages, 1)
    private.extend(seq.pages[n:])
    assert all(counts[p] == 1 for p in seq.pages[n:]), seq.pages
  for g in gen._groups:
    if g.prefix_pages is not None:
      np.add.at(expected, g.prefix_pages, 1)
  assert len(private) == len(set(private))
  np.testing.assert_array_equal(counts, expected)
  assert gen.kv_pages_used == np.count_nonzero(expected)


@pytest.fixture(scope="module")
def params():
  p = model.init_params(CFG, jax.random.key(1))
  return jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, p)


@pytest.fixture(scope="module")
def stop_id(params):
  """A token that greedy decoding of PROMPTS[0] emits at position 3 (not before), used
  as an extra stop id so the stop path is exercised with random weights."""
  toks, _ = reference_greedy(lambda i: params, PROMPTS[:1], 4)
  assert toks[0][3] not in toks[0][:3], "pick another prompt: its token 3 repeats"
  return toks[0][3]


@pytest.fixture(scope="module")
def engine(stop_id):
  return make_engine(num_pages=40, stop_ids=(CFG.eos_id, stop_id))


@pytest.fixture(scope="module")
def scan_engine(stop_id):
  """Layers in lax.scan over stacked pools, three steps per call."""
  return make_engine(num_pages=40, stop_ids=(CFG.eos_id, stop_id), layers="scan",
                     steps_per_call=3)


@pytest.fixture(scope="module")
def ragged_engine(stop_id):
  """Attention over only the pages each busy sequence uses, two steps per call."""
  return make_engine(num_pages=40, stop_ids=(CFG.eos_id, stop_id), attention="ragged",
                     steps_per_call=2)


def tight_generator(engine, params, **kw):
  """A Generator on `engine` whose allocator hands out the pages of a 12-page pool (11
  usable), fewer than the tests below start at once. Every admission, preemption and
  lending decision reads the allocator, so this is the small pool's schedule, decoded
  by the programs the module's engine already compiled (a 12-page engine would compile
  a program family of its own; pools used to their last page: test_generator_turns)."""
  gen = G.Generator(engine, params, **kw)
  gen.allocator = pt.PageAllocator(num_pages=12, page_size=PAGE)
  return gen


@pytest.fixture(params=["unrolled", "scan", "ragged"])
def any_engine(request, engine, scan_engine, ragged_engine):
  eng = {"unrolled": engine, "scan": scan_engine, "ragged": ragged_engine}[request.param]
  assert request.param in (eng.layers, eng.attention)
  return eng


def test_greedy_matches_recompute_and_frees_every_page(any_engine, params, stop_id):
  engine = any_engine
  # Count the programs this test adds, not absolute sizes (other tests share the engine).
  gen_before = {k: f._cache_size() for k, f in engine._generate.items()}
  apply_before = engine._apply._cache_size()
  gen = G.Generator(engine, params)
  max_new = [12, 3, 5, 8, 12, 2, 10]
  for i, (p, m) in enumerate(zip(PROMPTS, max_new)):
    gen.add_group(i, p, 1, seed=i, sampling=E.Sampling.greedy(), max_new_tokens=m)
  arrivals = []

  def check(g):
    check_pages(g)
    arrivals.append(g.rollouts_finished)

  rollouts = run(gen, check=check)
  assert len(rollouts) == len(PROMPTS)
  # Rollouts arrive as sequences finish, not all at the end.
  assert any(0 < a < len(PROMPTS) for a in arrivals)
  stops = (CFG.eos_id, stop_id)
  ref_t, ref_lp = reference_greedy(lambda i: params, PROMPTS, MAX_NEW, stops)
  by_id = {r.group_id: r for r in rollouts}
  for i, m in enumerate(max_new):
    r = by_id[i]
    want = ref_t[i][:m]
    np.testing.assert_array_equal(r.completion_tokens, want, err_msg=f"prompt {i}")
    np.testing.assert_allclose(r.behavior_logprobs, ref_lp[i][:m], atol=1e-4)
    assert r.finish_reason == ("stop" if want[-1] in stops else "length")
    assert r.token_versions.tolist() == [0] * len(want)
    assert r.admitted <= r.first_token <= r.finished
  assert by_id[0].completion_tokens[-1] == stop_id and by_id[0].finish_reason == "stop"
  assert gen.allocator.num_used == 0 and not gen.allocator.refcounts().any()
  assert gen.tokens_generated == sum(r.num_tokens for r in rollouts)
  # At most one new program per slot bucket (busy sequences are compacted into the lowest
  # slots), a bucket below all slots among those used, and at most one standalone update
  # program (the updates of a pass ride in the fused generate call unless they overflow).
  # Programs are per (slot bucket, page-width bucket), or per (slot bucket, live-page
  # bucket) with ragged attention: bounded by their product.
  gen_after = {k: f._cache_size() for k, f in engine._generate.items()}
  assert all(gen_after[k] <= gen_before.get(k, 0) + 1 for k in gen_after), (gen_before, gen_after)
  assert all(k[3] for k in gen_after), "the generator dispatches only fused programs"
  ragged = engine.attention == "ragged"
  widths = engine.live_buckets if ragged else engine.page_buckets
  assert len(gen_after) <= len(engine.slot_buckets) * len(widths)
  assert any(k[0] < engine.max_concurrent_decodes and n >= 1 for k, n in gen_after.items())
  # Short sequences read fewer pages than every slot's maximum.
  if ragged:
    assert any(k[2] < k[0] * engine.pages_per_seq for k in gen_after), gen_after
  else:
    assert any(k[1] < engine.pages_per_seq for k in gen_after), gen_after
  assert engine._apply._cache_size() <= apply_before + 1


def test_groups_share_prompt_pages_and_logprobs_match_recompute(any_engine, params):
  engine = any_engine
  gen = G.Generator(engine, params, sampling=SAMPLING)
  groups = {10: PROMPTS[4], 11: PROMPTS[3], 12: PROMPTS[6]}
  for gid, p in groups.items():
    gen.add_group(gid, p, 3, seed=gid)
  saw_shared = []

  def check(g):
    check_pages(g)
    saw_shared.append((g.allocator.refcounts() > 1).any())

  rollouts = run(gen, check=check)
  assert any(saw_shared)
  assert sorted((r.group_id, r.sample_index) for r in rollouts) == [
      (g, i) for g in groups for i in range(3)]
  for gid in groups:
    samples = [tuple(r.completion_tokens) for r in rollouts if r.group_id == gid]
    assert len(set(samples)) > 1, "samples of a group should differ"
  # Behaviour log-probs = recompute under temperature / top-k / top-p.
  for r in rollouts:
    full = np.concatenate([r.prompt_tokens, r.completion_tokens])
    p = len(r.prompt_tokens)
    seqs = [full[:p + j] for j in range(r.num_tokens)]
    scaled = logits_at(params, seqs) / SAMPLING.temperature
    order = np.argsort(-scaled, -1)
    ranked = np.take_along_axis(scaled, order, -1)
    ranked[:, SAMPLING.top_k:] = -np.inf
    probs = np.exp(log_softmax(ranked))
    keep = (np.cumsum(probs, -1) - probs) < SAMPLING.top_p
    ranked = np.where(keep, ranked, -np.inf)
    logp = np.full_like(scaled, -np.inf)
    np.put_along_axis(logp, order, log_softmax(ranked), -1)
    want = logp[np.arange(r.num_tokens), r.completion_tokens]
    np.testing.assert_allclose(r.behavior_logprobs, want, atol=1e-4)
  assert gen.allocator.num_used == 0
  # Per-request seeds: the same group alone reproduces its samples exactly.
  alone = G.Generator(engine, params, sampling=SAMPLING)
  alone.add_group(11, groups[11], 3, seed=11)
  again = {r.sample_index: r for r in run(alone)}
  for r in rollouts:
    if r.group_id == 11:
      np.testing.assert_array_equal(again[r.sample_index].completion_tokens,
                                    r.completion_tokens)


def _new_params(params):
  """Weights that change the logits but no layer's K/V: the last layer's MLP output and
  the final norm. So a continuation that keeps the KV cache computed under `params`
  must equal a full recompute under the new weights, token for token."""
  rng = np.random.default_rng(0)
  new = jax.tree.map(lambda x: x, params)
  down = np.asarray(params["layers"]["down"]).copy()
  down[-1] += rng.normal(0, 3 * down[-1].std(), down[-1].shape)
  new["layers"] = dict(params["layers"], down=jnp.asarray(down))
  new["final_norm"] = params["final_norm"] * rng.uniform(0.2, 2.0, params["final_norm"].shape)
  return new


def test_multi_step_calls_admit_at_once_and_skip_ended_slots(scan_engine, params):
  """Four 13-token prompts (three exceed the 32-token prefill lane together) on four
  slots, 3 steps per call, budgets 6, 4, 5, 6. Every prompt starts in the first call
  (the ones the lane cannot hold are prefilled by a call of their own, not left to wait),
  and no call follows the one in which every budget runs out, so the counts are exact:
  ceil(6 / 3) = 2 calls of 4 slots x 3 steps = 24 slot-steps for 21 tokens; the 3 idle
  slot-steps are the ends of the calls after budgets 4 and 5 ran out. Tokens and
  log-probs equal the greedy recompute."""
  engine = scan_engine
  assert engine.steps_per_call == 3 and engine.prefill_lane < 3 * 12
  prompts = [np.arange(20, 33), np.arange(40, 53), np.arange(60, 73), np.arange(80, 93)]
  budgets = [6, 4, 5, 6]
  gen = G.Generator(engine, params)
  for i, (p, m) in enumerate(zip(prompts, budgets)):
    gen.add_group(i, p, 1, seed=i, sampling=E.Sampling.greedy(), max_new_tokens=m,
                  stop_on_eos=False)
  rollouts = run(gen, check=check_pages)
  assert (gen.generate_calls, gen.slot_steps, gen.tokens_generated) == (2, 24, 21)
  ref_t, ref_lp = reference_greedy(lambda i: params, prompts, max(budgets))
  for r in rollouts:
    m = budgets[r.group_id]
    np.testing.assert_array_equal(r.completion_tokens, ref_t[r.group_id][:m])
    np.testing.assert_allclose(r.behavior_logprobs, ref_lp[r.group_id][:m], atol=1e-4)
    assert r.finish_reason == "length" and r.token_versions.tolist() == [0] * m
  assert gen.allocator.num_used == 0 and not gen.num_active


def test_inflight_weight_update_mixed_versions(any_engine, params):
  engine = any_engine
  new = _new_params(params)
  gen = G.Generator(engine, params, inflight_weight_updates=True)
  prompt = PROMPTS[2]
  gen.add_group(0, prompt, 1, seed=0, sampling=E.Sampling.greedy(), stop_on_eos=False)
  out = []
  while gen.tokens_generated < 4:
    out += gen.step()
  assert gen.tokens_generated == 4 or engine.steps_per_call > 1
  # The call already on the device when the weights arrive (a pass dispatches its call
  # before reading the previous one's tokens) still decodes on the old weights.
  switch = gen.tokens_generated + engine.steps_per_call
  publisher = threading.Thread(target=gen.update_params, args=(new, 7))
  publisher.start()
  publisher.join()
  assert gen.version == 0  # swapped at the top of the next step, not by the publisher
  out += run(gen)
  (r,) = out
  assert r.token_versions.tolist() == [0] * switch + [7] * (MAX_NEW - switch)
  assert r.mixed_versions and gen.version == 7
  ref_t, ref_lp = reference_greedy(lambda i: params if i < switch else new, [prompt], MAX_NEW)
  np.testing.assert_array_equal(r.completion_tokens, ref_t[0])
  np.testing.assert_allclose(r.behavior_logprobs, ref_lp[0], atol=1e-4)
  old_only, _ = reference_greedy(lambda i: params, [prompt], MAX_NEW)
  assert old_only[0] != ref_t[0], "the new weights should change the continuation"


def test_concurrent_publishing_is_safe(engine, params):
  """A publisher thread hammers update_params while the sampler steps: versions per
  rollout never go backwards and (same weights) tokens stay the greedy reference."""
  gen = G.Generator(engine, params)
  for i in range(3):
    gen.add_group(i, PROMPTS[i + 2], 2, seed=i, sampling=E.Sampling.greedy(),
                  stop_on_eos=False)
  stop = threading.Event()

  def publish():
    v = 0
    while not stop.is_set():
      v += 1
      gen.update_params(params, v)

  publisher = threading.Thread(target=publish)
  publisher.start()
  try:
    rollouts = run(gen)
  finally:
    stop.set()
    publisher.join()
  ref_t, _ = reference_greedy(lambda i: params, PROMPTS[2:5], MAX_NEW)
  for r in rollouts:
    assert np.all(np.diff(r.token_versions) >= 0)
    np.testing.assert_array_equal(r.completion_tokens, ref_t[r.group_id])
  assert max(r.token_versions.max() for r in rollouts) > 0


def test_weight_update_without_inflight_drains_first(engine, params):
  new = _new_params(params)
  gen = G.Generator(engine, params, inflight_weight_updates=False)
  gen.add_group(0, PROMPTS[2], 1, seed=0, sampling=E.Sampling.greedy(), stop_on_eos=False,
                max_new_tokens=8)
  out = []
  for _ in range(3):
    out += gen.step()
  gen.update_params(new, 1)
  gen.add_group(1, PROMPTS[5], 1, seed=0, sampling=E.Sampling.greedy(), stop_on_eos=False,
                max_new_tokens=6)
  assert not gen.has_capacity()
  out += gen.step()
  assert gen.num_active == 1 and gen.num_pending == 1 and gen.version == 0
  out += run(gen)
  by_id = {r.group_id: r for r in out}
  old_t, _ = reference_greedy(lambda i: params, [PROMPTS[2]], 8)
  new_t, _ = reference_greedy(lambda i: new, [PROMPTS[5]], 6)
  np.testing.assert_array_equal(by_id[0].completion_tokens, old_t[0])
  assert by_id[0].token_versions.tolist() == [0] * 8
  np.testing.assert_array_equal(by_id[1].completion_tokens, new_t[0])
  assert by_id[1].token_versions.tolist() == [1] * 6
  assert gen.allocator.num_used == 0


def test_pages_run_out_admission_waits_without_corruption(engine, params):
  groups = {i: (PROMPTS[i], 2) for i in range(len(PROMPTS))}

  def go(make, check=None):
    gen = make(engine, params, sampling=SAMPLING)
    for gid, (p, n) in groups.items():
      gen.add_group(gid, p, n, seed=100 + gid, stop_on_eos=False)
    return gen, {(r.group_id, r.sample_index): r for r in run(gen, check=check)}

  _, roomy = go(G.Generator)
  waited = []

  def check(g):
    check_pages(g)
    assert g.kv_pages_used <= g.allocator.capacity
    waited.append(g.num_pending > 0 and g.num_active < 4)

  gen, tight = go(tight_generator, check)
  assert gen.allocator.capacity == 11
  assert any(waited), "the small pool should make admission wait"
  assert gen.preemptions > 0, "the small pool should force a preemption"
  assert tight.keys() == roomy.keys()
  for key, r in roomy.items():
    np.testing.assert_array_equal(tight[key].completion_tokens, r.completion_tokens,
                                  err_msg=str(key))
    # Batches of other slots and page widths differ between the runs, which changes the
    # order of float reductions (not the math): the recompute tolerance applies.
    np.testing.assert_allclose(tight[key].behavior_logprobs, r.behavior_logprobs, atol=1e-4)
  assert gen.allocator.num_used == 0 and not gen.allocator.refcounts().any()
  with pytest.raises(ValueError, match="KV pages"):
    gen.add_group(99, PROMPTS[3], 4, seed=0)


def test_abort_all_and_generate_keep_accounting(engine, params):
  gen = G.Generator(engine, params)
  gen.add_group(0, PROMPTS[3], 3, seed=0, stop_on_eos=False)
  gen.add_group(1, PROMPTS[4], 3, seed=1, stop_on_eos=False)
  gen.step()
  gen.step()
  aborted = gen.abort_all()
  assert sorted((r.group_id, r.sample_index) for r in aborted) == [
      (g, i) for g in (0, 1) for i in range(3)]
  assert all(r.finish_reason == "aborted" for r in aborted)
  assert sum(r.num_tokens > 0 for r in aborted) == 4  # the four that had slots
  assert gen.num_active == 0 and gen.num_pending == 0 and gen.allocator.num_used == 0

  # generate() for evaluation while an RL group runs: nothing gets lost.
  gen.add_group(5, PROMPTS[0], 2, seed=3, max_new_tokens=2, stop_on_eos=False)
  completions = gen.generate([PROMPTS[1], PROMPTS[5]], max_new_tokens=6)
  ref_t, _ = reference_greedy(lambda i: params, [PROMPTS[1], PROMPTS[5]], 6,
                              engine.stop_ids)
  for got, want in zip(completions, ref_t):
    want = want[:-1] if want[-1] in engine.stop_ids else want
    np.testing.assert_array_equal(got, want)
  rest = gen.step() + run(gen)
  assert sorted((r.group_id, r.sample_index) for r in rest) == [(5, 0), (5, 1)]
  assert gen.allocator.num_used == 0


def test_lend_pool_evaluates_in_the_samplers_pool(engine, params):
  """Issue 29: the held-out evaluator has no pool of its own; it borrows the sampler's
  while the sampler is paused. With the pool full of running groups, lending first
  preempts the youngest until one held-out sequence fits. The evaluator's greedy
  completions match recompute, its pages all come back, and the lender's rollouts equal
  those of a run without evaluation (preempted samples re-run with their seeds)."""
  prompts = [PROMPTS[1], PROMPTS[5]]

  def go(evaluate):
    gen = tight_generator(engine, params, sampling=SAMPLING)
    for gid in (3, 4, 6):
      gen.add_group(gid, PROMPTS[gid], 2, seed=100 + gid, stop_on_eos=False)
    out = gen.step() + gen.step()
    if evaluate:
      ev = G.Generator(engine, params, borrows_pool=True)
      with gen.lend_pool(ev, engine.pages_per_seq + 1):
        assert gen.preemptions > 0 and gen.allocator.num_free >= engine.pages_per_seq + 1
        used = gen.allocator.num_used
        completions = ev.generate(prompts, max_new_tokens=6)
        assert gen.allocator.num_used == used
      ref_t, _ = reference_greedy(lambda i: params, prompts, 6, engine.stop_ids)
      for got, want in zip(completions, ref_t):
        np.testing.assert_array_equal(got, want[:-1] if want[-1] in engine.stop_ids else want)
    out += run(gen, check=check_pages)
    assert gen.allocator.num_used == 0
    return {(r.group_id, r.sample_index): r for r in out}

  plain, evaluated = go(False), go(True)
  assert plain.keys() == evaluated.keys()
  for key, r in plain.items():
    np.testing.assert_array_equal(evaluated[key].completion_tokens, r.completion_tokens,
                                  err_msg=str(key))


def test_slot_limit_caps_the_slots_in_use_and_keeps_the_samples(engine, params):
  """Live control lowers Generator.slot_limit: never more sequences decode at once, and
  every sample is the same tokens (same seeds) as with every slot."""
  def go(limit):
    gen = G.Generator(engine, params, sampling=SAMPLING)
    gen.slot_limit = limit
    for gid in range(3):
      gen.add_group(gid, PROMPTS[gid], 2, seed=7 + gid, stop_on_eos=False)
    peak = []
    out = run(gen, check=lambda g: peak.append(g._num_decoding))
    return max(peak), {(r.group_id, r.sample_index): r.completion_tokens for r in out}

  full_peak, full = go(4)
  peak, limited = go(2)
  assert full_peak == 4 and peak == 2
  assert limited.keys() == full.keys()
  for key, toks in full.items():
    np.testing.assert_array_equal(limited[key], toks, err_msg=str(key))


@pytest.mark.parametrize("which", ["unrolled", "scan"])
def test_samples_restored_mid_decode_continue_their_prng_streams(which, engine, scan_engine,
                                                                  params):
  """A generator's snapshot in mid-decode (checkpoint.rollouts=all), handed to a fresh
  generator with other weights' version: every sample ends with the tokens of an
  uninterrupted run (same weights and PRNG keys by position), the tokens before the cut
  keep their log-probs and version, the ones after carry the new version and match the
  recompute, and every sample is emitted exactly once across the two generators."""
  eng = {"unrolled": engine, "scan": scan_engine}[which]
  groups = {10: PROMPTS[4], 11: PROMPTS[3]}
  reference = G.Generator(eng, params, sampling=SAMPLING)
  for gid, p in groups.items():
    reference.add_group(gid, p, 3, seed=gid, stop_on_eos=False)
  want = {(r.group_id, r.sample_index): r for r in run(reference)}

  first = G.Generator(eng, params, sampling=SAMPLING)
  for gid, p in groups.items():
    first.add_group(gid, p, 3, seed=gid, stop_on_eos=False)
  before = []
  while first.tokens_generated < 5 * eng.steps_per_call:
    before += first.step()
  partial, finished = first.snapshot()
  before += finished
  assert first._inflight is None  # the call on the device was read
  assert any(partial.values()), "the cut should fall in mid-decode"
  second = G.Generator(eng, params, sampling=SAMPLING, version=5)
  done = {(r.group_id, r.sample_index) for r in before}
  for gid, p in groups.items():
    todo = [i for i in range(3) if (gid, i) not in done]
    if todo:
      second.add_group(gid, p, 3, seed=gid, stop_on_eos=False, samples=todo,
                       restored=partial[gid])
  after = run(second, check=check_pages)
  assert second.allocator.num_used == 0
  got = {(r.group_id, r.sample_index): r for r in before + after}
  assert len(before) + len(after) == len(got) == len(want) == 6
  cut = {(g, i): len(t) for g, seqs in partial.items() for i, (t, _, _) in seqs.items()}
  for key, r in got.items():
    np.testing.assert_array_equal(r.completion_tokens, want[key].completion_tokens)
    n = cut.get(key, 0 if key not in done else r.num_tokens)
    versions = [0] * n + [5] * (r.num_tokens - n)
    assert r.token_versions.tolist() == versions, key
    np.testing.assert_array_equal(r.behavior_logprobs[:n], partial[key[0]][key[1]][1][:n]
                                  if key in cut else want[key].behavior_logprobs[:n])
    # The continuation's log-probs were computed over the re-prefilled cache.
    np.testing.assert_allclose(r.behavior_logprobs, want[key].behavior_logprobs, atol=1e-4)
  assert any(0 < n < MAX_NEW for n in cut.values())


def test_restored_samples_are_checked(engine, params):
  gen = G.Generator(engine, params)
  with pytest.raises(ValueError, match="restored sample 1 of group 3 has 0 tokens"):
    gen.add_group(3, PROMPTS[0], 2, seed=0, restored={1: ([], [], [])})
  with pytest.raises(ValueError, match="restored sample 1 of group 3 has 12 tokens"):
    gen.add_group(3, PROMPTS[0], 2, seed=0, restored={1: ([5] * 12, [0.0] * 12, [0] * 12)})
  with pytest.raises(ValueError, match="only a sample still to produce"):
    gen.add_group(3, PROMPTS[0], 2, seed=0, samples=[0], restored={1: ([5], [0.0], [0])})
  with pytest.raises(ValueError, match=r"must be some of 0..1, got \[\]"):
    gen.add_group(3, PROMPTS[0], 2, seed=0, samples=[])
  assert not gen.num_pending  # nothing was queued by a refused call

"""Multi-turn episodes in the Generator (parked sequences, resume over kept pages) and
the engine's prefill over an existing prefix, against step-by-step full recompute."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.sampler import engine as E
from rl_jax.sampler import prefill as prefill_lib
from rl_jax.sampler import extend as X
from rl_jax.sampler import generator as G
from rl_jax.sampler import page_table as pt

CFG = model.get_preset("tiny_char")
PAGE = 4
MAX_NEW = 20
PROMPTS = [np.array([1, 5, 6, 7, 8]), np.array([1, 40, 41, 42, 43, 44, 45, 46, 47]),
           np.array([1, 9])]
# The environment's fixed script: observation of model turn i (the episode ends after
# the last one). Lengths 1, 6 (over a page), 3.
OBS = [np.array([70]), np.arange(80, 86), np.array([90, 91, 92])]
SAMPLING = E.Sampling(temperature=0.9, top_k=30, top_p=0.95)


def turn_end(toks):
  """A turn ends at the first token divisible by 5 (the 'closing tag'), at the latest
  after 4 tokens."""
  hits = np.flatnonzero(toks[:4] % 5 == 0)
  if hits.size:
    return int(hits[0]) + 1
  return 4 if toks.size >= 4 else None


def make_engine(**kw):
  """Two slots and 12 usable pages: every test meets preemption and waits for pages,
  and one engine's programs serve all tests (compiling dominates their time): its
  generate programs are the truncating sampling variant from the start, so greedy and
  top-k/top-p tests share them (the non-truncating variant is checked against recompute
  in test_updates and test_train_step's logprob mismatch)."""
  eng = E.Engine(CFG, mesh=shd.make_mesh((1, 1, 1), jax.devices()[:1]),
                 max_concurrent_decodes=2, page_size=PAGE, num_pages=13,
                 max_prefill_length=16, max_new_tokens=MAX_NEW, steps_per_call=2, **kw)
  eng.truncate = True
  return eng


@pytest.fixture(scope="module")
def params():
  p = model.init_params(CFG, jax.random.key(1))
  return jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, p)


@pytest.fixture(scope="module")
def engine():
  return make_engine()


@functools.lru_cache(maxsize=None)
def _apply_fn():
  return jax.jit(lambda p, t: model.apply(CFG, p, t))


def log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def next_logits(params, seqs):
  """Next-token logits after each sequence (full recompute; rows padded to a multiple of
  16 and width 32, so one program serves every call)."""
  batch = np.zeros((-(-len(seqs) // 16) * 16, 32), np.int32)
  for i, s in enumerate(seqs):
    batch[i, :len(s)] = s
  out = np.asarray(_apply_fn()(params, jnp.asarray(batch)))
  return np.stack([out[i, len(s) - 1] for i, s in enumerate(seqs)])


def scripted(turn):
  """The environment: the script's observation for this turn, None to end."""
  return OBS[turn.turn_index] if turn.turn_index < len(OBS) else None


def reference_episode(params_at, prompt, budget, stop_ids, env=scripted, ends=turn_end):
  """Greedy episode by step-by-step full recompute: (tokens, mask, logprobs, versions,
  num_turns, finish_reason). params_at(turn) -> (params, version) for that model turn."""
  seq, toks, mask, lps, vers = list(prompt), [], [], [], []
  turn, index = [], 0
  while True:
    p, version = params_at(index)
    logp = log_softmax(next_logits(p, [seq]))[0]
    t = int(logp.argmax())
    for xs, x in ((seq, t), (toks, t), (mask, True), (lps, float(logp[t])), (vers, version),
                  (turn, t)):
      xs.append(x)
    finish = "stop" if t in stop_ids else ("length" if len(toks) == budget else None)
    if finish is None and ends(np.asarray(turn)) is not None:
      obs = env(G.Turn(0, 0, 0, index, np.asarray(turn), len(toks)))
      if obs is None:
        finish = "stop"
      else:
        obs = [int(x) for x in obs][:budget - len(toks)]
        seq += obs
        toks += obs
        mask += [False] * len(obs)
        lps += [0.0] * len(obs)
        vers += [-1] * len(obs)
        if len(toks) == budget:
          finish = "length"
        else:
          turn, index = [], index + 1
    if finish:
      return toks, mask, lps, vers, index + 1, finish


def live_seqs(gen):
  return ([s for s in gen._slots if s is not None] + list(gen._parked.values()) +
          list(gen._resuming))


def check_pages(gen):
  """Refcounts = the references live sequences (running, parked, resuming) and prompt
  caches hold; pages past the shared prompt pages belong to one sequence only."""
  counts = gen.allocator.refcounts()
  expected = np.zeros_like(counts)
  private = []
  for seq in live_seqs(gen):
    np.add.at(expected, seq.pages, 1)
    private.extend(seq.pages[seq.group.num_full:])
  for g in gen._groups:
    if g.prefix_pages is not None:
      np.add.at(expected, g.prefix_pages, 1)
  assert len(private) == len(set(private)), "a page is written by two sequences"
  np.testing.assert_array_equal(counts, expected)
  assert gen.kv_pages_used == np.count_nonzero(expected)
  parked = [s for s in live_seqs(gen) if s.slot < 0]
  assert gen.num_parked == len(parked)
  assert gen.parked_pages == len({p for s in parked for p in s.pages})


def drive(gen, env=scripted, max_steps=400, check=check_pages):
  """Step the generator, answering every parked turn with `env` at once."""
  out = []
  for _ in range(max_steps):
    out += gen.step()
    for t in gen.take_turns():
      obs = env(t)
      if obs is None:
        out.append(gen.end_episode(t.group_id, t.sample_index, t.attempt))
      else:
        gen.resume(t.group_id, t.sample_index, t.attempt, obs)
    if check:
      check(gen)
    if not (gen.num_active or gen.num_pending or gen.num_parked):
      return out + gen.step()
  raise AssertionError("the generator did not finish")


def assert_turn_structure(r):
  """The rollout follows the script: model turns end where turn_end says, each
  followed by the script's observation (cut by the budget at the end)."""
  mask = r.model_mask
  toks = r.completion_tokens
  edges = np.flatnonzero(np.diff(np.concatenate([[1], mask.astype(int), [1]])))
  model_turns, start = [], 0
  for i, (a, b) in enumerate(zip(edges[::2], edges[1::2])):  # observation spans
    model_turns.append(toks[start:a])
    want = OBS[i][:b - a]
    np.testing.assert_array_equal(toks[a:b], want)
    assert b - a == OBS[i].size or b == toks.size, "only the last observation is cut"
    start = b
  for turn in model_turns:
    assert turn_end(turn) == turn.size
  if start < toks.size:  # the last model turn: cut by EOS, the budget or the environment
    assert turn_end(toks[start:]) in (None, toks.size - start)
  assert r.num_turns == len(model_turns) + (start < toks.size)
  np.testing.assert_array_equal(r.behavior_logprobs[~mask], 0.0)
  np.testing.assert_array_equal(r.token_versions[~mask], -1)


def test_scripted_episodes_greedy_match_recompute(engine, params):
  eng = engine
  gen = G.Generator(eng, params)
  budgets = [20, 16, 18]
  for i, (p, m) in enumerate(zip(PROMPTS, budgets)):
    gen.add_group(i, p, 2, seed=i, sampling=E.Sampling.greedy(), max_new_tokens=m,
                  turn_end=turn_end)
  turns = []

  def env(t):
    turns.append(t)
    return scripted(t)

  rollouts = drive(gen, env)
  assert sorted((r.group_id, r.sample_index) for r in rollouts) == [
      (g, i) for g in range(3) for i in range(2)]
  for r in rollouts:
    toks, mask, lps, vers, n_turns, finish = reference_episode(
        lambda i: (params, 0), PROMPTS[r.group_id], budgets[r.group_id], eng.stop_ids)
    np.testing.assert_array_equal(r.completion_tokens, toks, err_msg=str(r.group_id))
    np.testing.assert_array_equal(r.model_mask, mask)
    np.testing.assert_allclose(r.behavior_logprobs, lps, atol=1e-4)
    np.testing.assert_array_equal(r.token_versions, vers)
    assert r.finish_reason == finish and r.num_turns == n_turns
    assert_turn_structure(r)
  assert sum(not r.model_mask.all() for r in rollouts) >= 4, "most episodes should use tools"
  # Every reported turn is the model's turn as the rollout shows it.
  by_key = {(r.group_id, r.sample_index): r for r in rollouts}
  for t in turns:
    r = by_key[t.group_id, t.sample_index]
    np.testing.assert_array_equal(r.completion_tokens[t.num_tokens - t.tokens.size:t.num_tokens],
                                  t.tokens)
    assert r.model_mask[t.num_tokens - t.tokens.size:t.num_tokens].all() and t.attempt == 0
  assert gen.allocator.num_used == 0 and not gen.allocator.refcounts().any()


def test_sampled_episodes_logprobs_match_recompute_and_do_not_depend_on_slots(engine, params):
  gen = G.Generator(engine, params, sampling=SAMPLING)
  for i, p in enumerate(PROMPTS):
    gen.add_group(i, p, 2, seed=10 + i, turn_end=turn_end, stop_on_eos=False,
                  max_new_tokens=18)
  rollouts = drive(gen)
  for r in rollouts:
    assert_turn_structure(r)
    full = np.concatenate([r.prompt_tokens, r.completion_tokens])
    p = r.prompt_tokens.size
    idx = np.flatnonzero(r.model_mask)
    scaled = next_logits(params, [full[:p + j] for j in idx]) / SAMPLING.temperature
    order = np.argsort(-scaled, -1)
    ranked = np.take_along_axis(scaled, order, -1)
    ranked[:, SAMPLING.top_k:] = -np.inf
    probs = np.exp(log_softmax(ranked))
    ranked = np.where(np.cumsum(probs, -1) - probs < SAMPLING.top_p, ranked, -np.inf)
    logp = np.full_like(scaled, -np.inf)
    np.put_along_axis(logp, order, log_softmax(ranked), -1)
    want = logp[np.arange(idx.size), r.completion_tokens[idx]]
    # rtol: 1/temperature scales the float32 rounding of large log-probs (also of the
    # first token, which no observation precedes).
    np.testing.assert_allclose(r.behavior_logprobs[idx], want, atol=1e-4, rtol=1e-4)
    assert (r.token_versions[idx] == 0).all()
  assert sum(r.num_turns > 1 for r in rollouts) >= 4
  # Keys are (seed, sample, position): the group alone, one slot at a time and with
  # late observations, samples the same episodes.
  alone = G.Generator(engine, params, sampling=SAMPLING)
  alone.add_group(1, PROMPTS[1], 2, seed=11, turn_end=turn_end, stop_on_eos=False,
                  max_new_tokens=18)
  queue, out = [], []
  for _ in range(400):  # a slow environment: one answer each time nothing runs
    out += alone.step()
    queue += alone.take_turns()
    if queue and not alone.num_active:
      t = queue.pop(0)
      if scripted(t) is None:
        out.append(alone.end_episode(t.group_id, t.sample_index, t.attempt))
      else:
        alone.resume(t.group_id, t.sample_index, t.attempt, scripted(t))
    if not (alone.num_active or alone.num_pending or alone.num_parked or queue):
      out += alone.step()
      break
  again = {r.sample_index: r for r in out}
  assert sorted(again) == [0, 1]
  for r in rollouts:
    if r.group_id == 1:
      np.testing.assert_array_equal(again[r.sample_index].completion_tokens,
                                    r.completion_tokens)
      np.testing.assert_allclose(again[r.sample_index].behavior_logprobs,
                                 r.behavior_logprobs, atol=1e-4)


def _new_params(params):
  """Weights that change the logits but no layer's K/V (the last layer's MLP output and
  the final norm): a continuation over K/V cached under `params` must equal a full
  recompute under the new weights."""
  rng = np.random.default_rng(0)
  down = np.asarray(params["layers"]["down"]).copy()
  down[-1] += rng.normal(0, 3 * down[-1].std(), down[-1].shape)
  new = dict(params, layers=dict(params["layers"], down=jnp.asarray(down)))
  new["final_norm"] = params["final_norm"] * rng.uniform(0.2, 2.0, params["final_norm"].shape)
  return new


@pytest.mark.parametrize("inflight", [True, False])
def test_weight_update_while_parked_shows_on_later_tokens(engine, params, inflight):
  new = _new_params(params)
  gen = G.Generator(engine, params, inflight_weight_updates=inflight)
  gen.add_group(0, PROMPTS[0], 1, seed=0, sampling=E.Sampling.greedy(), stop_on_eos=False,
                max_new_tokens=20, turn_end=turn_end)
  out, turns = [], []
  while not turns:
    out += gen.step()
    turns += gen.take_turns()
  (t,) = turns
  assert t.turn_index == 0 and gen.num_parked == 1 and gen.num_active == 0
  gen.update_params(new, 5)
  gen.resume(t.group_id, t.sample_index, t.attempt, OBS[0])
  out += drive(gen, lambda t: None)
  (r,) = out
  assert gen.version == 5
  toks, mask, lps, vers, _, _ = reference_episode(
      lambda i: (params, 0) if i == 0 else (new, 5), PROMPTS[0], 20, engine.stop_ids,
      env=lambda t: OBS[0] if t.turn_index == 0 else None)
  np.testing.assert_array_equal(r.completion_tokens, toks)
  np.testing.assert_allclose(r.behavior_logprobs, lps, atol=1e-4)
  n0 = t.tokens.size
  assert r.token_versions.tolist() == vers == [0] * n0 + [-1] + [5] * (len(vers) - n0 - 1)
  assert r.mixed_versions and r.min_version == 0 and r.staleness(6) == 6
  old, _, _, _, _, _ = reference_episode(lambda i: (params, 0), PROMPTS[0], 20, engine.stop_ids,
                                         env=lambda t: OBS[0] if t.turn_index == 0 else None)
  assert old != toks, "the new weights should change the tokens after the wait"


def test_observation_cut_at_budget_and_stale_or_wrong_calls(engine, params):
  gen = G.Generator(engine, params)
  gen.add_group(0, PROMPTS[0], 2, seed=0, sampling=E.Sampling.greedy(), max_new_tokens=9,
                turn_end=lambda toks: 3 if toks.size >= 3 else None, stop_on_eos=False)
  turns = []
  while len(turns) < 2:
    gen.step()
    turns += gen.take_turns()
  a, b = turns
  assert a.tokens.size == 3 and a.num_tokens == 3
  with pytest.raises(ValueError, match="at least one token"):
    gen.resume(0, a.sample_index, a.attempt, [])
  assert gen.resume(0, a.sample_index, a.attempt + 1, [5]) is None  # not its attempt
  assert gen.end_episode(7, 0, 0) is None  # no such group (finished or aborted)
  assert gen.num_parked == 2
  long_obs = np.arange(60, 80)
  gen.resume(0, a.sample_index, a.attempt, long_obs)  # 3 + 20 > 9: cut to 6, ends
  assert gen.num_parked == 1 and gen.num_active == 0
  with pytest.raises(ValueError, match="not parked"):
    gen.resume(0, a.sample_index, a.attempt, [5])
  (r,) = gen.step()
  assert r.finish_reason == "length" and r.num_tokens == 9 and r.num_turns == 1
  np.testing.assert_array_equal(r.completion_tokens[3:], long_obs[:6])
  assert r.model_mask.tolist() == [True] * 3 + [False] * 6
  # An observation one short of the budget leaves one model token to sample.
  gen.resume(0, b.sample_index, b.attempt, long_obs[:5])
  (r2,) = drive(gen, lambda t: pytest.fail("no turn fits"))
  assert r2.finish_reason == "length" and r2.num_tokens == 9 and r2.num_turns == 2
  assert r2.model_mask.tolist() == [True] * 3 + [False] * 5 + [True]
  assert gen.allocator.num_used == 0


def test_parked_pages_hold_and_preemption_restarts_youngest(engine, params):
  """A pool that fits one group: group 0 parks while group 1 fills the pool and parks;
  group 0's resumes then find no pages with nothing running, so group 1 (youngest)
  restarts from its prompt under a new attempt and its late observations are ignored."""
  gen = G.Generator(engine, params)
  end6 = lambda toks: 6 if toks.size >= 6 else None  # noqa: E731
  for gid in range(2):  # 8 cached: 2 prompt pages + 2 x (pages_for(8 + 16) - 2) = 10
    gen.add_group(gid, PROMPTS[1], 2, seed=gid, sampling=E.Sampling.greedy(),
                  max_new_tokens=16, turn_end=end6, stop_on_eos=False)
  pending, out = [], []
  for _ in range(40):
    out += gen.step()
    pending += gen.take_turns()
    check_pages(gen)
    if gen.num_parked == 4:
      break
  assert gen.num_parked == 4 and not gen.num_active and gen.preemptions == 0
  held = gen.parked_pages
  assert held == gen.allocator.num_used and gen.allocator.num_free < 4
  assert not gen.has_capacity()
  for t in pending:
    if t.group_id == 0:
      gen.resume(0, t.sample_index, t.attempt, np.arange(60, 66))
  out += gen.step()
  check_pages(gen)
  assert gen.preemptions >= 1 and gen.num_active == 2
  assert gen._groups[1].attempts == [1, 1] and gen._groups[1].waiting
  for t in pending:
    if t.group_id == 1:  # the old episode's observation arrives late: ignored
      assert gen.resume(1, t.sample_index, t.attempt, [60]) is None
  rollouts = out + drive(gen, lambda t: None if t.turn_index else np.arange(60, 66))
  assert sorted((r.group_id, r.sample_index) for r in rollouts) == [(0, 0), (0, 1), (1, 0),
                                                                    (1, 1)]
  ref = reference_episode(lambda i: (params, 0), PROMPTS[1], 16, (), env=lambda t: (
      None if t.turn_index else np.arange(60, 66)), ends=end6)
  for r in rollouts:  # restarts and waits change nothing in the episodes
    np.testing.assert_array_equal(r.completion_tokens, ref[0])
    np.testing.assert_allclose(r.behavior_logprobs, ref[2], atol=1e-4)
  assert gen.allocator.num_used == 0 and not gen.allocator.refcounts().any()


def _run_until_preempted_with_parked(engine, params, seed):
  """Random tool delays, ends and timeouts until a preemption has happened and parked
  and running episodes coexist; (generator, rollouts, tool calls still in flight) or
  None when this seed's schedule never gets there in 80 passes."""
  gen = G.Generator(engine, params, sampling=SAMPLING)
  rng = np.random.default_rng(seed)
  for gid in range(5):
    gen.add_group(gid, PROMPTS[gid % 3], 2, seed=gid, max_new_tokens=18, turn_end=turn_end,
                  stop_on_eos=False)
  gen.add_group(5, PROMPTS[0], 2, seed=5, max_new_tokens=10)  # single-turn, alongside
  waiting = []  # (due step, turn): tool calls in flight
  out = []
  for step in range(80):
    out += gen.step()
    for t in gen.take_turns():
      waiting.append((step + int(rng.integers(0, 4)), t))
    due = [t for when, t in waiting if when <= step]
    waiting = [w for w in waiting if w[0] > step]
    for t in due:
      kind = rng.integers(0, 4)
      if kind == 0 or t.turn_index >= 2:  # the environment ends it, or a timeout
        r = gen.end_episode(t.group_id, t.sample_index, t.attempt,
                            "stop" if kind else "aborted")
        out += [r] if r is not None else []
      else:
        gen.resume(t.group_id, t.sample_index, t.attempt, OBS[int(kind) - 1])
    check_pages(gen)
    if gen.preemptions and gen.num_parked and gen.num_active and len(out) >= 2:
      return gen, out, waiting
  assert gen.allocator.num_used == 0 and not gen.allocator.refcounts().any()
  return None


def test_page_accounting_with_waits_ends_aborts_and_preemption(engine, params):
  # Whether a schedule preempts depends on the delays drawn; the first seeds that do
  # (about four in six) are used, the others still check their page accounting.
  for seed in range(8):
    found = _run_until_preempted_with_parked(engine, params, seed)
    if found is not None:
      break
  else:
    pytest.fail("expected a preemption, then parked and running episodes at once")
  gen, out, waiting = found
  gen.add_group(9, PROMPTS[0], 2, seed=9, max_new_tokens=18, turn_end=turn_end)
  out += gen.abort_all()  # running, parked, resuming, waiting and never started
  for _, t in waiting:  # late tool results after the abort
    assert gen.resume(t.group_id, t.sample_index, t.attempt, [5]) is None
  keys = sorted((r.group_id, r.sample_index) for r in out)
  assert keys == sorted((g, i) for g in [0, 1, 2, 3, 4, 5, 9] for i in range(2))
  for r in out:
    if r.group_id == 5:
      assert r.model_mask is None and r.num_turns == 1
    else:
      assert r.model_mask.shape == r.completion_tokens.shape
  assert gen.allocator.num_used == 0 and not gen.allocator.refcounts().any()
  assert not gen.take_turns() and gen.num_parked == 0 and gen.parked_pages == 0


@functools.lru_cache(maxsize=None)
def _prompt_kv_fn():
  return jax.jit(functools.partial(prefill_lib.prompt_kv,
                                   model_cfg=CFG.replace(attention="jnp"),
                                   kv_dtype=jnp.float32))


def _prefix_kv(params, tokens):
  """Reference K/V [l, k, t, d] of a whole sequence by one causal prefill (padded to 32),
  with the materialised jnp attention (XLA's fused kernel rounds differently, up to
  4e-4 here)."""
  padded = np.zeros((1, 32), np.int32)
  padded[0, :len(tokens)] = tokens
  k, v = _prompt_kv_fn()(params, padded)
  return np.asarray(k)[:, :, 0], np.asarray(v)[:, :, 0]


@pytest.mark.parametrize("which", ["unrolled", "scan"])
def test_paged_extend_equals_full_prefill(which, engine, params):
  """Two sequences extended in one call, one over two chunks (more new tokens than
  max_prefill_length): their pages hold the K/V of one causal prefill of the whole.
  Both layer loops (per-layer and stacked pools)."""
  eng = engine if which == "unrolled" else make_engine(layers="scan")
  alloc = pt.PageAllocator(num_pages=eng.num_pages, page_size=PAGE)
  heads = [PROMPTS[0], PROMPTS[1]]
  tails = [np.arange(60, 63), np.arange(20, 40)]
  pages = [alloc.allocate(pt.pages_for(h.size + t.size, PAGE)) for h, t in zip(heads, tails)]
  state = eng.prefill_into_pages(params, eng.init_decode_state(), heads, pages)
  entries = [(np.concatenate([h[-1:], t]), h.size - 1, pg)
             for h, t, pg in zip(heads, tails, pages)]
  state = X.Extender.of(eng).extend(params, state, entries)
  pool_k = np.stack([np.asarray(x) for x in state.k_pages]) if which == "unrolled" else (
      np.asarray(state.k_pages))
  pool_v = np.stack([np.asarray(x) for x in state.v_pages]) if which == "unrolled" else (
      np.asarray(state.v_pages))
  for h, t, pg in zip(heads, tails, pages):
    full = np.concatenate([h, t])
    k_ref, v_ref = _prefix_kv(params, full)
    n = full.size
    got_k = pool_k[:, :, pg].reshape(pool_k.shape[:2] + (-1, pool_k.shape[-1]))[:, :, :n]
    got_v = pool_v[:, :, pg].reshape(pool_v.shape[:2] + (-1, pool_v.shape[-1]))[:, :, :n]
    # K/V reach ~16; the batch shape changes float32 rounding, which the 3x weights
    # amplify from ~1e-5 in layer 0 to ~2e-4 in layer 1 (a wrong position is O(1)).
    np.testing.assert_allclose(got_k[0], k_ref[0, :, :n], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got_k, k_ref[:, :, :n], rtol=1e-4, atol=5e-4)
    np.testing.assert_allclose(got_v, v_ref[:, :, :n], rtol=1e-4, atol=5e-4)


def test_engine_prefill_over_existing_prefix_equals_full_prefill(engine, params):
  """A Prefix is its K/V, last token and length (insert and decode from one are tested
  in test_engine; the adapter's test decodes from an extended one)."""
  head, tail = np.array([1, 5, 6, 7, 8, 9]), np.array([20, 21, 22, 23, 24])
  full_tokens = np.concatenate([head, tail])
  full = engine.prefill(params=params, padded_tokens=engine.pad_tokens(full_tokens)[0],
                        true_length=full_tokens.size)
  first = engine.prefill(params=params, padded_tokens=engine.pad_tokens(head)[0],
                         true_length=head.size)
  ext = engine.prefill(params=params, existing_prefix=first,
                       padded_tokens=engine.pad_tokens(tail)[0], true_length=tail.size)
  n = full_tokens.size
  assert ext.k_lktd.shape == full.k_lktd.shape == (CFG.num_layers, CFG.num_kv_heads, 16,
                                                   CFG.head_dim)
  assert int(ext.true_length) == n and int(ext.last_token) == int(full.last_token) == tail[-1]
  np.testing.assert_allclose(np.asarray(ext.k_lktd)[:, :, :n], np.asarray(full.k_lktd)[:, :, :n],
                             rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(ext.v_lktd)[:, :, :n], np.asarray(full.v_lktd)[:, :, :n],
                             rtol=1e-5, atol=1e-4)
  with pytest.raises(ValueError, match="max_prefill_length"):
    engine.prefill(params=params, existing_prefix=ext,
                   padded_tokens=engine.pad_tokens(np.arange(30, 36))[0], true_length=6)

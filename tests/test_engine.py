"""Paged decode engine: sampling math, paged decode against full recompute (both layer
loops), prefix sharing, sharded meshes, multi-step calls, page-width buckets, the Pallas
TPU attention route in interpret mode, and recompilation counts."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.sampler.decode import layer_params
from rl_jax.sampler import engine as E
from rl_jax.sampler import page_table as pt
from rl_jax.sampler import sampling

CFG = model.get_preset("tiny_char")
PAGE = 4
MAX_PREFILL = 16
MAX_NEW = 20


def make_engine(mesh_shape=(1, 1, 1), **kw):
  devices = jax.devices()[:int(np.prod(mesh_shape))]
  args = dict(mesh=shd.make_mesh(mesh_shape, devices), max_concurrent_decodes=4,
              page_size=PAGE, num_pages=48, max_prefill_length=MAX_PREFILL,
              max_new_tokens=MAX_NEW)
  args.update(kw)
  return E.Engine(CFG, **args)


@pytest.fixture(scope="module")
def params():
  # Random init scaled up so greedy decoding does not collapse onto one token.
  p = model.init_params(CFG, jax.random.key(1))
  return jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, p)


@pytest.fixture(scope="module", params=["unrolled", "scan"])
def engine(request):
  """Both decode layer loops: unrolled (per-layer pools) and lax.scan (stacked pools)."""
  eng = make_engine(layers=request.param)
  assert eng.layers == request.param
  return eng


@functools.lru_cache(maxsize=None)
def _apply_fn():
  return jax.jit(lambda p, t: model.apply(CFG, p, t))


def reference_greedy(params, prompts, num_tokens):
  """Greedy continuation by full recompute: tokens [n, num_tokens], logprobs (T=1).
  Rows padded to a multiple of 4 and width 32, so one program serves every call."""
  width = 32
  assert max(len(p) for p in prompts) + num_tokens <= width
  seqs = [list(p) for p in prompts]
  toks, lps = [], []
  for _ in range(num_tokens):
    batch = np.zeros((-(-len(seqs) // 4) * 4, width), np.int32)
    for i, s in enumerate(seqs):
      batch[i, :len(s)] = s
    logp = jax.nn.log_softmax(_apply_fn()(params, jnp.asarray(batch)), axis=-1)
    last = np.asarray([logp[i, len(s) - 1] for i, s in enumerate(seqs)])
    nxt = last.argmax(-1)
    toks.append(nxt)
    lps.append(last[np.arange(len(seqs)), nxt])
    for s, t in zip(seqs, nxt):
      s.append(int(t))
  return np.stack(toks, 1), np.stack(lps, 1)


def start(engine, params, state, alloc, slot, prompt, **kw):
  padded, n = engine.pad_tokens(prompt)
  prefix = engine.prefill(params=params, padded_tokens=padded, true_length=n)
  pages = alloc.allocate(pt.pages_for(n - 1 + MAX_NEW, PAGE))
  kw.setdefault("sampling", E.Sampling.greedy())
  kw.setdefault("stop_on_eos", False)
  return engine.insert(prefix, state, slot, pages=pages, **kw), pages


def programs(engine):
  """Compiled programs per jitted engine operation. jax.jit of a module-level function
  (e.g. engine._prefill) shares its compilation cache across Engine instances, so a
  test compares these before and after its own calls, never as absolute counts."""
  full = engine.generate_program(engine.max_concurrent_decodes, engine.pages_per_seq)
  return {"generate": full._cache_size(),
          "insert": engine._apply._cache_size(), "prefill": engine._prefill._cache_size()}


def decode(engine, params, state, steps):
  toks, lps, valid = [], [], []
  for _ in range(steps // engine.steps_per_call):
    state, out = engine.generate(params, state)
    out = jax.device_get(out)
    toks.append(out.tokens_sb)
    lps.append(out.logprobs_sb)
    valid.append(out.valid_sb)
  return state, np.concatenate(toks).T, np.concatenate(lps).T, np.concatenate(valid).T


PROMPTS = [np.array([1, 5]), np.array([1, 7, 9, 11]), np.array([1, 20, 21, 22, 23]),
           np.arange(30, 41)]


def test_from_config_derives_pool_from_kv_bytes():
  from configs import base
  sampler = base.get_config().sampler
  sampler.num_pages, sampler.page_size, sampler.kv_cache_bytes = 0, 16, 3 * 2 ** 20
  eng = E.Engine.from_config(sampler, CFG, mesh=shd.make_mesh((1, 1, 1), jax.devices()[:1]))
  per_page = 2 * CFG.num_layers * 16 * CFG.num_kv_heads * CFG.head_dim * 4
  assert eng.num_pages == 3 * 2 ** 20 // per_page
  assert eng.max_concurrent_decodes == sampler.max_concurrent_decodes
  sampler.num_pages = 100
  assert E.Engine.from_config(sampler, CFG, mesh=eng.mesh).num_pages == 100


def _sample_rows(logits, n, seed, temperature, top_k, top_p):
  """E.sample_tokens on n copies of `logits`, keys split from key(seed): one jitted
  program (traced per call, so a patched TRUNCATION_CAP applies) instead of an eager
  compile per op."""
  @jax.jit
  def draw(logits):
    return E.sample_tokens(
        logits_bv=jnp.tile(logits, (n, 1)),
        keys_br=jax.random.key_data(jax.random.split(jax.random.key(seed), n)),
        temperature_b=jnp.full((n,), temperature), top_k_b=jnp.full((n,), top_k, jnp.int32),
        top_p_b=jnp.full((n,), top_p))
  return draw(logits)


def test_sample_tokens_temperature_matches_softmax():
  logits = np.asarray([1.0, 0.2, -0.5, 2.0, 0.0, -1.5], np.float32)
  n, temp = 6000, 0.7
  tokens, logprobs = _sample_rows(logits, n, 0, temp, 0, 1.0)
  probs = np.asarray(jax.jit(lambda x: jax.nn.softmax(x / temp))(logits))
  counts = np.bincount(np.asarray(tokens), minlength=6)
  chi2 = float(np.sum((counts - n * probs) ** 2 / (n * probs)))
  assert chi2 < 20.5, (chi2, counts, n * probs)  # 5 dof: p = 0.001
  np.testing.assert_allclose(np.asarray(logprobs), np.log(probs)[np.asarray(tokens)],
                             atol=1e-5)


@pytest.mark.parametrize("top_k,top_p,cap,allowed", [
    (3, 1.0, 256, [0, 1, 3]), (0, 0.75, 256, [0, 3]), (3, 0.5, 256, [3]),
    (3, 1.0, 4, [0, 1, 3]), (0, 0.75, 4, [0, 3]), (0, 0.9999, 4, [0, 1, 3, 4])])
def test_sample_tokens_truncation(top_k, top_p, cap, allowed, monkeypatch):
  """Truncated sampling equals the softmax over the kept tokens; a nucleus wider than
  the top_k cap is cut at the cap's candidates."""
  monkeypatch.setattr(sampling, "TRUNCATION_CAP", cap)
  logits = np.asarray([1.0, 0.2, -0.5, 2.0, 0.0, -1.5], np.float32)
  n = 3000
  tokens, logprobs = _sample_rows(logits, n, 1, 1.0, top_k, top_p)
  probs = np.zeros(6)
  kept = logits[np.asarray(allowed)]
  probs[allowed] = np.exp(kept - kept.max()) / np.exp(kept - kept.max()).sum()
  counts = np.bincount(np.asarray(tokens), minlength=6)
  assert set(np.flatnonzero(counts)) == set(allowed)
  keep = probs > 0
  chi2 = float(np.sum((counts[keep] - n * probs[keep]) ** 2 / (n * probs[keep])))
  assert chi2 < 16.3, (chi2, counts)  # <= 2 dof: p = 0.0003
  np.testing.assert_allclose(np.asarray(logprobs), np.log(probs[np.asarray(tokens)]),
                             atol=1e-5)


def test_threefry_keys_match_jax():
  """The unrolled Threefry equals JAX's, and request / step keys equal JAX's fold_in."""
  import jax.extend.random as jr
  key = np.asarray(jax.random.key_data(jax.random.key(3)))
  x = np.arange(10, dtype=np.uint32) * 977
  y0, y1 = jax.jit(sampling.threefry2x32)(key[0], key[1], x[:5], x[5:])
  np.testing.assert_array_equal(np.concatenate([y0, y1]), jr.threefry_2x32(key, x))
  for seed, index in ((0, 0), (7, 3), (2 ** 31 - 1, 1000)):
    want = jax.random.fold_in(jax.random.key(seed), index)
    raw = sampling.request_key(seed, index)
    np.testing.assert_array_equal(raw, jax.random.key_data(want))
    np.testing.assert_array_equal(
        jax.jit(sampling.step_keys)(np.asarray(raw)[None], np.asarray([5]))[0],
        jax.random.key_data(jax.random.fold_in(want, 5)))


def test_step_programs_have_no_loop_sort_or_conditional(params, default_emitters):
  """One decode step per call compiles to straight-line HLO (a cost analysis counts all
  of it); the truncating variant only once a request truncates."""
  eng = make_engine(steps_per_call=1)
  p_shapes = jax.eval_shape(eng.load_params, params)
  s_shapes = jax.eval_shape(eng.init_decode_state)
  for truncate in (False, True):
    hlo = eng.generate_program(4, eng.pages_per_seq, truncate=truncate).lower(
        p_shapes, s_shapes).compile(compiler_options=default_emitters).as_text()
    assert " while(" not in hlo and " conditional(" not in hlo
    assert (" sort(" in hlo or "topk" in hlo.lower()) == truncate
  state = eng.init_decode_state()
  alloc = pt.PageAllocator(num_pages=eng.num_pages, page_size=PAGE)
  state, _ = start(eng, params, state, alloc, 0, PROMPTS[0],
                   sampling=E.Sampling(temperature=0.5))
  assert not eng.truncate
  start(eng, params, state, alloc, 1, PROMPTS[1], sampling=E.Sampling(top_p=0.9))
  assert eng.truncate


@pytest.mark.parametrize("implementation", ["xla", "splash"])
def test_lane_attention_equals_each_prompt_alone(implementation):
  """The prefill lane's packed attention (XLA mask, or splash segment ids in interpret
  mode) equals causal attention over each prompt on its own; padding is segment -1."""
  from rl_jax.sampler import prefill_lane
  lengths = (5, 1, 7, 3)  # the last three positions are padding
  seg = np.concatenate([np.full(n, i if i < 3 else -1) for i, n in enumerate(lengths)])
  q, k, v = (np.asarray(jax.random.normal(jax.random.key(i), (1, len(seg), h, 8)))
             for i, h in enumerate((6, 2, 2)))
  # Jitted, as in the sampler: one compile each, not one per eager op.
  out = jax.jit(functools.partial(prefill_lane.lane_attention, implementation=implementation))(
      q, k, v, np.asarray(seg, np.int32))
  reference = jax.jit(functools.partial(model.causal_attention, implementation="jnp"))
  at = 0
  for n in lengths[:3]:
    sl = slice(at, at + n)
    want = reference(q[:, sl], k[:, sl], v[:, sl])
    np.testing.assert_allclose(out[:, sl], want, atol=1e-5)
    at += n


def test_sample_tokens_greedy_reports_model_logprob():
  logits = np.asarray(jax.random.normal(jax.random.key(2), (3, 11)))
  tokens, logprobs = jax.jit(lambda x: E.sample_tokens(
      logits_bv=x, keys_br=jax.random.key_data(jax.random.split(jax.random.key(0), 3)),
      temperature_b=jnp.zeros((3,)), top_k_b=jnp.full((3,), 2, jnp.int32),
      top_p_b=jnp.full((3,), 0.3)))(logits)
  np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
  np.testing.assert_allclose(
      logprobs, jax.jit(lambda x: jnp.max(jax.nn.log_softmax(x, -1), -1))(logits), atol=1e-6)


def test_paged_greedy_matches_recompute_with_slot_reuse(engine, params):
  before = programs(engine)
  state = engine.init_decode_state()
  alloc = pt.PageAllocator(num_pages=engine.num_pages, page_size=PAGE)
  owned = {}
  for slot, prompt in enumerate(PROMPTS):
    state, owned[slot] = start(engine, params, state, alloc, slot, prompt)
  state, toks, lps, valid = decode(engine, params, state, 8)
  assert valid.all()
  ref_t, ref_lp = reference_greedy(params, PROMPTS, 16)
  np.testing.assert_array_equal(toks, ref_t[:, :8])
  np.testing.assert_allclose(lps, ref_lp[:, :8], atol=1e-4)
  # At most one new program per operation for four prompts of different lengths (every
  # prompt fits the 16 prefill bucket) and eight decode calls; none new when another
  # engine of the same shapes and shardings already compiled it.
  first = programs(engine)
  assert all(1 <= first[k] <= before[k] + 1 for k in first), (before, first)

  # Reuse slot 1 for a new prompt; its freed pages go straight to the new sequence.
  state = engine.free_slots(state, [1])
  alloc.release(owned[1])
  new_prompt = np.array([1, 60, 61, 62, 63, 64, 65])
  state, owned[1] = start(engine, params, state, alloc, 1, new_prompt)
  state, toks2, lps2, valid2 = decode(engine, params, state, 8)
  assert valid2.all()
  new_t, new_lp = reference_greedy(params, [new_prompt], 8)
  others = [0, 2, 3]
  np.testing.assert_array_equal(toks2[others], ref_t[others, 8:])
  np.testing.assert_allclose(lps2[others], ref_lp[others, 8:], atol=1e-4)
  np.testing.assert_array_equal(toks2[1], new_t[0])
  np.testing.assert_allclose(lps2[1], new_lp[0], atol=1e-4)

  # One compiled program per operation, however many calls: slot reuse, another prefill
  # and insert and eight more decode calls compile nothing new.
  assert programs(engine) == first


def test_move_slots_then_decode_a_prefix_of_slots(engine, params):
  state = engine.init_decode_state()
  alloc = pt.PageAllocator(num_pages=engine.num_pages, page_size=PAGE)
  state, _ = start(engine, params, state, alloc, 3, PROMPTS[3])
  state, first, _, _ = decode(engine, params, state, 3)
  # Only the registers move; the KV stays in the same pages.
  state = engine.move_slots(state, [3], [0])
  toks = []
  for _ in range(5):
    state, out = engine.generate(params, state, num_slots=1)
    assert out.tokens_sb.shape == (1, 1) and bool(out.valid_sb[0, 0])
    toks.append(int(out.tokens_sb[0, 0]))
  ref_t, _ = reference_greedy(params, [PROMPTS[3]], 8)
  np.testing.assert_array_equal(np.concatenate([first[3], toks]), ref_t[0])
  assert not np.asarray(state.active_b)[1:].any()
  with pytest.raises(ValueError, match="num_slots"):
    engine.generate(params, state, num_slots=5)


def test_length_limit_and_idle_slots(engine, params):
  state = engine.init_decode_state()
  alloc = pt.PageAllocator(num_pages=engine.num_pages, page_size=PAGE)
  state, _ = start(engine, params, state, alloc, 2, PROMPTS[2], max_new_tokens=3)
  state, toks, _, valid = decode(engine, params, state, 5)
  assert valid[2].tolist() == [True, True, True, False, False]
  assert not valid[[0, 1, 3]].any()
  ref_t, _ = reference_greedy(params, [PROMPTS[2]], 3)
  np.testing.assert_array_equal(toks[2, :3], ref_t[0])


def test_shared_prefix_equals_separate_prefills(engine, params):
  prompt = np.array([1, 40, 41, 42, 43, 44, 45])  # 6 cached tokens: 1 full page + 2
  sampling = E.Sampling(temperature=1.0, top_k=0, top_p=1.0)
  padded, n = engine.pad_tokens(prompt)
  prefix = engine.prefill(params=params, padded_tokens=padded, true_length=n)

  alloc = pt.PageAllocator(num_pages=engine.num_pages, page_size=PAGE)
  shared = engine.init_decode_state()
  group_pages = alloc.allocate(2)  # one full page shared, one template partial page
  shared = engine.write_prefix(prefix, shared, pages=group_pages)
  entries = []
  for i in range(3):
    private = alloc.allocate(pt.pages_for(n - 1 + MAX_NEW, PAGE) - 1)
    alloc.share(group_pages[:1])
    entries.append(dict(slot=i, pages=[group_pages[0]] + list(private), token=prompt[-1],
                        length=n - 1, max_new_tokens=MAX_NEW, stop_on_eos=False, seed=5,
                        sample_index=i, sampling=sampling,
                        copy=(group_pages[1], private[0])))
  shared = engine.insert_many(shared, entries)
  assert alloc.refcount(int(group_pages[0])) == 4
  shared, toks_a, lps_a, _ = decode(engine, params, shared, 8)

  separate = engine.init_decode_state()
  alloc2 = pt.PageAllocator(num_pages=engine.num_pages, page_size=PAGE)
  for i in range(3):
    separate, _ = start(engine, params, separate, alloc2, i, prompt, sampling=sampling,
                        seed=5, sample_index=i)
  separate, toks_b, lps_b, _ = decode(engine, params, separate, 8)
  np.testing.assert_array_equal(toks_a[:3], toks_b[:3])
  np.testing.assert_allclose(lps_a[:3], lps_b[:3], atol=1e-5)
  assert len({tuple(t) for t in toks_a[:3]}) == 3  # per-sample keys differ


def test_sharded_meshes_and_multistep_match_single_device(engine, params):
  state = engine.init_decode_state()
  alloc = pt.PageAllocator(num_pages=engine.num_pages, page_size=PAGE)
  for slot, prompt in enumerate(PROMPTS):
    state, _ = start(engine, params, state, alloc, slot, prompt)
  _, want, want_lp, _ = decode(engine, params, state, 6)

  for kw in (dict(mesh_shape=(1, 1, 2)), dict(mesh_shape=(2, 1, 1)), dict(steps_per_call=3)):
    eng = make_engine(**kw)
    p = eng.load_params(params)
    if kw.get("mesh_shape") == (1, 1, 2):
      spec = eng.state_shardings.k_pages[0].spec
      assert tuple(spec) == ("tensor", None, None, None)
      k = layer_params(p, 0)["k"]  # [e, k, d] (per-layer weights when unrolled)
      assert isinstance(p["layers"], tuple) == (eng.layers == "unrolled")
      assert k.sharding.spec[1] == "tensor"
    if kw.get("mesh_shape") == (2, 1, 1):  # slots split over data, pools replicated
      assert tuple(eng.state_shardings.page_table_bm.spec) == ("data", None)
      assert tuple(eng.state_shardings.k_pages[0].spec) == (None,) * 4
    state = eng.init_decode_state()
    alloc = pt.PageAllocator(num_pages=eng.num_pages, page_size=PAGE)
    for slot, prompt in enumerate(PROMPTS):
      state, _ = start(eng, p, state, alloc, slot, prompt)
    state, got, got_lp, _ = decode(eng, p, state, 6)
    assert state.k_pages[0].sharding == eng.state_shardings.k_pages[0]
    np.testing.assert_array_equal(got, want, err_msg=str(kw))
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-4, err_msg=str(kw))


def _started_state(eng, params, sampling):
  state = eng.init_decode_state()
  alloc = pt.PageAllocator(num_pages=eng.num_pages, page_size=PAGE)
  for slot, prompt in enumerate(PROMPTS):
    state, _ = start(eng, params, state, alloc, slot, prompt, sampling=sampling, seed=slot)
  return state


def test_scanned_and_unrolled_layers_give_identical_results(params):
  """Also the "ragged" attention (live pages only) against the page-table gather."""
  sampling = E.Sampling(temperature=1.0, top_k=10, top_p=0.95)
  results = {}
  for layers, attention in (("unrolled", "jnp"), ("scan", "jnp"), ("unrolled", "ragged")):
    eng = make_engine(layers=layers, steps_per_call=2, attention=attention)
    state = _started_state(eng, params, sampling)
    if layers == "unrolled" and attention == "jnp":
      assert isinstance(state.k_pages, tuple) and len(state.k_pages) == CFG.num_layers
      assert state.k_pages[0].shape == (CFG.num_kv_heads, eng.num_pages, PAGE, CFG.head_dim)
    elif layers == "scan":
      assert state.k_pages.shape == (CFG.num_layers, CFG.num_kv_heads, eng.num_pages, PAGE,
                                     CFG.head_dim)
    _, toks, lps, valid = decode(eng, params, state, 10)
    assert valid.all()
    results[layers, attention] = (toks, lps)
  want = results["unrolled", "jnp"]
  for key in (("scan", "jnp"), ("unrolled", "ragged")):
    np.testing.assert_array_equal(results[key][0], want[0], err_msg=str(key))
    np.testing.assert_allclose(results[key][1], want[1], atol=1e-4, err_msg=str(key))


def test_page_width_buckets_read_fewer_pages_same_tokens(engine, params):
  """Decoding with the narrowest page-table width that holds every slot equals decoding
  over all columns; one program per (slot, width) bucket pair, however many calls."""
  assert engine.page_buckets == (1, 2, 3, 4, 6, 8, 9)  # pages_for(16 + 20, 4) = 9
  assert engine.page_bucket(1) == 1 and engine.page_bucket(9) == 3
  assert engine.page_bucket(33) == 9 and engine.page_bucket(36) == 9
  sampling = E.Sampling(temperature=1.0)
  full = _started_state(engine, params, sampling)
  _, want, want_lp, _ = decode(engine, params, full, 6)
  narrow = _started_state(engine, params, sampling)
  lengths = np.asarray(narrow.lengths_b)  # cached prompt tokens: 1, 3, 4, 10
  toks, lps = [], []
  before = {k: f._cache_size() for k, f in engine._generate.items()}
  for i in range(6):
    width = engine.page_bucket(int(lengths.max()) + i + 1)
    assert width < engine.pages_per_seq
    narrow, out = engine.generate(params, narrow, num_pages=width)
    toks.append(np.asarray(out.tokens_sb))
    lps.append(np.asarray(out.logprobs_sb))
  np.testing.assert_array_equal(np.concatenate(toks).T, want)
  # A different width changes the float reduction order only: recompute's tolerance.
  np.testing.assert_allclose(np.concatenate(lps).T, want_lp, atol=1e-4)
  after = {k: f._cache_size() for k, f in engine._generate.items()}
  new = {k: after[k] - before.get(k, 0) for k in after}
  assert all(n <= 1 for n in new.values()), new  # widths 3 then 4: one program each
  with pytest.raises(ValueError, match="num_pages"):
    engine.generate(params, narrow, num_pages=5)


def test_pallas_tpu_paged_attention_matches_jnp_in_interpret_mode():
  """The TPU route (jax.experimental.pallas.ops.tpu.paged_attention) against the jnp
  gather, on CPU under pltpu.force_tpu_interpret_mode (no TPU here)."""
  from rl_jax.sampler import decode as D
  pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  if not hasattr(pltpu, "force_tpu_interpret_mode"):
    pytest.skip("this jax has no TPU interpret mode")
  kh, n, p, d, b, h, w = 2, 13, 4, 32, 3, 4, 4
  rng = np.random.default_rng(0)
  k_knpd = jnp.asarray(rng.normal(size=(kh, n, p, d)), jnp.float32)
  v_knpd = jnp.asarray(rng.normal(size=(kh, n, p, d)), jnp.float32)
  q_bhd = jnp.asarray(rng.normal(size=(b, h, d)), jnp.float32)
  table_bw = jnp.asarray(rng.permutation(np.arange(1, n))[:b * w].reshape(b, w), jnp.int32)
  kv_len_b = jnp.asarray([5, 16, 1], jnp.int32)
  want = D.paged_attention_jnp(q_bhd, k_knpd, v_knpd, table_bw, kv_len_b)
  with pltpu.force_tpu_interpret_mode():
    got = D.paged_attention_pallas_tpu(q_bhd, k_knpd, v_knpd, table_bw, kv_len_b)
  # NumPy reference for the jnp path itself.
  kk = np.asarray(k_knpd)[:, np.asarray(table_bw)].reshape(kh, b, w * p, d)
  vv = np.asarray(v_knpd)[:, np.asarray(table_bw)].reshape(kh, b, w * p, d)
  s = np.einsum("bkgd,kbsd->bkgs", np.asarray(q_bhd).reshape(b, kh, h // kh, d), kk) / d ** 0.5
  s = np.where(np.arange(w * p)[None, None, None] < np.asarray(kv_len_b)[:, None, None, None],
               s, -np.inf)
  a = np.exp(s - s.max(-1, keepdims=True))
  ref = np.einsum("bkgs,kbsd->bkgd", a / a.sum(-1, keepdims=True), vv).reshape(b, h, d)
  np.testing.assert_allclose(np.asarray(want), ref, atol=1e-5)
  # The kernel's exp / reciprocal are TPU approximations even when interpreted.
  np.testing.assert_allclose(np.asarray(got), ref, atol=2e-2)


def test_prefill_into_pages_equals_one_prefill_per_prompt(engine, params):
  """One batched prefill call writes the same K/V into every prompt's pages as a
  prefill + write_prefix per prompt (the null page, which absorbs padding, aside)."""
  alloc = pt.PageAllocator(num_pages=engine.num_pages, page_size=PAGE)
  pages = [alloc.allocate(pt.pages_for(len(p) - 1, PAGE)) for p in PROMPTS]
  one_by_one = engine.init_decode_state()
  for prompt, pg in zip(PROMPTS, pages):
    padded, n = engine.pad_tokens(prompt)
    prefix = engine.prefill(params=params, padded_tokens=padded, true_length=n)
    one_by_one = engine.write_prefix(prefix, one_by_one, pages=pg)
  batched = engine.prefill_into_pages(params, engine.init_decode_state(), PROMPTS, pages)
  for a, b in zip(jax.tree.leaves((one_by_one.k_pages, one_by_one.v_pages)),
                  jax.tree.leaves((batched.k_pages, batched.v_pages))):
    a, b = np.asarray(a)[..., 1:, :, :], np.asarray(b)[..., 1:, :, :]
    assert np.abs(a).sum() > 0
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)  # batch shape changes rounding


def test_bf16_pool_is_written_in_place_on_cpu(params, monkeypatch, default_emitters):
  """Issue 29: XLA's CPU backend upcast the whole pool of every bf16 KV scatter to f32
  and back, so a generate call's temporaries (and time) grew with the pool. Stored as
  uint16 bits on CPU, the fused generate program needs far less than one pool of
  temporaries and decodes bit for bit what bf16 storage decoded."""
  from rl_jax.sampler import decode as D
  from rl_jax.sampler import updates

  def run(eng):
    p = eng.load_params(params)
    state = eng.init_decode_state()
    pool_bytes = sum(x.nbytes for x in jax.tree.leaves((state.k_pages, state.v_pages)))
    layout = eng.fused_layout._replace(lane=eng.prefill_lane)
    upd = updates.Pending(eng.max_concurrent_decodes, eng.prefill_lane).pack(layout)
    program = eng.generate_program(eng.max_concurrent_decodes, eng.pages_per_seq, fused=2)
    temp = program.lower(p, state, upd).compile(
        compiler_options=default_emitters).memory_analysis().temp_size_in_bytes
    alloc = pt.PageAllocator(num_pages=eng.num_pages, page_size=PAGE)
    for slot, prompt in enumerate(PROMPTS):
      state, _ = start(eng, p, state, alloc, slot, prompt)
    state, toks, lps, _ = decode(eng, p, state, 4)
    pools = [np.asarray(D.pool_view(x)) for x in jax.tree.leaves(state.k_pages)]
    return temp, pool_bytes, toks, lps, pools

  temp, pool_bytes, toks, lps, pools = run(make_engine(dtype="bfloat16", num_pages=16384))
  assert pools[0].dtype == jnp.bfloat16 and temp < pool_bytes / 8, (temp, pool_bytes)
  monkeypatch.setattr(D, "pool_dtype", lambda kv_dtype, backend=None: jnp.dtype(kv_dtype))
  old_temp, _, old_toks, old_lps, old_pools = run(make_engine(dtype="bfloat16", num_pages=16384))
  assert old_temp > pool_bytes  # the f32 copy of a bf16 pool the CPU scatter made
  np.testing.assert_array_equal(toks, old_toks)
  np.testing.assert_array_equal(lps, old_lps)
  for a, b in zip(pools, old_pools):
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))

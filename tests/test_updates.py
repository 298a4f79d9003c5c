"""Staged slot / page-table updates (sampler/updates.py) and the Generator's fused pass
program: one Pending applied at once equals the operations one by one (a NumPy
reference), and a Generator whose passes are one fused call (prefill lane, updates,
decode) equals one driving the separate engine calls."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.sampler import engine as E
from rl_jax.sampler import generator as G
from rl_jax.sampler import page_table as pt
from rl_jax.sampler import updates

from test_engine import params  # noqa: F401  (a fixture)
from test_engine import make_engine as _engine


def make_engine(**kw):
  return _engine(**{"num_pages": 24, "max_prefill_length": 8, "max_new_tokens": 6, **kw})


REGS = ("tokens_b", "lengths_b", "active_b", "generated_b", "max_new_b", "stop_on_eos_b",
        "keys_br", "temperature_b", "top_k_b", "top_p_b", "page_table_bm")


class Reference:
  """The registers, page tables and pools after each operation, one at a time (NumPy)."""

  def __init__(self, state):
    self.r = {f: np.array(getattr(state, f)) for f in REGS}
    self.k = [np.array(x) for x in state.k_pages]
    self.v = [np.array(x) for x in state.v_pages]

  def insert(self, e):
    s, smp = e["slot"], e["sampling"]
    key = jax.random.key_data(jax.random.fold_in(jax.random.key(e["seed"]), e["sample_index"]))
    for f, v in (("tokens_b", e["token"]), ("lengths_b", e["length"]), ("active_b", True),
                 ("generated_b", 0), ("max_new_b", e["max_new_tokens"]),
                 ("stop_on_eos_b", e["stop_on_eos"]), ("keys_br", np.asarray(key)),
                 ("temperature_b", smp.temperature), ("top_k_b", smp.top_k),
                 ("top_p_b", smp.top_p),
                 ("page_table_bm", pt.page_table_row(e["pages"], self.r["page_table_bm"].shape[1]))):
      self.r[f][s] = v
    if e.get("copy"):
      src, dst = e["copy"]
      for pool in self.k + self.v:
        pool[:, dst] = pool[:, src]

  def free(self, s, undo_copy=None):
    self.r["active_b"][s] = False
    self.r["page_table_bm"][s] = pt.NULL_PAGE
    if undo_copy is not None:  # page, contents: the update drops the copy of an insert
      page, contents = undo_copy  # it cancels, so that page may be reused in the pass
      for pool, x in zip(self.k + self.v, contents):
        pool[:, page] = x

  def move(self, src, dst):
    for f in REGS:
      self.r[f][dst] = self.r[f][src]
    self.free(src)

  def set_rows(self, s, pages):
    self.r["page_table_bm"][s] = pt.page_table_row(pages, self.r["page_table_bm"].shape[1])


def entry(slot, pages, seed, copy=None, temperature=0.7):
  return dict(slot=slot, pages=pages, token=10 + slot, length=3 + slot, max_new_tokens=5 + seed,
              stop_on_eos=bool(seed % 2), seed=seed, sample_index=seed + 1,
              sampling=E.Sampling(temperature=temperature, top_k=seed, top_p=0.5 + 0.1 * slot),
              copy=copy)


def test_pending_equals_the_operations_one_by_one():
  engine = make_engine()
  rng = np.random.default_rng(0)
  state = engine.init_decode_state()
  state = jax.device_put(state._replace(
      k_pages=tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in state.k_pages),
      v_pages=tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in state.v_pages)),
      engine.state_shardings)
  ref = Reference(state)
  # Pass 1: three sequences start (one copies a partial prompt page).
  first = [entry(0, [1, 2], 1), entry(1, [3], 2, copy=(9, 3)), entry(2, [4, 5], 3)]
  # Pass 2 in one update: a move, a slot reused at once, growth of a moved sequence, a
  # free, an insert that then moves, and an insert cancelled by a free (its page copy
  # must not happen: page 12 keeps its contents).
  second = [("move", 2, 3), ("insert", entry(2, [6], 4, copy=(10, 6))),
            ("set_rows", 3, [4, 5, 7]), ("free", 0), ("insert", entry(0, [8], 5)),
            ("move", 0, 1), ("insert", entry(0, [11, 12], 6, copy=(9, 12))), ("free", 0)]
  page_12 = [x[:, 12].copy() for x in ref.k + ref.v]
  for batch in ([("insert", e) for e in first], second):
    pending = updates.Pending(engine.max_concurrent_decodes)
    for i, (op, *args) in enumerate(batch):
      getattr(pending, op)(*args)
      cancels = op == "free" and i > 0 and batch[i - 1][0] == "insert"
      getattr(ref, op)(*args, *([(12, page_12)] if cancels else []))
    state = engine.apply_updates(state, pending)
    got = {f: np.asarray(getattr(state, f)) for f in REGS}
    np.testing.assert_array_equal(got["active_b"], ref.r["active_b"])
    np.testing.assert_array_equal(got["page_table_bm"], ref.r["page_table_bm"])
    live = ref.r["active_b"]
    for f in REGS:
      np.testing.assert_array_equal(got[f][live], ref.r[f][live], err_msg=f)
    for a, b in zip(state.k_pages + state.v_pages, ref.k + ref.v):
      np.testing.assert_array_equal(np.asarray(a), b)
  assert ref.r["active_b"].tolist() == [False, True, True, True]
  # One program for every update.
  assert engine._apply._cache_size() == 1


def count_calls(engine, separate):
  """Counts the engine's pass calls, prefills and standalone updates (instance attributes
  shadow the methods); separate=True replaces the fused pass call by the separate
  engine calls: prefill, updates, generate."""
  calls = {"apply_and_generate": 0, "prefill_into_pages": 0, "apply_updates": 0}
  cls = type(engine)

  def counted(name, fn):
    def call(*args, **kw):
      calls[name] += 1
      return fn(*args, **kw)
    return call

  def pass_call(params, state, pending, **kw):
    if not separate:
      return cls.apply_and_generate(engine, params, state, pending, **kw)
    lane = pending.take_lane()
    if lane:
      state = engine.prefill_into_pages(params, state, *zip(*lane))
    state = engine.apply_updates(state, pending)
    pending.clear()
    state, out = engine.generate(params, state, **kw)
    return state, updates.pack_output(out)

  engine.prefill_into_pages = counted("prefill_into_pages",
                                      functools.partial(cls.prefill_into_pages, engine))
  engine.apply_updates = counted("apply_updates", functools.partial(cls.apply_updates, engine))
  engine.apply_and_generate = counted("apply_and_generate", pass_call)
  return calls


def test_fused_passes_equal_separate_calls(params):
  engine = make_engine(max_concurrent_decodes=2, max_new_tokens=4, prefill_lane=4)
  # One update row per fused call, so a pass that starts two sequences (or starts one
  # and grows the other) applies its updates with a call of their own first.
  engine.fused_layout = engine.fused_layout._replace(rows=1)
  new_params = jax.tree.map(lambda x: x * 1.05, params)
  # Cached prompt tokens 4 (lane), 7 (too long for the lane; one full shared page and
  # a partial one), 2, 0 and 3 (lane): six samples on two slots.
  prompts = {0: np.array([1, 5, 6, 7, 8]), 1: np.arange(20, 28), 2: np.array([1, 40, 41]),
             3: np.array([1]), 4: np.array([1, 60, 61, 62])}

  def run(separate):
    calls = count_calls(engine, separate)
    gen = G.Generator(engine, params, sampling=E.Sampling(temperature=0.9))
    for gid, prompt in prompts.items():
      gen.add_group(gid, prompt, 2 if gid == 1 else 1, seed=gid, stop_on_eos=False,
                    max_new_tokens=2 + gid % 3)
    out = []
    for i in range(200):
      if not gen.num_active and not gen.num_pending:
        break
      if i == 1:
        gen.update_params(new_params, 1)
      out += gen.step()
    return calls, {(r.group_id, r.sample_index): r for r in out}

  fused_calls, fused = run(separate=False)
  sep_calls, separate = run(separate=True)
  # Every path ran: the lane, a prompt too long for it, updates that overflow the
  # fused call, in one dispatch per pass otherwise.
  assert fused_calls["prefill_into_pages"] >= 1 and fused_calls["apply_updates"] >= 1
  assert sep_calls["apply_updates"] == sep_calls["apply_and_generate"]
  assert fused_calls["apply_updates"] < fused_calls["apply_and_generate"]
  assert any(key[3] == 2 for key in engine._generate), "no pass used the prefill lane"
  assert fused.keys() == separate.keys() and len(fused) == 6
  for key, r in fused.items():
    s = separate[key]
    np.testing.assert_array_equal(r.completion_tokens, s.completion_tokens, err_msg=str(key))
    np.testing.assert_allclose(r.behavior_logprobs, s.behavior_logprobs, atol=1e-5)
    np.testing.assert_array_equal(r.token_versions, s.token_versions)
    assert r.finish_reason == s.finish_reason == "length"
  assert any(r.mixed_versions for r in fused.values())

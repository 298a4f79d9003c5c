"""Background compilation of the sampler's programs (sampler/programs.py): which compiled
program covers a call, that a generator whose new buckets compile on an executor
samples what inline compilation samples, and that failures and misuse are reported."""
import concurrent.futures

import jax
import numpy as np
import pytest

from configs import default
from rl_jax import config as config_lib
from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.orchestration import build, loop
from rl_jax.sampler import engine as E
from rl_jax.sampler import generator as G
from rl_jax.sampler import programs

CFG = model.get_preset("tiny_char")
SAMPLING = E.Sampling(temperature=1.0)


class ManualExecutor(concurrent.futures.Executor):
  """Runs submitted work only in run_all(): the test decides when a compile finishes."""

  def __init__(self):
    self.jobs = []

  def submit(self, fn, /, *args, **kwargs):
    future = concurrent.futures.Future()
    self.jobs.append((future, fn, args, kwargs))
    return future

  def run_all(self) -> int:
    jobs, self.jobs = self.jobs, []
    for future, fn, args, kwargs in jobs:
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001  (the future carries it)
          future.set_exception(e)
    return len(jobs)


def make_engine(executor=None):
  eng = E.Engine(CFG, mesh=shd.make_mesh((1, 1, 1), jax.devices()[:1]),
                 max_concurrent_decodes=8, page_size=4, num_pages=64, max_prefill_length=8,
                 max_new_tokens=6, steps_per_call=2)
  if executor is not None:
    eng.compile_in_background(executor)
  return eng


def gen_key(k, w, lane=0, truncate=False):
  return (k, w, 0, 2 if lane else 1, truncate, lane)


def test_generate_cover_is_the_cheapest_ready_program_that_covers_the_call():
  ready = [gen_key(8, 6), gen_key(4, 6), gen_key(8, 3, lane=4), gen_key(8, 6, lane=16),
           gen_key(2, 2, truncate=True), ("prefill", 4, 8), (8, 6, 0, 0, False, 0),
           (8, 6, 12, 1, False, 0)]
  cover = programs.generate_cover
  assert cover(ready, num_slots=5, num_pages=2, lane=0, truncate=False) == gen_key(8, 3, lane=4)
  # 4 x 6 and 8 x 3 tie on slots x columns: the one without a lane runs less.
  assert cover(ready, num_slots=3, num_pages=2, lane=0, truncate=False) == gen_key(4, 6)
  assert cover(ready, num_slots=3, num_pages=4, lane=0, truncate=False) == gen_key(4, 6)
  assert cover(ready, num_slots=5, num_pages=4, lane=8, truncate=False) == gen_key(8, 6, lane=16)
  assert cover(ready, num_slots=2, num_pages=2, lane=0, truncate=True) == gen_key(2, 2, truncate=True)
  # Nothing ready has 16 slots, a 32-token lane, or truncation at 4 slots.
  assert cover(ready, num_slots=16, num_pages=1, lane=0, truncate=False) is None
  assert cover(ready, num_slots=1, num_pages=1, lane=32, truncate=False) is None
  assert cover(ready, num_slots=4, num_pages=1, lane=0, truncate=True) is None


def test_prefill_plan_pads_to_a_ready_batch_or_splits_into_ready_batches():
  ready = [("prefill", 2, 8), ("prefill", 8, 16), ("prefill", 4, 8), gen_key(4, 4)]
  plan = programs.prefill_plan
  assert plan(ready, num_prompts=3, length=8) == (4, 8)
  assert plan(ready, num_prompts=5, length=8) == (8, 16)
  assert plan(ready, num_prompts=16, length=8) == (8, 16)  # two calls of 8
  assert plan(ready, num_prompts=3, length=16) == (8, 16)
  assert plan([("prefill", 2, 8), ("prefill", 4, 8)], num_prompts=9, length=8) == (4, 8)
  assert plan(ready, num_prompts=1, length=32) is None


def test_a_failed_background_compile_is_raised_on_the_callers_thread():
  class Broken:
    def lower(self, *args):
      raise ValueError("no such program")

  executor = ManualExecutor()
  progs = programs.Programs(executor)
  progs.schedule(("prefill", 1, 8), Broken(), (np.zeros(2, np.int32),))
  assert executor.run_all() == 1 and progs.lookup(("prefill", 1, 8)) is None
  with pytest.raises(RuntimeError, match="prefill', 1, 8") as info:
    progs.schedule(("prefill", 2, 8), Broken(), (np.zeros(2, np.int32),))
  assert isinstance(info.value.__cause__, ValueError)


def _sample(engine, params, executor=None, covers=False):
  """Rollouts of three waves: two groups of 4 with 7- and 8-token prompts (8 slots, the
  16-token lane, page widths 3 and 4), then twice one group of 2 with a 2-token prompt
  (2 slots, the 4-token lane, widths 1 and 2: under compile_in_background the first
  of these runs on the first wave's programs, which cover it in slots, width and lane,
  while its own compiles on the executor; they are compiled before the third wave,
  except with `covers`: the generator compiles its covering programs first and every
  call runs on them)."""
  gen = G.Generator(engine, params, sampling=SAMPLING)
  if covers:
    lane = engine.prefill_lane
    assert gen.compile_covers() == [(8, engine.pages_per_seq, 0, 2, False, lane),
                                    ("prefill", 8, engine.prefill_buckets[-1])]
    assert gen.compile_covers() == []  # once
  rng = np.random.default_rng(0)
  out = []
  for wave, (lengths, size) in enumerate([((7, 8), 4), ((2,), 2), ((2,), 2)]):
    for g, length in enumerate(lengths):
      prompt = rng.integers(3, CFG.vocab_size, size=length)
      gen.add_group(10 * wave + g, prompt, size, seed=10 * wave + g)
    for _ in range(200):
      if not gen.num_active and not gen.num_pending:
        break
      out.extend(gen.step())
    if executor is not None and wave == 1 and not covers:
      executor.run_all()
  return sorted(out, key=lambda r: (r.group_id, r.sample_index))


@pytest.fixture(scope="module")
def inline_rollouts():
  params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x,
                        model.init_params(CFG, jax.random.key(1)))
  return params, _sample(make_engine(), params)


def _assert_same_rollouts(got, want):
  assert [(r.group_id, r.sample_index) for r in got] == [
      (r.group_id, r.sample_index) for r in want]
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
    np.testing.assert_allclose(a.behavior_logprobs, b.behavior_logprobs, atol=1e-5)
    assert a.finish_reason == b.finish_reason


def test_background_compiles_sample_what_inline_compiles_sample(inline_rollouts):
  params, inline = inline_rollouts
  executor = ManualExecutor()
  engine = make_engine(executor)
  covered = _sample(engine, params, executor)
  progs = engine.programs
  # The first program compiled inline (nothing covered it); later buckets ran on covering
  # programs while theirs waited on the executor, which then compiled them.
  assert progs.compiled_inline >= 1 and progs.covered_calls >= 1
  assert progs.compiled_background >= 1
  _assert_same_rollouts(covered, inline)


@pytest.mark.parametrize("where", ["background", "ahead"])
def test_compiled_covers_serve_every_call_with_no_compile_in_the_run(inline_rollouts, where):
  params, inline = inline_rollouts
  if where == "background":
    executor = ManualExecutor()  # never runs: only the covers exist
    engine = make_engine(executor)
  else:  # sampler.compile="ahead": no executor, no other bucket ever compiles
    executor, engine = None, make_engine()
    engine.compile_covers_only()
  covered = _sample(engine, params, executor, covers=True)
  progs = engine.programs
  assert (progs.compiled_ahead, progs.compiled_inline, progs.compiled_background) == (2, 0, 0)
  assert progs.covered_calls >= 3
  if executor is not None:
    assert executor.jobs  # the calls' own buckets wait for the executor
  _assert_same_rollouts(covered, inline)


def test_covered_prefill_writes_the_pages_an_exact_prefill_writes():
  params = model.init_params(CFG, jax.random.key(2))
  prompts = [np.arange(3, 3 + n) for n in (5, 7, 3, 6, 8)]
  pages = [[2 * i + 1, 2 * i + 2] for i in range(len(prompts))]
  exact = make_engine()
  want = exact.prefill_into_pages(params, exact.init_decode_state(), prompts, pages)
  executor = ManualExecutor()
  eng = make_engine(executor)
  state = eng.prefill_into_pages(params, eng.init_decode_state(), prompts[:2], pages[:2])
  assert eng.programs.compiled_inline == 1  # the batch of 2
  state = eng.prefill_into_pages(params, state, prompts[2:], pages[2:])  # 3 prompts: 2 + 1
  assert eng.programs.covered_calls == 1 and len(executor.jobs) == 1
  for got, ref in zip(jax.tree.leaves((state.k_pages, state.v_pages)),
                      jax.tree.leaves((want.k_pages, want.v_pages))):
    np.testing.assert_allclose(np.asarray(got)[:11], np.asarray(ref)[:11], atol=1e-5)


def test_where_the_sampler_compiles():
  cfg = default.get_config()
  assert build.sampler_compile(cfg, multi=False) == "ahead"  # the default's choice
  cfg.sampler.compile = "auto"
  assert build.sampler_compile(cfg, multi=False) == "background"
  assert build.sampler_compile(cfg, multi=True) == "inline"
  cfg.rl.mode = "sync"
  assert build.sampler_compile(cfg, multi=False) == "inline"
  with pytest.raises(config_lib.ConfigError, match="'sampler.compile' may be 'background' only"):
    cfg.sampler.compile = "background"
    config_lib.validate(cfg)
  cfg.rl.mode = "async"
  with pytest.raises(loop.RunError, match="single-process"):
    build.sampler_compile(cfg, multi=True)
  cfg.sampler.compile = "ahead"  # the same programs every run: sync mode too
  for mode in ("async", "sync"):
    cfg.rl.mode = mode
    config_lib.validate(cfg)
    assert build.sampler_compile(cfg, multi=False) == "ahead"
  assert build.sampler_compile(cfg, multi=True) == "ahead"
  cfg.sampler.compile = "later"
  with pytest.raises(config_lib.ConfigError, match="sampler.compile"):
    config_lib.validate(cfg)

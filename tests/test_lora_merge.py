"""LoRA on the sampler (rl_jax/sampler/lora_merge.py): the merge against a NumPy
W0 + (alpha/r) A B, reuse of the previous target weights, decoding with merged weights
against the trainer's unmerged forward with the same compiled programs, and in-flight
adapter updates with per-token versions."""
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.model import lora
from rl_jax.sampler import engine as E
from rl_jax.sampler import generator as G
from rl_jax.sampler import lora_merge

CFG = model.get_preset("tiny_char").replace(lora_rank=8, lora_alpha=16.0,
                                             lora_targets=lora.TARGETS)
PAGE = 4
MAX_NEW = 12
PROMPTS = [np.array([1, 5, 6, 7, 8]), np.array([1, 9, 10, 11]), np.arange(20, 33)]


def make_engine(layers="unrolled", mesh_shape=(1, 1, 1)):
  devices = jax.devices()[:int(np.prod(mesh_shape))]
  return E.Engine(CFG, mesh=shd.make_mesh(mesh_shape, devices), max_concurrent_decodes=4,
                  page_size=PAGE, num_pages=40, max_prefill_length=16,
                  max_new_tokens=MAX_NEW, layers=layers)


@pytest.fixture(scope="module")
def base():
  p = model.init_params(CFG, jax.random.key(1))
  return jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, p)


def make_adapters(seed: int) -> dict:
  """A ~ N(0, 1/r) as initialised, and a non-zero B (a trained adapter)."""
  ad = lora.init_adapters(CFG, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 100), len(ad)))
  return {t: {"a": ab["a"], "b": 0.05 * jax.random.normal(next(keys), ab["b"].shape)}
          for t, ab in sorted(ad.items())}


@pytest.fixture(scope="module")
def adapters():
  return make_adapters(2)


@pytest.fixture(scope="module")
def engine(base):
  eng = make_engine()
  eng.set_base(base)
  return eng


def numpy_merge(base, adapters) -> dict:
  """target -> [l, *in, *out] float64: W0 + (alpha / r) A B, layer by layer."""
  out = {}
  for t, ab in adapters.items():
    w0 = np.asarray(base["layers"][t], np.float64)
    a = np.asarray(ab["a"], np.float64)
    b = np.asarray(ab["b"], np.float64)
    l, r = a.shape[0], a.shape[-1]
    ins, outs = a.shape[1:-1], b.shape[2:]
    prod = np.stack([a[i].reshape(-1, r) @ b[i].reshape(r, -1) for i in range(l)])
    out[t] = w0 + CFG.lora_alpha / CFG.lora_rank * prod.reshape(l, *ins, *outs)
  return out


def layer_weight(params, t, i):
  layers = params["layers"]
  return layers[i][t] if isinstance(layers, tuple) else layers[t][i]


def check_merge(got, base, adapters):
  want = numpy_merge(base, adapters)
  for t in lora.TARGETS:
    for i in range(CFG.num_layers):
      np.testing.assert_allclose(np.asarray(layer_weight(got, t, i)), want[t][i],
                                 rtol=1e-5, atol=1e-5, err_msg=f"{t} layer {i}")


@pytest.mark.parametrize("layers,mesh_shape", [("unrolled", (1, 1, 1)), ("scan", (1, 1, 2))])
def test_merge_matches_numpy_and_writes_over_the_previous_merge(base, adapters, layers,
                                                                mesh_shape):
  eng = make_engine(layers, mesh_shape)
  eng.set_base(base)
  first = eng.load_params(adapters)
  # The decode weights load_params makes of full params: same tree, dtypes, shardings.
  assert jax.tree.structure(first) == jax.tree.structure(eng.param_shardings)
  for x, s in zip(jax.tree.leaves(first), jax.tree.leaves(eng.param_shardings)):
    assert x.sharding == s and x.dtype == jnp.float32
  check_merge(first, base, adapters)
  second_ad = make_adapters(3)
  second = eng.load_params(second_ad, reuse=first)
  check_merge(second, base, second_ad)
  # Untargeted leaves are the base's own buffers; the first merge's target weights were
  # donated to the second (written in place), the base is intact.
  targets = jax.tree.leaves(lora_merge.targets_of(first, CFG.lora_targets))
  others = [x for x in jax.tree.leaves(first) if all(x is not y for y in targets)]
  assert all(x.is_deleted() for x in targets) and len(targets) == 7 * (
      CFG.num_layers if layers == "unrolled" else 1)
  assert all(not x.is_deleted() for x in others + jax.tree.leaves(eng.merger.base))
  base_ids = {id(x) for x in jax.tree.leaves(eng.merger.base)}
  assert all(id(x) in base_ids for x in others)
  np.testing.assert_array_equal(np.asarray(second["embed"]), np.asarray(base["embed"]))
  assert len(eng.merger.seconds) == 2 and min(eng.merger.seconds) > 0


def test_adapters_before_the_base_are_refused(adapters):
  eng = make_engine()
  with pytest.raises(ValueError, match="set_base"):
    eng.load_params(adapters)


@functools.lru_cache(maxsize=None)
def _apply_fn():
  # The trainer's forward: frozen base plus the unmerged low-rank path.
  return jax.jit(lambda p, ad, t: model.apply(CFG, p, t, adapters=ad))


def reference_greedy(base, adapters_per_step, prompts, num_tokens):
  """Greedy tokens / log-probs by full recompute with the unmerged adapters of each step."""
  seqs = [list(p) for p in prompts]
  toks, lps = [[] for _ in prompts], [[] for _ in prompts]
  for i in range(num_tokens):
    batch = np.zeros((len(seqs), 32), np.int32)
    for j, s in enumerate(seqs):
      batch[j, :len(s)] = s
    logits = _apply_fn()(base, adapters_per_step(i), jnp.asarray(batch))
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for j, s in enumerate(seqs):
      t = int(logp[j, len(s) - 1].argmax())
      toks[j].append(t)
      lps[j].append(float(logp[j, len(s) - 1, t]))
      s.append(t)
  return np.asarray(toks), np.asarray(lps)


def run(gen, max_steps=200):
  out = []
  for _ in range(max_steps):
    if not gen.num_active and not gen.num_pending:
      break
    out.extend(gen.step())
  return out


def greedy(gen):
  for i, prompt in enumerate(PROMPTS):
    gen.add_group(i, prompt, 1, seed=i, sampling=E.Sampling.greedy(), stop_on_eos=False)
  by_id = {r.group_id: r for r in run(gen)}
  return [by_id[i] for i in range(len(PROMPTS))]


def test_merged_sampler_equals_unmerged_forward_with_the_same_programs(engine, base, adapters):
  # Full params merged on the host side take the ordinary load_params path first and
  # compile every program this decode needs.
  full = G.Generator(engine, lora.merge_params(CFG, base, adapters))
  want = greedy(full)
  compiled = {k: p._cache_size() for k, p in engine._generate.items()}  # pylint: disable=protected-access
  prefill = engine._prefill_pages._cache_size()  # pylint: disable=protected-access
  got = greedy(G.Generator(engine, adapters))  # the adapters, merged on the sampler
  assert {k: p._cache_size() for k, p in engine._generate.items()} == compiled  # pylint: disable=protected-access
  assert engine._prefill_pages._cache_size() == prefill  # pylint: disable=protected-access
  ref_t, ref_lp = reference_greedy(base, lambda i: adapters, PROMPTS, MAX_NEW)
  for r, w, t, lp in zip(got, want, ref_t, ref_lp):
    np.testing.assert_array_equal(r.completion_tokens, t)
    np.testing.assert_array_equal(r.completion_tokens, w.completion_tokens)
    np.testing.assert_allclose(r.behavior_logprobs, lp, atol=1e-4)
  no_adapter, _ = reference_greedy(base, lambda i: jax.tree.map(jnp.zeros_like, adapters),
                                   PROMPTS, MAX_NEW)
  assert (no_adapter != ref_t).any(), "the adapters should change the continuation"


def _new_adapters(adapters):
  """Adapters that change the logits but no layer's K/V (the last layer's MLP path), so a
  continuation that keeps the KV cache computed under `adapters` equals a full
  recompute under the new ones, token for token."""
  other = make_adapters(4)
  new = {t: dict(ab) for t, ab in adapters.items()}
  for t in ("gate", "up", "down"):
    new[t]["b"] = adapters[t]["b"].at[-1].set(4 * other[t]["b"][-1])
  return new


def test_inflight_adapter_update_keeps_versions_and_reuses_the_weights(engine, base, adapters):
  new = _new_adapters(adapters)
  gen = G.Generator(engine, adapters, inflight_weight_updates=True)
  prompt = PROMPTS[1]
  gen.add_group(0, prompt, 1, seed=0, sampling=E.Sampling.greedy(), stop_on_eos=False)
  out = []
  while gen.tokens_generated < 4:
    out += gen.step()
  switch = gen.tokens_generated + engine.steps_per_call  # the call on the device: old weights
  old = jax.tree.leaves(lora_merge.targets_of(gen._params, CFG.lora_targets))  # pylint: disable=protected-access
  merges = len(engine.merger.seconds)
  publisher = threading.Thread(target=gen.update_params, args=(new, 7))
  publisher.start()
  publisher.join()
  assert gen.version == 0  # merged and swapped at the top of the next step
  out += run(gen)
  (r,) = out
  assert r.token_versions.tolist() == [0] * switch + [7] * (MAX_NEW - switch)
  assert len(engine.merger.seconds) == merges + 1
  assert all(x.is_deleted() for x in old)  # the new merge wrote over the old weights
  ref_t, ref_lp = reference_greedy(base, lambda i: adapters if i < switch else new,
                                   [prompt], MAX_NEW)
  np.testing.assert_array_equal(r.completion_tokens, ref_t[0])
  np.testing.assert_allclose(r.behavior_logprobs, ref_lp[0], atol=1e-4)
  old_only, _ = reference_greedy(base, lambda i: adapters, [prompt], MAX_NEW)
  assert (old_only[0] != ref_t[0]).any(), "the new adapters should change the continuation"

"""The Pallas GPU paged decode kernel (rl_jax/sampler/paged_attention_gpu.py) on CPU:
in Pallas interpret mode against a NumPy formula and the jnp route, its lowering to a
Triton call for CUDA, its partitioning over a device mesh, the engine's decode through
it, and the one-line refusal off GPU."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rl_jax import sharding as shd
from rl_jax.errors import UserError
from rl_jax.sampler import decode as D
from rl_jax.sampler import engine as E
from rl_jax.sampler import paged_attention_gpu as G

from test_engine import CFG, _started_state, decode, make_engine
from test_engine import params  # noqa: F401  (a fixture)


def _case(*, g, page, width, lengths, kv_heads=2, d=16, seed=0):
  """Pools [k, n, p, d], q [b, h, d], a page table where slots 0 and 1 share their first
  two pages (a shared prefix). In the `poisoned` pools every page that holds no live
  position of any slot (the null page, the rest of a slot's last page's block, columns
  past its length, padding) is NaN: one such value reaching the output fails the test.
  (That the kernel does not even load the blocks past a slot's length is its loop bound,
  not visible in values; the GPU check times it, launch/check_paged_kernel.py.)"""
  rng = np.random.default_rng(seed)
  b = len(lengths)
  n = 1 + b * width
  k = rng.normal(size=(kv_heads, n, page, d)).astype(np.float32)
  v = rng.normal(size=(kv_heads, n, page, d)).astype(np.float32)
  q = rng.normal(size=(b, kv_heads * g, d)).astype(np.float32)
  table = 1 + rng.permutation(n - 1)[:b * width].reshape(b, width)
  table[1, :2] = table[0, :2]
  live = {int(table[i, c]) for i, n_i in enumerate(lengths) for c in range(-(-n_i // page))}
  dead = np.array(sorted(set(range(n)) - live))
  kp, vp = k.copy(), v.copy()
  kp[:, dead], vp[:, dead] = np.nan, np.nan
  return dict(q=q, k=k, v=v, k_poisoned=kp, v_poisoned=vp, table=table.astype(np.int32),
              lengths=np.asarray(lengths, np.int32))


def _numpy_attention(q, k, v, table, lengths):
  """softmax(q K^T / sqrt(d)) V per slot over its live positions, in float64."""
  b, h, d = q.shape
  kh, _, p, _ = k.shape
  g = h // kh
  out = np.zeros((b, h, d))
  for i in range(b):
    pos = np.arange(lengths[i])
    pages = table[i, pos // p]
    for j in range(h):
      kk = k[j // g, pages, pos % p].astype(np.float64)
      vv = v[j // g, pages, pos % p].astype(np.float64)
      s = kk @ q[i, j] / np.sqrt(d)
      a = np.exp(s - s.max())
      out[i, j] = a @ vv / a.sum()
  return out


# (q heads per kv head, page size, width, lengths, tokens_per_block, min_programs,
# splits): MHA with two blocks in one split; GQA 3 with three splits, so short slots have
# empty ones, and lengths at, just past and one short of page boundaries; one page per
# block with GQA 4 and two splits.
CASES = [(1, 4, 6, [5, 24, 1, 8], 16, 1, 1),
         (3, 4, 12, [9, 48, 4, 13, 47], 16, 64, 3),
         (4, 16, 4, [17, 64, 16, 1], 16, 16, 2)]


@pytest.mark.parametrize("g,page,width,lengths,tpb,min_programs,splits", CASES)
def test_kernel_matches_numpy_and_jnp_in_interpret_mode(g, page, width, lengths, tpb,
                                                        min_programs, splits):
  c = _case(g=g, page=page, width=width, lengths=lengths)
  tile = G.plan(batch=len(lengths), kv_heads=2, q_per_kv=g, page_size=page, head_dim=16,
                width=width, tokens_per_block=tpb, min_programs=min_programs)
  assert tile["pages_per_block"] * page == tpb and tile["splits"] == splits
  ref = _numpy_attention(c["q"], c["k"], c["v"], c["table"], c["lengths"])
  want = D.paged_attention_jnp(*map(jnp.asarray, (c["q"], c["k"], c["v"], c["table"],
                                                  c["lengths"])))
  got = G.paged_attention(*map(jnp.asarray, (c["q"], c["k_poisoned"], c["v_poisoned"],
                                             c["table"], c["lengths"])),
                          tokens_per_block=tpb, min_programs=min_programs, interpret=True)
  np.testing.assert_allclose(np.asarray(want), ref, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5)


def test_kernel_in_bfloat16_matches_jnp_route():
  """bf16 pools and queries, float32 accumulation: the kernel and the jnp route (which
  also multiplies bf16 probabilities into bf16 V) agree to bf16 rounding."""
  c = _case(g=3, page=4, width=12, lengths=[9, 48, 4, 13, 47], seed=1)
  args = [jnp.asarray(c[f], jnp.bfloat16) for f in ("q", "k", "v")]
  args += [jnp.asarray(c["table"]), jnp.asarray(c["lengths"])]
  got = G.paged_attention(*args, tokens_per_block=16, min_programs=64, interpret=True)
  assert got.dtype == jnp.bfloat16
  want = D.paged_attention_jnp(*args)
  ref = _numpy_attention(c["q"], c["k"], c["v"], c["table"], c["lengths"])
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=3e-2)
  np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=3e-2)


def test_kernel_lowers_to_a_triton_call_for_cuda_at_qwen_shapes():
  """Qwen2.5-0.5B's attention (14 query heads on 2 kv heads, head_dim 64), 16-token
  pages, batch 64, 1k context: the Pallas Triton lowering accepts every op of the
  kernel (lowered for CUDA from this CPU; nothing compiled or run), and the program
  around it gathers no pages, where the jnp route gathers K and V through the table."""
  pytest.importorskip("jax.experimental.pallas.triton")
  b, w, p = 64, 64, 16
  s = jax.ShapeDtypeStruct
  pool = s((2, 1 + b * w, p, 64), jnp.bfloat16)
  args = (s((b, 14, 64), jnp.bfloat16), pool, pool, s((b, w), jnp.int32),
          s((b,), jnp.int32))
  def lowered(fn):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  text = lowered(lambda *a: G.paged_attention(*a, interpret=False))
  assert "triton" in text and "rl_jax_paged_decode" in text
  assert "stablehlo.gather" not in text
  assert "stablehlo.gather" in lowered(D.paged_attention_jnp)


def test_engine_decode_through_the_kernel_equals_the_jnp_route(params, monkeypatch):  # noqa: F811
  """Sampled decode (temperature 1, top-k / top-p) with the kernel as the engine's
  attention (interpreted on this CPU), on a mesh splitting slots over 2 data devices and
  kv heads over 2 tensor devices, gives the one-device jnp route's tokens and
  log-probs."""
  sampling = E.Sampling(temperature=1.0, top_k=10, top_p=0.95)
  results = {}
  for attention, mesh in (("jnp", (1, 1, 1)), ("pallas_gpu", (2, 1, 2))):
    if attention == "pallas_gpu":
      monkeypatch.setattr(G, "check_backend", lambda backend=None: None)
    eng = make_engine(mesh, steps_per_call=2, attention=attention)
    assert eng.attention == attention
    _, toks, lps, valid = decode(eng, params, _started_state(eng, params, sampling), 6)
    assert valid.all()
    results[attention] = toks, lps
  np.testing.assert_array_equal(results["pallas_gpu"][0], results["jnp"][0])
  np.testing.assert_allclose(results["pallas_gpu"][1], results["jnp"][1], atol=1e-5)
  assert CFG.num_heads // CFG.num_kv_heads > 1  # the engine case is GQA too


def test_kernel_on_a_mesh_runs_per_device_without_collectives():
  """Slots split over `data`, kv heads (and their q heads, GQA 3) over `tensor`: each
  device attends for its own shard, so the compiled program has no collective (the
  kernel alone, unpartitioned, would be all-gathered around), and equals the jnp
  route."""
  c = _case(g=3, page=4, width=8, lengths=[5, 32, 1, 17], seed=2)
  mesh = shd.make_mesh((2, 1, 2), jax.devices()[:4])
  specs = (P("data", "tensor", None), P("tensor", None, None, None),
           P("tensor", None, None, None), P("data", None), P("data"))
  args = [jnp.asarray(c[f]) for f in ("q", "k", "v", "table", "lengths")]
  fn = jax.jit(lambda *a: G.paged_attention(*a, tokens_per_block=16),
               in_shardings=tuple(NamedSharding(mesh, s) for s in specs),
               out_shardings=NamedSharding(mesh, specs[0]))
  hlo = fn.lower(*args).compile().as_text()
  assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", hlo)
  ref = _numpy_attention(c["q"], c["k"], c["v"], c["table"], c["lengths"])
  np.testing.assert_allclose(np.asarray(fn(*args)), ref, atol=1e-5)


def test_pallas_gpu_is_refused_off_gpu_in_one_line():
  with pytest.raises(UserError, match="sampler.attention='pallas_gpu' needs a GPU") as e:
    D.resolve_attention("pallas_gpu", "cpu")
  assert "\n" not in str(e.value)
  with pytest.raises(UserError):
    make_engine(attention="pallas_gpu")  # this test process's backend is the CPU
  assert D.resolve_attention("auto", "gpu") == "jnp"  # until measured on a GPU
  pytest.importorskip("jax.experimental.pallas.triton")
  assert D.resolve_attention("pallas_gpu", "gpu") == "pallas_gpu"


@pytest.mark.parametrize("field,kw", [("page_size", dict(page_size=12, head_dim=64)),
                                      ("head_dim", dict(page_size=16, head_dim=8))])
def test_plan_names_the_shape_triton_cannot_tile(field, kw):
  with pytest.raises(UserError, match=field):
    G.plan(batch=4, kv_heads=2, q_per_kv=7, width=8, **kw)

"""rl_jax.model.attention: every kernel against a float64 NumPy reference (odd lengths,
GQA / MQA / MHA), gradients, right padding, and the choice of kernel per backend."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import model as M
from rl_jax.model import attention

# jnp and xla run natively on CPU; splash runs in Pallas interpret mode off TPU.
CPU_IMPLS = ("jnp", "xla", "splash")
SHAPES = {  # (b, t, h, k, d): GQA g=3 at an odd length, MQA, MHA past one splash block
    "gqa_odd": (2, 13, 6, 2, 8),
    "mqa": (1, 9, 4, 1, 16),
    "mha_long": (1, 130, 2, 2, 8),
}


def _qkv(b, t, h, k, d, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.randn(b, t, h, d).astype(np.float32), rng.randn(b, t, k, d).astype(np.float32),
          rng.randn(b, t, k, d).astype(np.float32))


def _reference(q, k, v):
  """Float64 causal attention; query head i reads kv head i // g (repeat_kv order)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, h, d = q.shape
  g = h // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
  s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


def _attend(impl):
  return jax.jit(lambda q, k, v: M.causal_attention(q, k, v, implementation=impl))


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_kernels_match_numpy(impl, shape):
  q, k, v = _qkv(*SHAPES[shape])
  got = np.asarray(_attend(impl)(q, k, v))
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, _reference(q, k, v), atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ("xla", "splash"))
def test_kernel_gradients_match_jnp(impl):
  q, k, v = _qkv(2, 13, 6, 2, 8, seed=1)
  w = np.random.RandomState(2).randn(2, 13, 6, 8).astype(np.float32)
  grad = lambda i: jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(w * M.causal_attention(q, k, v, implementation=i)),
      argnums=(0, 1, 2)))(q, k, v)
  for got, want in zip(grad(impl), grad("jnp")):
    assert float(jnp.abs(want).max()) > 0.1
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_right_padding_does_not_leak(impl):
  """Real positions [0, 7) give the same output whatever the padded positions hold."""
  q, k, v = _qkv(2, 12, 4, 2, 8, seed=3)
  q2, k2, v2 = (x.copy() for x in (q, k, v))
  for x in (q2, k2, v2):
    x[:, 7:] = 1e3 * np.random.RandomState(4).randn(*x[:, 7:].shape)
  fn = _attend(impl)
  np.testing.assert_allclose(fn(q2, k2, v2)[:, :7], fn(q, k, v)[:, :7], atol=1e-6, rtol=0)
  np.testing.assert_allclose(fn(q, k, v)[:, :7], _reference(q[:, :7], k[:, :7], v[:, :7]),
                             atol=1e-5, rtol=0)


SHAPE = (8, 4, 2, 8)  # (t, h, k, d) for select


@pytest.fixture
def cudnn_says(monkeypatch):
  """Sets what the cuDNN probe reports ("" = it compiles) for fresh select() calls."""
  def set_reason(reason):
    monkeypatch.setattr(attention, "_cudnn_rejection", lambda dtype, shape: reason)
    attention.select.cache_clear()
  yield set_reason
  attention.select.cache_clear()


def test_select_by_backend_and_dtype(cudnn_says):
  cudnn_says("")
  bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
  pick = lambda impl, dtype, backend: attention.select(impl, dtype, backend, SHAPE).name
  assert pick("auto", bf16, "gpu") == pick("auto", jnp.dtype(jnp.float16), "gpu") == "cudnn"
  assert pick("auto", f32, "gpu") == "jnp"
  assert pick("auto", bf16, "tpu") == pick("auto", f32, "tpu") == "splash"
  assert pick("auto", bf16, "cpu") == "xla"
  assert pick("cudnn", bf16, "gpu") == "cudnn"
  assert pick("jnp", bf16, "gpu") == "jnp"
  assert attention.select("auto", bf16, "gpu", SHAPE).fallback_reason == ""


def test_explicit_kernel_that_cannot_run_stops_with_one_line(cudnn_says):
  cudnn_says("RuntimeError: cuDNN is not detected.")
  bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
  for args, why in (((bf16, "cpu"), "needs a GPU; the backend is cpu"),
                    ((f32, "gpu"), "takes bfloat16 or float16 inputs; the compute dtype is "
                                   "float32"),
                    ((bf16, "gpu"), "cannot run at .* cuDNN is not detected")):
    with pytest.raises(attention.AttentionUnavailable, match=why) as e:
      attention.select("cudnn", *args, SHAPE)
    assert "\n" not in str(e.value)


def test_auto_falls_back_with_one_warning_and_records_why(cudnn_says, caplog):
  cudnn_says("NotImplementedError: head_dim 8 unsupported")
  bf16 = jnp.dtype(jnp.bfloat16)
  with caplog.at_level("WARNING"):
    kernels = {attention.select("auto", bf16, "gpu", SHAPE) for _ in range(3)}
  assert kernels == {attention.Kernel("xla", "auto",
                                      "cudnn: NotImplementedError: head_dim 8 unsupported")}
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert len(warnings) == 1 and "head_dim 8 unsupported); using xla" in warnings[0]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN may work here")
def test_cudnn_probe_reports_why_off_gpu():
  """The real probe: jax's cuDNN path refuses on this backend, and says why in one line."""
  reason = attention._cudnn_rejection(jnp.dtype(jnp.bfloat16), SHAPE)
  assert reason and "\n" not in reason


def test_xla_kernel_gemms_are_bf16_forward_and_backward():
  """In bfloat16 the xla kernel's QK^T and PV and all four backward GEMMs take two bf16
  operands (the cotangents are rounded like a flash kernel's), and its gradients stay
  within bf16 rounding of the float32 kernel's."""
  q, k, v = (jnp.asarray(x) for x in _qkv(2, 13, 6, 2, 8, seed=1))
  w = jnp.asarray(np.random.RandomState(2).randn(2, 13, 6, 8), jnp.float32)
  loss = lambda q, k, v: jnp.sum(w * attention.materialised_causal_attention(q, k, v))
  grad = jax.grad(loss, argnums=(0, 1, 2))
  as16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  jaxpr = jax.make_jaxpr(grad)(*as16).jaxpr
  dots = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "dot_general":
        dots.append(tuple(str(x.aval.dtype) for x in eqn.invars))
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else [value]:
          if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
            walk(getattr(sub, "jaxpr", sub))
  walk(jaxpr)
  assert len(dots) == 6 and set(dots) == {("bfloat16", "bfloat16")}
  g16 = jax.jit(grad)(*as16)
  g32 = jax.jit(grad)(*(x.astype(jnp.float32) for x in as16))
  for a, b in zip(g16, g32):
    assert float(jnp.abs(a.astype(jnp.float32) - b).max()) < 2 ** -6 * float(jnp.abs(b).max())


def test_config_rejects_unknown_kernel_and_remat_policy():
  cfg = M.get_preset("tiny_char")
  with pytest.raises(ValueError, match="attention must be one of"):
    cfg.replace(attention="flash")
  with pytest.raises(ValueError, match="remat must be one of"):
    cfg.replace(remat="sometimes")
  assert cfg.replace(remat=True).remat == "full" and cfg.replace(remat=False).remat == "none"


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_splash_in_the_scanned_remat_model_gives_jnp_gradients(remat):
  """The splash kernel's custom VJP under nn.scan + nn.remat, through the chunked head."""
  cfg = M.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, remat=remat)
  params = M.init_params(cfg, jax.random.key(0))
  tokens = np.random.RandomState(0).randint(0, 96, (2, 20)).astype(np.int32)

  def loss(p, c):
    x = M.hidden_states(c, p, tokens)
    return jnp.mean(M.token_stats(c, p, x, tokens, chunk_len=8).logp_bt)
  grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  (l_s, g_s), (l_j, g_j) = (grad(params, cfg.replace(attention=a)) for a in ("splash", "jnp"))
  np.testing.assert_allclose(l_s, l_j, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_j)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)

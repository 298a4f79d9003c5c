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


def test_resolve_by_backend_and_dtype():
  bf16, f32 = jnp.bfloat16, jnp.float32
  assert attention.resolve("auto", bf16, "gpu") == "cudnn"
  assert attention.resolve("auto", jnp.float16, "gpu") == "cudnn"
  assert attention.resolve("auto", f32, "gpu") == "jnp"
  assert attention.resolve("auto", bf16, "tpu") == attention.resolve("auto", f32, "tpu") == "splash"
  assert attention.resolve("auto", bf16, "cpu") == "xla"
  assert attention.resolve("cudnn", f32, "gpu") == "xla"  # cuDNN takes 16-bit inputs only
  assert attention.resolve("cudnn", bf16, "gpu") == "cudnn"
  assert attention.resolve("jnp", bf16, "gpu") == "jnp"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN works here")
def test_cudnn_off_gpu_raises_unless_auto_falls_back():
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(1, 8, 4, 2, 8))
  with pytest.raises(Exception):
    attention.fused_causal_attention(q, k, v, implementation="cudnn")
  calls = []

  def fallback(q, k, v):
    calls.append(q.shape)
    return M.causal_attention(q, k, v, implementation="jnp")
  got = attention.fused_causal_attention(q, k, v, implementation="cudnn", fallback=fallback)
  assert calls == [q.shape]
  np.testing.assert_array_equal(got, M.causal_attention(q, k, v, implementation="jnp"))


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

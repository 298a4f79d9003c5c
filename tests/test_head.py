"""rl_jax.model.head: chunked token log-probs / entropy / hits against a NumPy reference
on the full logits, and gradients equal to the unchunked full-logits path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import model as M

T = 13


def _cfg(tie):
  return M.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, tie_embeddings=tie,
                       qkv_bias=True)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def setup(request):
  cfg = _cfg(request.param)
  # x 2.0: peakier logits. Jitted, same random draws (eager init compiles once per op
  # and leaf shape).
  params = jax.jit(lambda key: jax.tree.map(lambda p: p * 2.0 if p.ndim >= 2 else p,
                                            M.init_params(cfg, key)))(jax.random.key(0))
  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (3, T)).astype(np.int32)
  return cfg, params, tokens


def _numpy_stats(logits, tokens):
  z = np.asarray(logits, np.float64)
  lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
  nxt = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
  logp = np.take_along_axis(z, nxt[..., None], -1)[..., 0] - lse
  p = np.exp(z - lse[..., None])
  ent = lse - (p * z).sum(-1)
  hit = z.argmax(-1) == nxt
  logp[:, -1], hit[:, -1] = 0.0, False
  return logp, ent, hit


def _full_logprobs(logits_btv, tokens_bt):
  """logp_bt[:, t] = log softmax(logits_btv[:, t])[tokens_bt[:, t + 1]], last column 0,
  from the whole [b, t, v] logits (the path the chunked head replaces)."""
  logp_btv = jax.nn.log_softmax(logits_btv, axis=-1)
  picked = jnp.take_along_axis(logp_btv[:, :-1], tokens_bt[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(picked, ((0, 0), (0, 1)))


@pytest.fixture(scope="module")
def full_logits(setup):
  """The whole [b, t, v] logits, once per model (jitted: eager ops compile one by one)."""
  cfg, params, tokens = setup
  return np.asarray(jax.jit(lambda p, t: M.apply(cfg, p, t))(params, tokens))


@pytest.mark.parametrize("chunk", [0, 1, 4, 5, T, 64])
def test_chunked_stats_match_numpy(setup, full_logits, chunk):
  cfg, params, tokens = setup
  stats = jax.jit(lambda p, t: M.token_stats(cfg, p, M.hidden_states(cfg, p, t), t,
                                             chunk_len=chunk))(params, tokens)
  logp, ent, hit = _numpy_stats(full_logits, tokens)
  assert np.abs(logp).max() > 1.0
  np.testing.assert_allclose(stats.logp_bt, logp, atol=2e-5, rtol=0)
  np.testing.assert_allclose(stats.entropy_bt, ent, atol=2e-5, rtol=0)
  np.testing.assert_array_equal(stats.hit_bt, hit)


def _grpo_like(logp, w):
  return jnp.mean(w * jnp.exp(logp - 0.1)) + jnp.mean(logp ** 2)


def _chunked_loss(cfg, tokens, w, *, recompute, dtype="float32"):
  c = cfg.replace(dtype=dtype)

  def loss(p):
    p = jax.tree.map(lambda x: x.astype(dtype), p)
    logp = M.token_stats(c, p, M.hidden_states(c, p, tokens), tokens, chunk_len=5,
                         recompute=recompute).logp_bt
    return _grpo_like(logp, w)
  return loss


@pytest.fixture(scope="module")
def full_logits_grad(setup):
  """Loss weights, and the loss and gradient through the full [b, t, v] logits."""
  cfg, params, tokens = setup
  w = jnp.asarray(np.random.RandomState(2).randn(*tokens.shape), jnp.float32)
  full = lambda p: _grpo_like(_full_logprobs(M.apply(cfg, p, tokens), tokens), w)
  return w, jax.jit(jax.value_and_grad(full))(params)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "saved"])
def test_chunked_gradient_equals_unchunked(setup, full_logits_grad, recompute):
  """A GRPO-shaped loss through 5-position chunks vs through the full [b, t, v] logits
  (token means, so gradients are O(1) and 1e-5 is a float32-level tolerance)."""
  cfg, params, tokens = setup
  w, (l2, g2) = full_logits_grad
  chunked = _chunked_loss(cfg, tokens, w, recompute=recompute)
  l1, g1 = jax.jit(jax.value_and_grad(chunked))(params)
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g2)) > 1e-2


def _head_dots(jaxpr):
  """(lhs dtype, rhs dtype) of every dot_general with a vocabulary-sized operand."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      if any(96 in v.aval.shape for v in eqn.invars):
        out.append(tuple(str(v.aval.dtype) for v in eqn.invars))
    for value in eqn.params.values():
      subs = value if isinstance(value, (tuple, list)) else [value]
      out += [d for s in subs if hasattr(s, "eqns") or hasattr(s, "jaxpr")
              for d in _head_dots(getattr(s, "jaxpr", s))]
  return out


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "saved"])
def test_bf16_head_gemms_and_error(recompute):
  """In bfloat16 every head GEMM (forward, dx, dW; the recompute too) takes two bf16
  operands and the backward recomputes only when asked. Against the float32 head on the
  same bf16-rounded x and W, the loss agrees to float32 accuracy (the forward's logits
  accumulate in float32) and the gradients to the bf16 rounding of dz, dx and dW (the
  module docstring's bound: a few 2^-9 relative to the largest entry)."""
  cfg = _cfg(True)
  rng = np.random.RandomState(3)
  x = rng.randn(3, T, cfg.hidden_size)
  x[2] *= 4
  x16 = jnp.asarray(x, jnp.bfloat16)
  w16 = jnp.asarray(rng.randn(cfg.vocab_size, cfg.hidden_size), jnp.bfloat16)
  # Rows 0-1 predict random tokens; row 2 its greedy tokens, which it is confident of
  # (p > 0.99, where 1 - p from a bf16 p would cancel).
  z = np.asarray(x16, np.float32) @ np.asarray(w16, np.float32).T
  tokens = rng.randint(0, cfg.vocab_size, (3, T))
  tokens[2, 1:] = z[2, :-1].argmax(-1)
  p_next = np.exp(z[2] - z[2].max(-1, keepdims=True))
  p_next = p_next.max(-1) / p_next.sum(-1)
  assert np.median(p_next) > 0.99
  tokens = jnp.asarray(tokens, jnp.int32)
  g_bt = jnp.asarray(rng.randn(3, T), jnp.float32)

  def loss(x, w):
    logp = M.token_stats(cfg, {"embed": w}, x, tokens, chunk_len=5,
                         recompute=recompute).logp_bt
    return _grpo_like(logp, g_bt)

  dots = _head_dots(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x16, w16).jaxpr)
  assert dots and set(dots) == {("bfloat16", "bfloat16")}
  assert len(dots) == (4 if recompute else 3)  # forward, (recompute), dx, dW in the scans
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  l16, g16 = grad(x16, w16)
  l32, g32 = grad(x16.astype(jnp.float32), w16.astype(jnp.float32))
  assert float(jnp.abs(l32)) > 0.5
  np.testing.assert_allclose(l16, l32, rtol=1e-6)
  for a, b in zip(g16, g32):
    rel = float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())
    assert 0 < rel < 4 * 2.0 ** -9, rel
  # Each confident position on its own (its gradient is small next to the others'): a
  # next-token entry 1 - p taken from a bf16 p puts 77-98% errors here.
  dx16, dx32 = g16[0][2, :-1].astype(jnp.float32), g32[0][2, :-1]
  per_position = jnp.linalg.norm(dx16 - dx32, axis=-1) / jnp.linalg.norm(dx32, axis=-1)
  assert float(per_position.max()) < 4 * 2.0 ** -9

"""rl_jax.bench.train_cost: the jaxpr walker against FLOPs counted by hand on a tiny
program (scan, remat, custom_vjp, under value_and_grad), and the train step's count
against 6ND + attention on a tiny model."""
import functools

import jax
import jax.numpy as jnp
import pytest

from rl_jax import model as M
from rl_jax.bench import train_cost as tc


@functools.partial(jax.custom_vjp)
def _matmul_f32_da(a, b):
  return a @ b


def _fwd(a, b):
  return a @ b, (a, b)


def _bwd(res, ct):
  a, b = res
  da = (ct.astype(jnp.float32) @ b.astype(jnp.float32).T).astype(a.dtype)  # f32 operands
  return da, a.T @ ct  # db: bf16 operands


_matmul_f32_da.defvjp(_fwd, _bwd)


def test_walker_counts_scan_remat_and_custom_vjp_bodies():
  """By hand, with 2 m k n FLOPs per [m, k] x [k, n] product:
  scan of 3 steps over a remat body tanh(x_i [2, 4] @ w [4, 5]), gradient in w only:
    forward 3 x 80, recomputed in the backward 3 x 80, dw = x_i^T dy 3 x 80   = 720 bf16
  custom_vjp a [2, 3] @ b [3, 4]: forward 48 bf16; its bwd da 48 f32, db 48 bf16."""
  def loss(w, b, x, a):
    body = jax.checkpoint(lambda x_i: jnp.tanh(x_i @ w))
    _, y = jax.lax.scan(lambda c, x_i: (c, body(x_i)), None, x)
    return jnp.sum(y.astype(jnp.float32)) + jnp.sum(_matmul_f32_da(a, b).astype(jnp.float32))

  bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(
      bf(4, 5), bf(3, 4), bf(3, 2, 4), bf(2, 3))
  assert tc.matmul_flops(jaxpr) == {"bf16": 720 + 48 + 48, "f32_operand": 48, "other": 0}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_step_count_is_6nd_plus_attention(dtype):
  """remat none, softmax kept: the step's matmuls are exactly `needed` less the 6 b t
  FLOPs per parameter that takes part in no matmul (biases, norm scales); every one has
  two operands of the compute dtype."""
  cfg = M.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
  b, t = 4, 16
  out = tc.train_step_matmul(cfg, batch=b, seq=t, dtype=dtype, remat="none", micro_batch=2,
                             logprob_chunk=8)
  assert set(out) == set(tc.RESULT_KEYS)
  not_matmul = cfg.num_layers * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + (
      cfg.num_layers * 2 + 1) * cfg.hidden_size
  needed = 6 * M.num_params(cfg) * b * t + 12 * b * t * t * 4 * 8 * 2
  assert out["needed_tflop"] * 1e12 == pytest.approx(needed, rel=1e-12)
  assert out["total_tflop"] * 1e12 == pytest.approx(needed - 6 * b * t * not_matmul, rel=1e-12)
  key = "bf16_tflop" if dtype == "bfloat16" else "f32_operand_tflop"
  assert out[key] == out["total_tflop"]

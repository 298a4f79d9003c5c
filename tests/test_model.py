"""rl_jax.model transformer: parity with transformers, attention hook, sharding, sizes."""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rl_jax import model as M
from rl_jax import sharding

ALLOWED_PARAM_AXES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers"}
# One compiled program per config instead of eager op-by-op dispatch (much faster on CPU).
apply = jax.jit(M.apply)


def _tiny(**kw):
  base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=16, tie_embeddings=False)
  return M.ModelConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tiny():
  """(cfg, params) shared by the tests that need any small model: one init compile."""
  cfg = _tiny(qkv_bias=True)
  return cfg, M.init_params(cfg, jax.random.key(1))


def _tokens(b, t, vocab, seed=0):
  return np.random.RandomState(seed).randint(0, vocab, (b, t)).astype(np.int32)


def _randomize(model, seed):
  # transformers initialises with std 0.02, unit norms and zero biases, under which
  # logits are tiny and some code paths (biases, norm weights) are invisible.
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
      else:
        p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.ndim == 1 else p.shape[-1] ** -0.5))


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

HF_CASES = {
    # head_dim 16 with theta 5000 puts rotary wavelengths on all three sides of the
    # llama3 thresholds (64/4 = 16 and 64/1 = 64).
    "llama_untied_llama3_rope": (transformers.LlamaConfig, dict(
        rope_theta=5000.0, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False)),
    "llama_tied": (transformers.LlamaConfig, dict(rope_theta=10000.0, tie_word_embeddings=True)),
    "qwen2_tied": (transformers.Qwen2Config, dict(rope_theta=1e6, tie_word_embeddings=True)),
    "qwen2_untied": (transformers.Qwen2Config, dict(rope_theta=1e4, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_logits_match_transformers(case, tmp_path):
  config_cls, extra = HF_CASES[case]
  hf_cfg = config_cls(vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-5, **extra)
  torch.manual_seed(0)
  hf_model = getattr(transformers, config_cls.__name__.replace("Config", "ForCausalLM"))(hf_cfg)
  _randomize(hf_model.eval(), seed=1)
  hf_model.save_pretrained(tmp_path)

  cfg, params = M.from_pretrained(str(tmp_path))
  assert cfg.tie_embeddings == extra["tie_word_embeddings"]
  assert cfg.qkv_bias == (config_cls is transformers.Qwen2Config)
  assert (cfg.rope_scaling is not None) == ("rope_scaling" in extra)
  tokens = _tokens(2, 24, 96)
  # Offset positions reach past original_max_position_embeddings.
  positions = np.broadcast_to(np.arange(24) + 100, (2, 24)).astype(np.int32)
  with torch.no_grad():
    ref_default = hf_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    ref_offset = hf_model(torch.tensor(tokens, dtype=torch.long),
                          position_ids=torch.tensor(positions, dtype=torch.long)).logits.numpy()
  got_default = np.asarray(apply(cfg, params, tokens))
  got_offset = np.asarray(apply(cfg, params, tokens, positions))
  assert got_default.dtype == np.float32
  assert np.abs(ref_default).max() > 1.0  # the comparison is not between near-zeros
  np.testing.assert_allclose(got_default, ref_default, atol=1e-4, rtol=0)
  np.testing.assert_allclose(got_offset, ref_offset, atol=1e-4, rtol=0)


# (heads, kv heads, head_dim, length, attention): GQA ratios other than HF_CASES' 2, MQA
# and MHA, odd lengths, every CPU attention kernel.
OTHER_SHAPES = {
    "gqa3_odd_xla": (6, 2, 8, 17, "xla"),
    "mqa_odd_jnp": (4, 1, 16, 11, "jnp"),
    "mha_auto": (3, 3, 8, 20, "auto"),
    "gqa4_splash": (8, 2, 8, 9, "splash"),
}


@pytest.mark.parametrize("case", sorted(OTHER_SHAPES))
def test_logits_match_transformers_on_other_shapes(case, tmp_path):
  heads, kv_heads, head_dim, t, attention = OTHER_SHAPES[case]
  hf_cfg = transformers.Qwen2Config(
      vocab_size=80, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
      max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=True)
  torch.manual_seed(0)
  hf_model = transformers.Qwen2ForCausalLM(hf_cfg)
  _randomize(hf_model.eval(), seed=2)
  hf_model.save_pretrained(tmp_path)
  cfg, params = M.from_pretrained(str(tmp_path))
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (heads, kv_heads, head_dim)
  cfg = cfg.replace(attention=attention)
  tokens = _tokens(2, t, 80, seed=3)
  with torch.no_grad():
    ref = hf_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  got = np.asarray(apply(cfg, params, tokens))
  assert np.abs(ref).max() > 1.0
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_bfloat16_compute_stays_close_to_float32(tiny):
  cfg, params = tiny
  tokens = _tokens(2, 16, cfg.vocab_size)
  ref = apply(cfg, params, tokens)
  got = apply(cfg.replace(dtype="bfloat16"), params, tokens)
  assert got.dtype == jnp.float32
  assert float(jnp.abs(got - ref).max()) < 0.1 * float(jnp.abs(ref).max())


def _reference_attention(q, k, v, mask):
  """Per-head NumPy attention with kv head i // g for query head i."""
  b, t, h, d = q.shape
  g = h // k.shape[2]
  out = np.zeros_like(q)
  for bi in range(b):
    for hi in range(h):
      s = q[bi, :, hi] @ k[bi, :, hi // g].T / np.sqrt(d)
      s = np.where(mask[bi], s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      out[bi, :, hi] = (p / p.sum(-1, keepdims=True)) @ v[bi, :, hi // g]
  return out


def test_gqa_and_causal_attention_match_numpy():
  rng = np.random.RandomState(0)
  q = rng.randn(2, 5, 6, 8).astype(np.float32)
  k = rng.randn(2, 7, 2, 8).astype(np.float32)
  v = rng.randn(2, 7, 2, 8).astype(np.float32)
  mask = rng.rand(2, 5, 7) < 0.6
  mask[:, :, 0] = True
  np.testing.assert_allclose(M.gqa_attention(q, k, v, mask), _reference_attention(q, k, v, mask),
                             atol=1e-5)
  causal = np.broadcast_to(np.tril(np.ones((7, 7), bool)), (2, 7, 7))
  q7 = rng.randn(2, 7, 6, 8).astype(np.float32)
  np.testing.assert_allclose(M.causal_attention(q7, k, v), _reference_attention(q7, k, v, causal),
                             atol=1e-5)


def test_forward_with_custom_attention_matches_apply_and_threads_cache(tiny):
  cfg, params = tiny
  b, t = 2, 10
  tokens = _tokens(b, t, cfg.vocab_size, seed=1)
  positions = np.broadcast_to(np.arange(t), (b, t)).astype(np.int32)
  ref = apply(cfg, params, tokens)

  def stacking_attn(q, k, v, layer_cache, ctx):
    assert layer_cache is None
    return M.causal_attention(q, k, v, ctx["mask_bts"]), {"k": k, "v": v}

  def accumulating_attn(q, k, v, layer_cache, ctx):
    return M.causal_attention(q, k, v, ctx["mask_bts"]), {
        "k": layer_cache["k"] + k, "v": layer_cache["v"] + v}

  ctx = {"mask_bts": jnp.ones((b, t, t), bool)}
  logits, stacked = M.forward(cfg, params, tokens, positions, attn_fn=stacking_attn,
                              attn_ctx=ctx)
  np.testing.assert_allclose(logits, ref, atol=1e-5)
  assert stacked["k"].shape == (cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim)
  # Different layers see different keys.
  assert float(jnp.abs(stacked["k"][0] - stacked["k"][1]).max()) > 1e-3

  # A cache with a distinct offset per layer proves each layer read and wrote its slice,
  # under jit with the cache donated (updated in place, not copied).
  offsets = jnp.arange(cfg.num_layers, dtype=jnp.float32)[:, None, None, None, None]
  make_cache = lambda: jax.tree.map(lambda x: jnp.zeros_like(x) + offsets, stacked)
  step = jax.jit(lambda p, c, ctx: M.forward(cfg, p, tokens, positions,
                                             attn_fn=accumulating_attn, cache=c, attn_ctx=ctx),
                 donate_argnums=1)
  cache = make_cache()
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # "donated buffers were not usable" would fail here
    logits2, new_cache = step(params, cache, ctx)
  assert cache["k"].is_deleted()
  np.testing.assert_allclose(logits2, ref, atol=1e-5)
  np.testing.assert_allclose(new_cache["k"], stacked["k"] + offsets, atol=1e-5)
  np.testing.assert_allclose(new_cache["v"], stacked["v"] + offsets, atol=1e-5)

  with pytest.raises(ValueError, match="same structure and shapes"):
    M.forward(cfg, params, tokens, positions, cache=make_cache(), attn_ctx=ctx,
              attn_fn=lambda q, k, v, c, x: (M.causal_attention(q, k, v), {"k": k}))
  with pytest.raises(ValueError, match="no attn_fn"):
    M.forward(cfg, params, tokens, positions, cache=make_cache())


def test_apply_treats_right_padding_causally(tiny):
  cfg, params = tiny
  tokens = _tokens(1, 12, cfg.vocab_size)
  padded = tokens.copy()
  padded[:, 8:] = cfg.pad_id
  np.testing.assert_allclose(apply(cfg, params, padded)[:, :8],
                             apply(cfg, params, tokens)[:, :8], atol=1e-5)


def test_sharded_forward_matches_unsharded(tiny):
  cfg, params = tiny
  tokens = _tokens(4, 8, cfg.vocab_size)
  ref = apply(cfg, params, tokens)

  mesh = sharding.make_mesh((1, 4, 2), jax.devices())
  shapes = jax.eval_shape(M.init_params, cfg, jax.random.key(0))
  param_sh = sharding.tree_shardings(M.param_logical_axes(cfg), shapes, mesh,
                                     sharding.TRAIN_RULES)
  tok_sh = sharding.batch_sharding(mesh, sharding.TRAIN_RULES)
  sharded = jax.device_put(params, param_sh)
  assert sharded["layers"]["q"].sharding.spec == jax.sharding.PartitionSpec(
      None, "fsdp", "tensor", None)
  assert sharded["layers"]["down"].sharding.spec == jax.sharding.PartitionSpec(
      None, "tensor", "fsdp")
  fn = jax.jit(lambda p, t: M.apply(cfg, p, t), in_shardings=(param_sh, tok_sh),
               out_shardings=sharding.batch_sharding(mesh, sharding.TRAIN_RULES, ndim=3))
  got = fn(sharded, jax.device_put(tokens, tok_sh))
  np.testing.assert_allclose(got, ref, atol=1e-5)

  init = jax.jit(M.init_params, static_argnums=0, out_shardings=param_sh)
  np.testing.assert_array_equal(init(cfg, jax.random.key(1))["layers"]["gate"],
                                params["layers"]["gate"])


def test_remat_gives_the_same_gradients(tiny):
  cfg, params = tiny
  tokens = _tokens(2, 8, cfg.vocab_size)

  def loss(p, c):
    logp = jax.nn.log_softmax(M.apply(c, p, tokens))
    return -jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1).mean()

  grad = jax.jit(jax.grad(loss))
  g_plain = grad(params, cfg)
  for policy in ("full", "dots", True):  # True: the legacy boolean, meaning full
    g_remat = grad(params, cfg.replace(remat=policy))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g_plain, g_remat)


def test_remat_policies_save_less_than_none(tiny):
  """What each policy keeps for the backward pass: full < dots < none, by the saved
  residuals of jax.linearize's forward (all of them float32 here)."""
  cfg, params = tiny
  tokens = _tokens(2, 8, cfg.vocab_size)

  def saved_bytes(policy):
    c = cfg.replace(remat=policy)
    _, f_jvp = jax.linearize(lambda p: M.apply(c, p, tokens), params)
    consts = [x for x in jax.tree.leaves(f_jvp) if hasattr(x, "nbytes")]
    return sum(x.nbytes for x in consts)
  full, dots, none = (saved_bytes(p) for p in ("full", "dots", "none"))
  assert full < dots < none


PUBLISHED_SIZES = {
    "qwen2_0_5b": 494_032_768,
    "qwen2_1_5b": 1_543_714_304,
    "llama3_1b": 1_235_814_400,
    "llama3_8b": 8_030_261_248,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SIZES))
def test_preset_sizes_match_published(name):
  cfg = M.get_preset(name)
  assert M.num_params(cfg) == PUBLISHED_SIZES[name]
  shapes = jax.eval_shape(M.init_params, cfg, jax.random.key(0))
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == PUBLISHED_SIZES[name]
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(shapes))


def test_param_logical_axes_match_params():
  for cfg in (_tiny(qkv_bias=True), _tiny(tie_embeddings=True, param_dtype="bfloat16")):
    shapes = jax.eval_shape(M.init_params, cfg, jax.random.key(0))
    axes = M.param_logical_axes(cfg)
    is_axes = lambda x: isinstance(x, tuple)
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(shapes)
    for names, x in zip(jax.tree.leaves(axes, is_leaf=is_axes), jax.tree.leaves(shapes)):
      assert len(names) == x.ndim and set(names) <= ALLOWED_PARAM_AXES
      assert x.dtype == jnp.dtype(cfg.param_dtype)
    assert axes["layers"]["k"] == ("layers", "embed", "kv_heads", "head_dim")
    assert axes["layers"]["o"] == ("layers", "heads", "head_dim", "embed")
    assert axes["embed"] == ("vocab", "embed")
    assert ("lm_head" in axes) == (not cfg.tie_embeddings)
    assert M.num_params(cfg) == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def test_presets_and_config_validation():
  assert M.get_preset("tiny_char").vocab_size == 128
  assert set(M.PRESETS) >= {"tiny_char", "qwen2_0_5b", "qwen2_1_5b", "llama3_1b", "llama3_8b"}
  with pytest.raises(ValueError, match=re.escape("'llama3_8b'")):
    M.get_preset("gpt5")
  cfg = M.get_preset("llama3_1b")
  assert hash(cfg) == hash(cfg.replace()) and cfg == cfg.replace()
  assert cfg.replace(dtype="bfloat16").dtype == "bfloat16"
  with pytest.raises(ValueError, match="num_kv_heads"):
    cfg.replace(num_kv_heads=5)
  with pytest.raises(ValueError, match="rope_scaling"):
    cfg.replace(rope_scaling={"rope_type": "yarn", "factor": 2.0})

"""rl_jax.trainer.train_step: batch layout, gradients, sharded step, NaN skip, compiles."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.trainer import buckets
from rl_jax.trainer import grpo
from rl_jax.trainer import optimizer as opt_lib
from rl_jax.trainer import train_step as ts
from rl_jax.types import Group, Rollout

PROMPT = np.array([1, 40, 41, 42], np.int32)


def _model_cfg():
  return model.get_preset("tiny_char").replace(
      hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)


def _trainer_cfg(**kw):
  c = base.get_config().trainer
  c.length_buckets = (16, 32)
  c.learning_rate = 1e-2
  for k, v in kw.items():
    setattr(c, k, v)
  return c


def _groups(seed, *, num_groups=2, group_size=4, max_completion=10, off_policy=0.5):
  rng = np.random.default_rng(seed)
  groups = []
  for g in range(num_groups):
    rollouts = []
    for k in range(group_size):
      c = rng.integers(3, 100, rng.integers(2, max_completion + 1)).astype(np.int32)
      rollouts.append(Rollout(
          group_id=g, sample_index=k, prompt_tokens=PROMPT, completion_tokens=c,
          behavior_logprobs=(-np.log(128) + rng.normal(0, off_policy, len(c))).astype(np.float32),
          token_versions=np.full(len(c), 3, np.int32), reward=float(rng.normal())))
    groups.append(Group(group_id=g, example=None, prompt_tokens=PROMPT, rollouts=rollouts))
  return groups


def _mesh(shape):
  return shd.make_mesh(shape, jax.devices()[:int(np.prod(shape))])


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def test_overlong_mask_drops_truncated_rows_from_the_loss_not_from_advantages():
  groups = _groups(1)
  truncated = groups[0].rollouts[1]
  truncated.finish_reason = "length"
  kw = dict(pad_id=0, length_buckets=(16, 32), std_normalize=True)
  plain = ts.make_train_batch(groups, **kw)
  masked = ts.make_train_batch(groups, mask_truncated=True, **kw)
  assert plain.mask_bt[1].sum() == truncated.num_tokens
  assert not masked.mask_bt[1].any()
  rows = [i for i in range(plain.mask_bt.shape[0]) if i != 1]
  np.testing.assert_array_equal(masked.mask_bt[rows], plain.mask_bt[rows])
  # The truncated rollout's reward still counts in its group's advantages.
  np.testing.assert_array_equal(masked.advantages_b, plain.advantages_b)
  rewards = np.asarray([r.reward for r in groups[0].rollouts])
  np.testing.assert_allclose(masked.advantages_b[:4], (rewards - rewards.mean()) /
                             (rewards.std() + 1e-6), rtol=1e-5)


def test_make_train_batch_layout():
  groups = _groups(0)
  groups[1].rollouts[0].completion_tokens = np.array([7, 8, 9], np.int32)
  groups[1].rollouts[0].behavior_logprobs = np.array([-1, -2, -3], np.float32)
  groups[1].rollouts[0].token_versions = np.array([5, 5, 6], np.int32)
  for r in groups[0].rollouts:
    r.reward = 1.0
  batch = ts.make_train_batch(groups, pad_id=0, length_buckets=(16, 32), std_normalize=True,
                              batch_multiple=3)
  assert batch.tokens_bt.shape == (9, 16) and batch.num_rollouts == 8
  assert batch.zero_var_groups == 1
  np.testing.assert_array_equal(batch.advantages_b[:4], 0)
  np.testing.assert_allclose(batch.advantages_b[4:8].mean(), 0, atol=1e-6)
  # Row 4: prompt (4 tokens) then completion [7, 8, 9]; position 3 predicts token 4 (= 7).
  np.testing.assert_array_equal(batch.tokens_bt[4, :8], [1, 40, 41, 42, 7, 8, 9, 0])
  np.testing.assert_array_equal(np.nonzero(batch.mask_bt[4])[0], [3, 4, 5])
  np.testing.assert_array_equal(batch.behavior_logprobs_bt[4, 3:6], [-1, -2, -3])
  np.testing.assert_array_equal(batch.versions_bt[4, 2:7], [-1, 5, 5, 6, -1])
  assert not batch.mask_bt[8].any() and batch.advantages_b[8] == 0  # padding row
  padded = ts.pad_rows(batch, multiple=4, pad_id=0)
  assert padded.tokens_bt.shape == (12, 16) and padded.num_tokens == batch.num_tokens
  np.testing.assert_array_equal(padded.versions_bt[9:], -1)
  assert ts.pad_rows(padded, multiple=4, pad_id=0) is padded
  long = ts.make_train_batch(_groups(1, max_completion=20), pad_id=0, length_buckets=(16, 32),
                             std_normalize=False)
  assert long.seq_len == 32
  with pytest.raises(ValueError, match="length_buckets"):
    ts.make_train_batch(_groups(1, max_completion=40), pad_id=0, length_buckets=(16, 32),
                        std_normalize=False)


def test_lr_schedule():
  cos = opt_lib.lr_schedule(learning_rate=1.0, schedule="cosine", warmup_steps=4, total_steps=14)
  np.testing.assert_allclose([float(cos(n)) for n in (0, 3, 9, 14, 20)],
                             [0.25, 1.0, 0.5, 0.0, 0.0], atol=1e-6)
  const = opt_lib.lr_schedule(learning_rate=2.0, schedule="constant", warmup_steps=0,
                              total_steps=5)
  assert float(const(0)) == float(const(100)) == 2.0


def test_gradient_matches_finite_differences(params0):
  """d/dh L(theta + h u) at h = 0 against central differences, with pi_prox fixed."""
  cfg = _trainer_cfg(kl_beta=0.1, kl_estimator="k3", loss_agg="seq_mean_token_mean",
                     tis_cap=1.5)
  trainer = ts.Trainer(_model_cfg(), cfg, _mesh((1, 1, 1)), total_steps=1)
  # Directions and shifted params are formed on the host (NumPy, float32 like the
  # params): only the trainer's own programs compile, no per-leaf eager ops.
  params0 = _host(trainer.init_state(params=params0).params)
  batch = trainer.make_train_batch(_groups(2))
  # The reference is theta_0 and pi_prox is theta_0 shifted, so every term has curvature.
  shifted = jax.tree.map(lambda p: p * np.float32(1.05), params0)
  prox = trainer.logprobs(shifted, batch)
  _, grads = trainer.loss_and_grad(params0, batch, prox)
  grads = _host(grads)
  rng = np.random.default_rng(0)
  h = np.float32(1e-2)
  for _ in range(3):
    u = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params0)
    norm = np.sqrt(sum(np.sum(x * x, dtype=np.float64) for x in jax.tree.leaves(u)))
    u = jax.tree.map(lambda x: (x / norm).astype(np.float32), u)
    at = lambda s: trainer.loss_and_grad(
        jax.tree.map(lambda p, d: p + s * d, params0, u), batch, prox)[0]
    fd = (float(at(h)) - float(at(-h))) / (2 * h)
    analytic = float(sum(np.sum(g * d, dtype=np.float64) for g, d in zip(jax.tree.leaves(grads),
                                                                         jax.tree.leaves(u))))
    np.testing.assert_allclose(analytic, fd, rtol=3e-2, atol=1e-5)


@pytest.fixture(scope="module")
def params0():
  """Initial params, built once: every trainer below starts from them (fewer compiles)."""
  return model.init_params(_model_cfg(), jax.random.key(2))


@pytest.fixture(scope="module")
def single_device_step(params0):
  """Params and metrics after one step on one device, whole batch at once."""
  trainer = ts.Trainer(_model_cfg(), _trainer_cfg(), _mesh((1, 1, 1)), total_steps=4)
  state = trainer.init_state(params=params0)
  state, metrics = trainer.step(state, trainer.make_train_batch(_groups(3)))
  return _host(state.params), metrics


def _assert_params_close(a, b, lr):
  # The first Adam step moves each parameter by lr * g / (|g| + eps). Where |g| is within
  # a few orders of eps the summation order (devices, micro-batches) visibly changes the
  # update, so a handful of elements may differ by a few percent of lr; all others match.
  diffs = np.concatenate([np.abs(x - y).ravel() for x, y in zip(jax.tree.leaves(a),
                                                                 jax.tree.leaves(b))])
  assert diffs.max() < 5e-2 * lr
  assert np.mean(diffs > 1e-6) < 1e-3


def test_sharded_step_equals_single_device_and_nan_skips(params0, single_device_step):
  cfg = _trainer_cfg()
  groups = _groups(3)
  trainer = ts.Trainer(_model_cfg(), cfg, _mesh((2, 2, 2)), total_steps=4)
  state = trainer.init_state(params=params0)
  # The trainer state lives on the 8-device mesh with the declared shardings.
  for leaf, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(trainer.param_shardings)):
    assert leaf.sharding == want
  assert state.params["layers"]["q"].sharding.spec == trainer.param_shardings["layers"]["q"].spec
  assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(
      trainer.state_shardings.opt_state))

  state, metrics = trainer.step(state, trainer.make_train_batch(groups))
  want_params, want_metrics = single_device_step
  _assert_params_close(_host(state.params), want_params, cfg.learning_rate)
  for k in ("loss", "grad_norm", "entropy", "tis_weight_mean", "behavior_prox_logp_gap"):
    np.testing.assert_allclose(metrics[k], want_metrics[k], rtol=1e-4)
  # One minibatch: on-policy w.r.t. pi_prox, so the ratio is exactly 1.
  assert metrics["ratio_p1"] == metrics["ratio_p50"] == metrics["ratio_p99"] == 1.0
  assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0
  assert metrics["skipped_nonfinite"] == 0
  assert metrics["tokens"] == sum(r.num_tokens for g in groups for r in g.rollouts)

  # A NaN behaviour log-prob or advantage on a real token skips the update bitwise.
  for field in ("behavior_logprobs_bt", "advantages_b"):
    bad = trainer.make_train_batch(groups)
    if field == "advantages_b":
      bad.advantages_b[5] = np.nan
    else:
      bad.behavior_logprobs_bt[1, np.nonzero(bad.mask_bt[1])[0][0]] = np.nan
    before = _host((state.params, state.opt_state))
    skipped_before = int(state.skipped)
    state, metrics = trainer.step(state, bad)
    jax.tree.map(np.testing.assert_array_equal, _host((state.params, state.opt_state)), before)
    assert metrics["skipped_nonfinite"] == 1 and int(state.skipped) == skipped_before + 1
  state, metrics = trainer.step(state, trainer.make_train_batch(groups))
  assert metrics["skipped_nonfinite"] == 0 and metrics["skipped_nonfinite_total"] == 2
  assert int(state.step) == 4

  # Supervised warm-up on the same trainer: the loss falls on a fixed batch.
  sft = trainer.init_sft_state(params=params0)
  completions = [np.array([10 + i, 20 + i, 2], np.int32) for i in range(8)]
  batch = trainer.make_sft_batch([PROMPT] * 8, completions)
  losses = []
  for _ in range(10):
    sft, metrics = trainer.sft_step(sft, batch)
    losses.append(metrics["loss"])
  assert losses[-1] < 0.7 * losses[0] and metrics["tokens"] == 24


def test_compile_count_bounded_by_buckets(params0):
  trainer = ts.Trainer(_model_cfg(), _trainer_cfg(num_minibatches=2, packing="off"),
                       _mesh((2, 1, 2)), total_steps=8)
  state = trainer.init_state(params=params0)
  state, metrics = trainer.step(state, trainer.make_train_batch(_groups(4)))
  # Two minibatches: the second one is off-policy w.r.t. pi_prox after the first update.
  assert metrics["ratio_p50"] != 1.0 or metrics["ratio_p99"] != 1.0
  count = trainer.compile_count
  for seed in (5, 6, 7):
    state, _ = trainer.step(state, trainer.make_train_batch(_groups(seed)))
  assert trainer.compile_count == count
  long = trainer.make_train_batch(_groups(8, max_completion=20))
  assert long.seq_len == 32
  state, _ = trainer.step(state, long)
  state, _ = trainer.step(state, trainer.make_train_batch(_groups(9, max_completion=20)))
  assert trainer.compile_count == count + 1


def test_micro_batches_equal_full_batch(params0, single_device_step):
  """Micro-batches of 2 rows on a 2-way data-parallel mesh == the whole batch at once."""
  cfg = _trainer_cfg(micro_batch_size=2)
  trainer = ts.Trainer(_model_cfg(), cfg, _mesh((2, 1, 1)), total_steps=4)
  state = trainer.init_state(params=params0)
  state, metrics = trainer.step(state, trainer.make_train_batch(_groups(3)))
  want_params, want_metrics = single_device_step
  _assert_params_close(_host(state.params), want_params, cfg.learning_rate)
  for k in ("loss", "grad_norm", "entropy", "kl_behavior"):
    np.testing.assert_allclose(metrics[k], want_metrics[k], rtol=1e-5)


def _reference_loss(model_cfg, cfg, params, ref_params, batch, prox_bt):
  """The GRPO loss from the full [b, t, v] logits (model.apply + grpo), the path the
  chunked lm head replaces."""
  def logp(p):
    logp_btv = jax.nn.log_softmax(model.apply(model_cfg, p, batch.tokens_bt), axis=-1)
    next_bt = jnp.asarray(np.pad(batch.tokens_bt[:, 1:], ((0, 0), (0, 1))))
    picked = jnp.take_along_axis(logp_btv, next_bt[..., None], axis=-1)[..., 0]
    return picked.at[:, -1].set(0.0)
  weights = grpo.loss_weights(mask_bt=batch.mask_bt, loss_agg=cfg.loss_agg, max_len=32)
  loss, _ = grpo.grpo_loss(
      logp_bt=logp(params), prox_logp_bt=prox_bt, behavior_logp_bt=batch.behavior_logprobs_bt,
      ref_logp_bt=logp(ref_params), adv_bt=batch.advantages_b[:, None], mask_bt=batch.mask_bt,
      weights_bt=weights, eps_low=cfg.eps_low, eps_high=cfg.eps_high, tis_cap=cfg.tis_cap,
      ratio_level=cfg.ratio_level, kl_beta=cfg.kl_beta, kl_estimator=cfg.kl_estimator)
  return loss


@pytest.mark.parametrize("chunk", [5, 0])
def test_chunked_loss_and_gradient_equal_full_logits(params0, chunk):
  """Trainer.loss_and_grad with the lm head in 5-position chunks (and in one chunk)
  against the loss written on full logits, KL reference included. Half the rollouts
  are multi-turn (tool use): the reference's mask is built token by token from their
  model masks, so observation tokens are context only (no loss, KL or entropy term).
  The trainer packs its rows (trainer.packing=auto); the reference runs padded rows."""
  cfg = _trainer_cfg(kl_beta=0.1, loss_agg="seq_mean_token_mean", logprob_chunk_len=chunk,
                     micro_batch_size=4)
  mcfg = _model_cfg()
  trainer = ts.Trainer(mcfg, cfg, _mesh((1, 1, 1)), total_steps=1)
  params = trainer.init_state(params=params0).params
  groups = _groups(2, max_completion=20) + _multi_turn_groups(5)
  batch = trainer.make_train_batch(groups)
  assert batch.seq_len == 32 and trainer.layouts(batch)[0].num_rows < batch.tokens_bt.shape[0]
  mask_bt = _mask_from_rollouts([r for g in groups for r in g.rollouts], batch.mask_bt.shape)
  np.testing.assert_array_equal(batch.mask_bt, mask_bt)
  prox = jax.tree.map(lambda p: p * 1.05, params)
  prox_bt = trainer.logprobs(prox, batch)
  loss, grads = trainer.loss_and_grad(params, batch, prox_bt)
  ref = lambda p: _reference_loss(mcfg, cfg, p, params, dataclasses.replace(batch, mask_bt=mask_bt),
                                  np.asarray(prox_bt))
  want_loss, want_grads = jax.jit(jax.value_and_grad(ref))(params)
  np.testing.assert_allclose(loss, want_loss, atol=1e-6, rtol=1e-6)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_grads)) > 1e-3


@pytest.mark.parametrize("layers", ["unrolled", "scan"])
@pytest.mark.parametrize("attention", ["jnp", "xla"])
def test_logprob_mismatch_with_the_sampler_is_small_in_float32(attention, layers):
  """Rollouts sampled by the Engine (paged decode with either layer loop, temperature 1) at
  version 0, trained at version 0 with the same params: |mu - pi| is float32 rounding.
  Tokens of another version are left out of the metric, and a shifted behaviour log-prob
  shows up in it."""
  from rl_jax.sampler import engine as engine_lib
  from rl_jax.sampler import generator as gen_lib
  mcfg = _model_cfg().replace(attention=attention)
  params = jax.tree.map(lambda p: p * 3.0 if p.ndim >= 2 else p,
                        model.init_params(mcfg, jax.random.key(5)))
  # Pages of 8: every sequence (4 + 12 positions) still spans two pages, and the
  # decode passes need two page-width programs, not four.
  eng = engine_lib.Engine(mcfg, mesh=_mesh((1, 1, 1)), max_concurrent_decodes=8, page_size=8,
                          num_pages=32, max_prefill_length=8, max_new_tokens=12, stop_ids=(),
                          dtype="float32", layers=layers)
  gen = gen_lib.Generator(eng, params, version=0)
  prompts = [PROMPT, np.array([1, 7, 8], np.int32)]
  for g, p in enumerate(prompts):
    gen.add_group(g, p, 4, seed=g, sampling=engine_lib.Sampling(temperature=1.0))
  rollouts = []
  while gen.num_active or gen.num_pending:
    rollouts.extend(gen.step())
  groups = []
  for g, p in enumerate(prompts):
    rs = sorted((r for r in rollouts if r.group_id == g), key=lambda r: r.sample_index)
    for r in rs:
      r.reward = float(r.sample_index % 2)
    groups.append(Group(group_id=g, example=None, prompt_tokens=p, rollouts=rs))
  # Rollout 0 of group 1 claims version 1 and has wrong log-probs: not counted.
  stale = groups[1].rollouts[0]
  stale.token_versions = np.ones_like(stale.token_versions)
  stale.behavior_logprobs = stale.behavior_logprobs - 0.5
  n_on = sum(len(r.completion_tokens) for r in rollouts) - len(stale.completion_tokens)

  trainer = ts.Trainer(mcfg, _trainer_cfg(), _mesh((2, 1, 1)), total_steps=2)
  state = trainer.init_state(params=params)
  state, metrics = trainer.step(state, trainer.make_train_batch(groups), policy_version=0)
  assert metrics["logprob_mismatch_tokens"] == n_on > 0
  assert metrics["logprob_mismatch_max"] < 1e-4
  assert metrics["logprob_mismatch_mean"] <= metrics["logprob_mismatch_max"]

  # The same batch with one on-policy token's behaviour log-prob moved by 1e-2.
  state = trainer.init_state(params=params)
  groups[0].rollouts[1].behavior_logprobs[2] += 1e-2
  _, metrics = trainer.step(state, trainer.make_train_batch(groups), policy_version=0)
  np.testing.assert_allclose(metrics["logprob_mismatch_max"], 1e-2, atol=1e-4)
  _, metrics = trainer.step(trainer.init_state(params=params),
                            trainer.make_train_batch(groups), policy_version=7)
  assert metrics["logprob_mismatch_tokens"] == 0 and metrics["logprob_mismatch_max"] == 0


# The saved softmax of the batch below: 8 rows x 32 positions x 100 vocab x 4 bytes.
_SAVED_PROBS = 8 * 32 * 100 * 4


@pytest.mark.parametrize("chunk, save_bytes, whole_logits", [
    (8, _SAVED_PROBS - 1, False), (8, _SAVED_PROBS, True), (0, 0, True)])
def test_head_memory_follows_logprob_save_bytes(chunk, save_bytes, whole_logits,
                                                default_emitters):
  """The compiled step's largest vocabulary-sized buffer: one chunk's [rows, 8, v] with
  logprob_chunk_len=8 when the saved softmax would exceed trainer.logprob_save_bytes
  (the backward recomputes); the whole [rows, t, v] when it fits (kept for the
  backward) or when the head runs as one chunk."""
  import re
  mcfg = _model_cfg().replace(vocab_size=100)
  trainer = ts.Trainer(mcfg, _trainer_cfg(logprob_chunk_len=chunk,
                                          logprob_save_bytes=save_bytes),
                       _mesh((1, 1, 1)), total_steps=1)
  assert trainer.head_recomputes((8, 32)) == (save_bytes < _SAVED_PROBS)
  state = jax.eval_shape(trainer.init_state, rng=jax.random.key(0))
  b, t = 8, 32
  hlo = trainer._step.lower(state, trainer.batch_spec(b, t), (),
                            jax.ShapeDtypeStruct((), jnp.int32)).compile(
                                compiler_options=default_emitters).as_text()
  vocab_sized = [np.prod([int(d) for d in dims.split(",")])
                 for dims in re.findall(r"(?:f32|bf16)\[([\d,]+)\]", hlo)
                 if "100" in dims.split(",")]
  assert vocab_sized and max(vocab_sized) >= b * 8 * 100
  assert (max(vocab_sized) >= b * t * 100) == whole_logits


def _multi_turn_groups(seed):
  """Groups of tool-use rollouts: model turn, observation (context only), model turn."""
  rng = np.random.default_rng(seed)
  groups = []
  for g in range(2):
    rollouts = []
    for k in range(4):
      parts = [rng.integers(3, 100, rng.integers(1, 8)) for _ in range(3)]
      c = np.concatenate(parts).astype(np.int32)
      model_mask = np.concatenate([np.full(len(parts[0]), True), np.full(len(parts[1]), False),
                                   np.full(len(parts[2]), True)])
      rollouts.append(Rollout(
          group_id=10 + g, sample_index=k, prompt_tokens=PROMPT, completion_tokens=c,
          behavior_logprobs=np.where(model_mask, -np.log(128) + rng.normal(0, 0.5, len(c)),
                                     0.0).astype(np.float32),
          token_versions=np.where(model_mask, 3, -1).astype(np.int32),
          reward=float(rng.normal()), model_mask=model_mask, num_turns=2))
    groups.append(Group(group_id=10 + g, example=None, prompt_tokens=PROMPT, rollouts=rollouts))
  return groups


def _mask_from_rollouts(rows, shape):
  """mask_bt by hand: position 3 + j (prompt of 4 tokens) predicts completion token j,
  which counts when the model sampled it."""
  mask_bt = np.zeros(shape, bool)
  for i, r in enumerate(rows):
    for j, model_token in enumerate(r.model_token_mask):
      mask_bt[i, 3 + j] = model_token
  return mask_bt


def test_observation_tokens_are_context_only():
  """Observation tokens are inputs but not loss terms: the batch masks them, and values
  stored at their positions (behaviour log-probs, versions) change no input of the step,
  so neither loss nor gradient (test_chunked_loss_and_gradient_equal_full_logits checks
  the masked loss itself against full logits). SFT batches take the same mask."""
  groups = _multi_turn_groups(5)
  rows = [r for g in groups for r in g.rollouts]
  make = lambda: ts.make_train_batch(groups, pad_id=0, length_buckets=(16, 32),
                                     std_normalize=True, batch_multiple=1)
  batch = make()
  for i, r in enumerate(rows):
    np.testing.assert_array_equal(batch.tokens_bt[i, 4:4 + r.num_tokens], r.completion_tokens)
  mask_bt = _mask_from_rollouts(rows, batch.mask_bt.shape)
  np.testing.assert_array_equal(batch.mask_bt, mask_bt)
  assert batch.num_tokens == sum(int(r.model_mask.sum()) for r in rows)
  assert np.all(batch.behavior_logprobs_bt[~mask_bt] == 0) and np.all(batch.versions_bt[~mask_bt] == -1)
  for r in rows:
    r.behavior_logprobs = np.where(r.model_mask, r.behavior_logprobs, -7.0).astype(np.float32)
    r.token_versions = np.where(r.model_mask, r.token_versions, 99).astype(np.int32)
  again = make()
  layout = buckets.packed_layout(batch.lengths_b, row_len=batch.seq_len, num_minibatches=1,
                                 quantum=1)
  got, want = (ts.batch_rows(b, layout, pad_id=0) for b in (again, batch))
  for k in ts.GRPO_KEYS:
    np.testing.assert_array_equal(got[k], want[k])
  sft = ts.make_sft_batch([r.prompt_tokens for r in rows], [r.completion_tokens for r in rows],
                          pad_id=0, length_buckets=(16, 32),
                          completion_masks=[r.model_mask for r in rows])
  np.testing.assert_array_equal(sft.mask_bt, mask_bt)
  with pytest.raises(ValueError, match="model_mask"):
    rows[0].model_mask = rows[0].model_mask[:-1]
    make()

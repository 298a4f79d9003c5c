"""rl_jax.trainer.grpo against NumPy references written independently here."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.trainer import grpo

B, T, V = 6, 9, 11


def _ref_advantages(rewards, std_normalize, eps):
  out = np.zeros_like(rewards, dtype=np.float64)
  zero = 0
  for i, row in enumerate(rewards):
    if len(set(row.tolist())) == 1:
      zero += 1
      continue
    mean = sum(row) / len(row)
    dev = row - mean
    out[i] = dev / (np.sqrt(np.mean(dev ** 2)) + eps) if std_normalize else dev
  return out, zero


def _ref_loss(logp, prox, mu, ref, adv, mask, *, eps_low, eps_high, tis_cap, ratio_level,
              kl_beta, kl_estimator, loss_agg, max_len):
  """Loop-based reference: one sequence at a time, one token at a time."""
  per_seq_terms = []  # list of lists of (pg_term, kl_term) per valid token
  for b in range(mask.shape[0]):
    idx = [t for t in range(mask.shape[1]) if mask[b, t]]
    if not idx:
      per_seq_terms.append([])
      continue
    seq_log_ratio = np.mean([logp[b, t] - prox[b, t] for t in idx])
    terms = []
    for t in idx:
      r = np.exp(seq_log_ratio) if ratio_level == "sequence" else np.exp(logp[b, t] - prox[b, t])
      w = min(np.exp(prox[b, t] - mu[b, t]), tis_cap) if tis_cap > 0 else 1.0
      a = adv[b]
      surr = min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
      if kl_estimator == "k1":
        kl = logp[b, t] - ref[b, t]
      else:
        kl = np.exp(ref[b, t] - logp[b, t]) - (ref[b, t] - logp[b, t]) - 1
      terms.append(-w * surr + kl_beta * kl)
    per_seq_terms.append(terms)
  valid = [s for s in per_seq_terms if s]
  if loss_agg == "token_mean":
    flat = [x for s in valid for x in s]
    return sum(flat) / len(flat)
  if loss_agg == "seq_mean_token_mean":
    return np.mean([np.mean(s) for s in valid])
  return np.mean([np.sum(s) / max_len for s in valid])


def _random_inputs(seed):
  rng = np.random.default_rng(seed)
  logp = np.log(rng.uniform(0.05, 0.95, (B, T)))
  prox = logp + rng.normal(0, 0.3, (B, T))
  mu = prox + rng.normal(0, 0.8, (B, T))
  ref = logp + rng.normal(0, 0.5, (B, T))
  adv = rng.normal(0, 1, (B,))
  mask = np.zeros((B, T), bool)
  for b, (lo, hi) in enumerate([(2, 8), (1, 4), (3, 9), (0, 0), (5, 6), (2, 7)]):
    mask[b, lo:hi] = True
  # Garbage (NaN) off the mask must not leak into the loss.
  for x in (logp, prox, mu, ref):
    x[~mask] = np.nan
  f32 = lambda x: x.astype(np.float32)
  return f32(logp), f32(prox), f32(mu), f32(ref), f32(adv), mask


@pytest.mark.parametrize("std_normalize", [True, False])
def test_group_advantages(std_normalize):
  rewards = np.array([[1, 0, 0, 1], [0.1, 0.1, 0.1, 0.1], [0.3, 1, -2, 5], [7, 7, 7, 7]],
                     np.float32)
  adv, zero = grpo.group_advantages(rewards_ng=rewards, std_normalize=std_normalize, eps=1e-6)
  want, want_zero = _ref_advantages(rewards.astype(np.float64), std_normalize, 1e-6)
  assert zero == want_zero == 2
  assert not np.isnan(adv).any()
  np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-6)
  assert (adv[1] == 0).all() and (adv[3] == 0).all()
  np.testing.assert_allclose(adv.sum(axis=1), 0, atol=1e-5)


@pytest.mark.parametrize(
    "loss_agg,ratio_level,tis_cap,kl_estimator",
    [(agg, lvl, cap, est) for agg, lvl in itertools.product(grpo.LOSS_AGGS, grpo.RATIO_LEVELS)
     for cap, est in [(2.0, "k3"), (0.0, "k1")]])
def test_grpo_loss_matches_reference(loss_agg, ratio_level, tis_cap, kl_estimator):
  logp, prox, mu, ref, adv, mask = _random_inputs(0)
  kw = dict(eps_low=0.1, eps_high=0.35, tis_cap=tis_cap, ratio_level=ratio_level,
            kl_beta=0.05, kl_estimator=kl_estimator)
  weights = grpo.loss_weights(mask_bt=mask, loss_agg=loss_agg, max_len=12)
  loss, stats = grpo.grpo_loss(logp_bt=logp, prox_logp_bt=prox, behavior_logp_bt=mu,
                               ref_logp_bt=ref, adv_bt=adv[:, None], mask_bt=mask,
                               weights_bt=weights,
                               **kw)
  want = _ref_loss(logp, prox, mu, ref, adv, mask, loss_agg=loss_agg, max_len=12, **kw)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert float(stats["tokens"]) == mask.sum()


def test_loss_weights_split_over_microbatches():
  """Summing weighted micro-batch losses with global counts gives the full-batch loss."""
  _, _, _, _, _, mask = _random_inputs(1)
  x = np.random.default_rng(2).normal(size=mask.shape)
  for agg in grpo.LOSS_AGGS:
    full = float(jnp.sum(jnp.where(mask, x, 0) * grpo.loss_weights(
        mask_bt=mask, loss_agg=agg, max_len=7)))
    n_tok, n_seq = mask.sum(), (mask.sum(1) > 0).sum()
    parts = 0.0
    for rows in (slice(0, 2), slice(2, 6)):
      w = grpo.loss_weights(mask_bt=mask[rows], loss_agg=agg, max_len=7, num_tokens=n_tok,
                            num_seqs=n_seq)
      parts += float(jnp.sum(jnp.where(mask[rows], x[rows], 0) * w))
    np.testing.assert_allclose(parts, full, rtol=1e-6)


def test_clip_higher_asymmetry():
  # One token per sequence; ratios chosen around the asymmetric clip range [0.8, 1.3].
  ratio = np.array([1.25, 1.35, 0.85, 0.75, 1.35, 0.75])
  adv = np.array([1.0, 1.0, -1.0, -1.0, -1.0, 1.0])
  surr = np.asarray(grpo.clipped_surrogate(ratio_bt=ratio[:, None], adv_bt=adv[:, None],
                                           eps_low=0.2, eps_high=0.3))[:, 0]
  # A > 0: capped at 1 + eps_high; A < 0: capped at 1 - eps_low; the pessimistic branch
  # (unclipped) wins when the clip would help.
  np.testing.assert_allclose(surr, [1.25, 1.3, -0.85, -0.8, -1.35, 0.75])
  logp = np.log(ratio)[:, None]
  mask = np.ones((6, 1), bool)
  _, stats = grpo.grpo_loss(
      logp_bt=logp, prox_logp_bt=np.zeros_like(logp), behavior_logp_bt=np.zeros_like(logp),
      ref_logp_bt=None, adv_bt=adv[:, None], mask_bt=mask,
      weights_bt=grpo.loss_weights(mask_bt=mask, loss_agg="token_mean", max_len=1),
      eps_low=0.2, eps_high=0.3, tis_cap=0.0, ratio_level="token", kl_beta=0.0,
      kl_estimator="k3")
  assert float(stats["clip_high"]) == 1  # token 1: A > 0, r = 1.35 > 1.3
  assert float(stats["clip_low"]) == 1  # token 3: A < 0, r = 0.75 < 0.8


def test_gradient_through_clip():
  """Clipped tokens give no gradient; unclipped ones give w * A * r."""
  ratio = np.array([1.25, 1.35, 0.75, 0.85])
  adv = np.array([1.0, 1.0, -1.0, -1.0])
  mask = np.ones((4, 1), bool)

  def f(logp):
    loss, _ = grpo.grpo_loss(
        logp_bt=logp, prox_logp_bt=jnp.zeros_like(logp), behavior_logp_bt=jnp.zeros_like(logp),
        ref_logp_bt=None, adv_bt=adv[:, None], mask_bt=mask,
        weights_bt=jnp.ones_like(logp), eps_low=0.2, eps_high=0.3, tis_cap=0.0,
        ratio_level="token", kl_beta=0.0, kl_estimator="k3")
    return loss
  g = np.asarray(jax.grad(f)(jnp.log(ratio)[:, None]))[:, 0]
  np.testing.assert_allclose(g, [-1.25, 0.0, 0.0, 0.85], rtol=1e-6)


def test_tis_cap_truncates():
  prox = np.zeros((1, 4))
  mu = np.log(np.array([[0.1, 0.5, 2.0, 1.0]]))  # pi_prox / mu = 10, 2, 0.5, 1
  w, trunc = grpo.tis_weight(prox_logp_bt=prox, behavior_logp_bt=mu, cap=3.0)
  np.testing.assert_allclose(np.asarray(w), [[3.0, 2.0, 0.5, 1.0]], rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(trunc), [[True, False, False, False]])
  w_off, trunc_off = grpo.tis_weight(prox_logp_bt=prox, behavior_logp_bt=mu, cap=0.0)
  np.testing.assert_array_equal(np.asarray(w_off), 1.0)
  assert not np.asarray(trunc_off).any()


def test_kl_estimators():
  logp = np.log(np.array([[0.2, 0.5, 0.9]]))
  ref = np.log(np.array([[0.4, 0.5, 0.3]]))
  k1 = np.asarray(grpo.kl_penalty(logp_bt=logp, ref_logp_bt=ref, estimator="k1"))
  k3 = np.asarray(grpo.kl_penalty(logp_bt=logp, ref_logp_bt=ref, estimator="k3"))
  rho = np.array([[0.4 / 0.2, 1.0, 0.3 / 0.9]])
  np.testing.assert_allclose(k1, -np.log(rho), rtol=1e-6)
  np.testing.assert_allclose(k3, rho - 1 - np.log(rho), rtol=1e-6)
  assert (k3 >= 0).all() and k3[0, 1] == 0


@pytest.mark.parametrize("ratio_level", grpo.RATIO_LEVELS)
def test_on_policy_is_neutral(ratio_level):
  """behaviour == proximal == current: ratio 1, nothing clipped, TIS weight 1, gap 0."""
  logp, _, _, _, adv, mask = _random_inputs(3)
  logp = np.where(mask, logp, 0.0)
  weights = grpo.loss_weights(mask_bt=mask, loss_agg="token_mean", max_len=T)
  loss, stats = grpo.grpo_loss(
      logp_bt=logp, prox_logp_bt=logp, behavior_logp_bt=logp, ref_logp_bt=logp,
      adv_bt=adv[:, None], mask_bt=mask, weights_bt=weights, eps_low=0.2, eps_high=0.28,
      tis_cap=2.0,
      ratio_level=ratio_level, kl_beta=0.1, kl_estimator="k3")
  ratio = np.asarray(stats["ratio_bt"])
  np.testing.assert_array_equal(ratio[mask], 1.0)
  assert np.isnan(ratio[~mask]).all()
  assert float(stats["clip_low"]) == float(stats["clip_high"]) == 0
  assert float(stats["tis_weight"]) == float(stats["tokens"]) == mask.sum()
  assert float(stats["tis_truncated"]) == float(stats["prox_gap"]) == float(stats["kl"]) == 0
  # Loss is -token_mean(A): the plain policy-gradient objective at ratio 1.
  want = -np.sum(adv[:, None] * mask) / mask.sum()
  np.testing.assert_allclose(float(loss), want, rtol=1e-6)


@pytest.mark.parametrize("kl_estimator", grpo.KL_ESTIMATORS)
@pytest.mark.parametrize("ratio_level", grpo.RATIO_LEVELS)
def test_nan_off_the_mask_never_reaches_the_gradient(kl_estimator, ratio_level):
  """NaN in every input off the mask (reference included): finite loss and gradient, and
  the gradient off the mask is exactly 0."""
  logp, prox, mu, ref, adv, mask = _random_inputs(3)
  assert np.isnan(ref[~mask]).all()
  weights = grpo.loss_weights(mask_bt=mask, loss_agg="token_mean", max_len=12)

  def loss_fn(lp):
    return grpo.grpo_loss(logp_bt=lp, prox_logp_bt=prox, behavior_logp_bt=mu,
                          ref_logp_bt=ref, adv_bt=adv[:, None], mask_bt=mask,
                          weights_bt=weights,
                          eps_low=0.2, eps_high=0.28, tis_cap=2.0, ratio_level=ratio_level,
                          kl_beta=0.1, kl_estimator=kl_estimator)[0]
  loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp))
  assert np.isfinite(float(loss))
  grad = np.asarray(grad)
  assert np.isfinite(grad).all()
  assert (grad[~mask] == 0).all() and (grad[mask] != 0).any()
  # The KL gradient on the mask, alone, against its closed form (token_mean weights 1/N):
  # k1: d/dlogp (logp - ref) = 1;  k3: d/dlogp (e^(ref-logp) - (ref-logp) - 1) = 1 - e^(ref-logp).
  kl_only = lambda lp: grpo.grpo_loss(
      logp_bt=lp, prox_logp_bt=prox, behavior_logp_bt=mu, ref_logp_bt=ref,
      adv_bt=np.zeros_like(adv)[:, None], mask_bt=mask, weights_bt=weights, eps_low=0.2,
      eps_high=0.28, tis_cap=2.0, ratio_level=ratio_level, kl_beta=1.0,
      kl_estimator=kl_estimator)[0]
  g = np.asarray(jax.grad(kl_only)(jnp.asarray(logp)))
  d = ref.astype(np.float64) - logp
  want = np.where(mask, (1.0 if kl_estimator == "k1" else 1.0 - np.exp(d)) / mask.sum(), 0.0)
  np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("ratio_level", grpo.RATIO_LEVELS)
def test_extreme_log_ratios_stay_finite(ratio_level):
  """A log-ratio of +-100 (exp overflows float32 above ~88.7) is clamped to +-20."""
  mask = np.ones((2, 3), bool)
  logp = np.array([[100.0, 0.0, 0.0], [-100.0, 0.0, 0.0]], np.float32)
  prox = np.zeros((2, 3), np.float32)
  mu = np.array([[-150.0, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
  ratio = np.asarray(grpo.importance_ratio(logp_bt=logp, prox_logp_bt=prox, mask_bt=mask,
                                           ratio_level=ratio_level))
  if ratio_level == "token":
    np.testing.assert_allclose(ratio[:, 0], [np.exp(20.0), np.exp(-20.0)], rtol=1e-5)
    np.testing.assert_allclose(ratio[:, 1:], 1.0)
  else:  # mean log-ratios +-100 / 3 are beyond +-20: clamped too
    np.testing.assert_allclose(ratio[0], np.exp(20.0), rtol=1e-5)
    np.testing.assert_allclose(ratio[1], np.exp(-20.0), rtol=1e-5)
  weights = grpo.loss_weights(mask_bt=mask, loss_agg="token_mean", max_len=3)

  def loss_fn(lp):
    return grpo.grpo_loss(logp_bt=lp, prox_logp_bt=prox, behavior_logp_bt=mu,
                          ref_logp_bt=prox, adv_bt=np.array([[-1.0], [1.0]], np.float32),
                          mask_bt=mask, weights_bt=weights, eps_low=0.2, eps_high=0.28,
                          tis_cap=0.0, ratio_level=ratio_level, kl_beta=0.1,
                          kl_estimator="k3")
  (loss, stats), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(logp))
  assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
  assert np.isfinite(float(stats["kl_behavior"])) and np.isfinite(float(stats["kl"]))


def test_logprob_mismatch_counts_only_current_version_tokens():
  rng = np.random.default_rng(0)
  prox = rng.normal(size=(3, 6)).astype(np.float32)
  mu = prox + rng.normal(scale=1e-3, size=(3, 6)).astype(np.float32)
  mask = rng.random((3, 6)) < 0.7
  versions = np.where(mask, rng.integers(4, 6, (3, 6)), -1).astype(np.int32)
  mu[versions == 4] += 5.0  # stale tokens: far off, and left out
  mu[~mask] = np.nan  # padding may hold anything
  out = grpo.logprob_mismatch(prox_logp_bt=prox, behavior_logp_bt=mu, mask_bt=mask,
                              versions_bt=versions, policy_version=5)
  on = mask & (versions == 5)
  gap = np.abs(prox - mu)[on]
  assert on.sum() > 0 and (mask & (versions == 4)).sum() > 0
  np.testing.assert_allclose(out["mismatch_sum"], gap.sum(), rtol=1e-6)
  np.testing.assert_allclose(out["mismatch_max"], gap.max(), rtol=1e-6)
  assert float(out["mismatch_tokens"]) == on.sum()


def test_overlong_penalty_matches_dapo_formula():
  """DAPO's soft overlong punishment, against a scalar NumPy reference of its formula."""
  max_len, buffer = 20, 8
  lengths = np.arange(0, 26)

  def reference(length):
    start = max_len - buffer
    if length <= start:
      return 0.0
    if length <= max_len:
      return (start - length) / buffer
    return -1.0
  want = np.asarray([reference(int(n)) for n in lengths], np.float32)
  got = grpo.overlong_penalty(lengths_b=lengths, max_len=max_len, buffer=buffer)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got.dtype == np.float32
  assert got[12] == 0 and got[13] == np.float32(-1 / 8) and got[20] == -1 and got[25] == -1

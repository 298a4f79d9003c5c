"""GRPO math: group advantages, clipped off-policy surrogate, KL, train/inference mismatch.

Shape letters:
  n = groups (prompts), g = rollouts per group,
  b = rows of a train batch, t = token positions.

Sequences: a row holds one sequence (padded rows), or several back to back (packed rows,
rl_jax.trainer.buckets) told apart by segment ids seg_bt (int32 in [0, t), one id per
sequence of a row, contiguous). Every per-sequence quantity (length, sequence ratio,
sequence count, advantage) is taken per segment; seg_bt=None means one segment per row,
so a packed batch gives the same loss, gradient and statistics as its padded rows.

Position convention (shared with rl_jax.trainer.batch and rl_jax.model.head, which
computes the token log-probs and entropy): every per-token array
`x_bt` is indexed by the *predicting* position, so `x_bt[:, t]` concerns token
`tokens_bt[:, t + 1]`, whose distribution the model emits at position t. The last
position predicts nothing and is always masked out.

Policies: pi_theta is the policy being optimised, pi_prox the trainer's policy at the
start of the step (decoupled PPO's proximal policy, no gradient), mu the behaviour
policy that sampled the tokens (its log-probs come from the sampler), pi_ref a frozen
reference for the KL penalty.

Everything except `group_advantages` (host-side numpy, it feeds the batch builder) is
jax and jit-safe. Positions outside the mask may hold any value, NaN included: `grpo_loss`
replaces them with 0 (`where`, before any arithmetic) so that neither the loss nor its
gradient sees them; a masked-out NaN multiplied by a zero cotangent would still be NaN.

Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] = [-20, 20] before `exp`:
exp(20) ~ 4.9e8 is finite in float32 (exp overflows above ~88.7, and one inf would make
the whole update non-finite and skipped), and a ratio that far from 1 is outside any
PPO clip range, so the clamp changes no clipped term; its gradient there is 0.
"""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k3")
LOG_RATIO_CLAMP = 20.0


def safe_exp(log_x: jax.Array) -> jax.Array:
  """exp(clip(log_x, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)): a ratio that cannot overflow."""
  return jnp.exp(jnp.clip(log_x, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def group_advantages(*, rewards_ng: np.ndarray, std_normalize: bool,
                     eps: float = 1e-6) -> tuple[np.ndarray, int]:
  """Group-relative advantages and the number of zero-variance groups.

  A_ng = r_ng - mean_g(r_ng)                          (Dr. GRPO, std_normalize=False)
  A_ng = (r_ng - mean_g(r_ng)) / (std_g(r_ng) + eps)  (GRPO, std_normalize=True)

  std is the population standard deviation (ddof=0), so a group of one is defined.
  A group whose rewards are all equal carries no learning signal: its advantages
  are exactly 0 (not the rounding residue of r - mean) and it is counted.
  """
  r_ng = np.asarray(rewards_ng, np.float64)
  centred_ng = r_ng - r_ng.mean(axis=1, keepdims=True)
  if std_normalize:
    centred_ng = centred_ng / (r_ng.std(axis=1, keepdims=True) + eps)
  zero_var_n = r_ng.max(axis=1) == r_ng.min(axis=1)
  adv_ng = np.where(zero_var_n[:, None], 0.0, centred_ng).astype(np.float32)
  return adv_ng, int(zero_var_n.sum())


def segment_total(x_bt: jax.Array, seg_bt: jax.Array | None = None) -> jax.Array:
  """Per position, the sum of x over its sequence (module docstring):
  total_bt[b, t] = sum_{s : seg_bt[b, s] == seg_bt[b, t]} x_bt[b, s]; seg_bt=None: the row."""
  if seg_bt is None:
    return jnp.broadcast_to(x_bt.sum(axis=1, keepdims=True), x_bt.shape)
  t = x_bt.shape[1]
  per_row = lambda x_t, seg_t: jax.ops.segment_sum(x_t, seg_t, num_segments=t)[seg_t]
  return jax.vmap(per_row)(x_bt, seg_bt)


def count_sequences(*, mask_bt: jax.Array, seg_bt: jax.Array | None = None) -> jax.Array:
  """S = the number of sequences with at least one masked-in token (float32)."""
  m_bt = mask_bt.astype(jnp.float32)
  if seg_bt is None:
    return (m_bt.sum(axis=1) > 0).sum().astype(jnp.float32)
  first_bt = jnp.concatenate([jnp.ones_like(seg_bt[:, :1], bool),
                              seg_bt[:, 1:] != seg_bt[:, :-1]], axis=1)
  return (first_bt & (segment_total(m_bt, seg_bt) > 0)).sum().astype(jnp.float32)


def overlong_penalty(*, lengths_b: np.ndarray, max_len: int, buffer: int) -> np.ndarray:
  """DAPO's soft overlong punishment, added to the reward (rl.overlong="penalty").

  For completion length L, limit L_max (sampler.max_new_tokens) and buffer B
  (rl.overlong_buffer, 1 <= B <= L_max):

    penalty(L) = 0                       L <= L_max - B
                 ((L_max - B) - L) / B   L_max - B < L <= L_max   (from 0 down to -1)
                 -1                      L > L_max

  lengths_b int [b] -> float32 [b]. Host-side numpy, like `group_advantages`.
  """
  lengths = np.asarray(lengths_b, np.float64)
  start = float(max_len - buffer)
  ramp = (start - lengths) / float(buffer)
  out = np.where(lengths <= start, 0.0, np.where(lengths <= max_len, ramp, -1.0))
  return out.astype(np.float32)


def loss_weights(*, mask_bt: jax.Array, loss_agg: str, max_len: int,
                 num_tokens: jax.Array | None = None,
                 num_seqs: jax.Array | None = None,
                 seg_bt: jax.Array | None = None) -> jax.Array:
  """Per-token weights W_bt such that the aggregated loss is sum_bt W_bt * x_bt.

  With m_bt the mask, L_bt = the masked-in tokens of the sequence at (b, t)
  (segment_total of m), N = sum_bt m_bt, S = count_sequences:
    token_mean:               W_bt = m_bt / N
    seq_mean_token_mean:      W_bt = m_bt / (L_bt * S)
    seq_mean_token_sum_norm:  W_bt = m_bt / (max_len * S)   (Dr. GRPO, max_len constant)

  Expressing every mode as a weighted sum lets micro-batches add up to exactly the
  full-batch loss: pass `num_tokens` / `num_seqs` counted over the full batch.
  Sequences without tokens (batch padding) get weight 0 and do not count in S.
  """
  m_bt = mask_bt.astype(jnp.float32)
  if num_tokens is None:
    num_tokens = m_bt.sum()
  if num_seqs is None:
    num_seqs = count_sequences(mask_bt=mask_bt, seg_bt=seg_bt)
  if loss_agg == "token_mean":
    return m_bt / jnp.maximum(num_tokens, 1.0)
  if loss_agg == "seq_mean_token_mean":
    len_bt = segment_total(m_bt, seg_bt)
    return m_bt / (jnp.maximum(len_bt, 1.0) * jnp.maximum(num_seqs, 1.0))
  if loss_agg == "seq_mean_token_sum_norm":
    return m_bt / (float(max_len) * jnp.maximum(num_seqs, 1.0))
  raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")


def masked_sum(*, x_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """sum_bt x_bt over masked-in positions (masked-out values, even NaN, are ignored)."""
  return jnp.sum(jnp.where(mask_bt, x_bt, 0.0))


def importance_ratio(*, logp_bt: jax.Array, prox_logp_bt: jax.Array, mask_bt: jax.Array,
                     ratio_level: Literal["token", "sequence"],
                     seg_bt: jax.Array | None = None) -> jax.Array:
  """Ratio pi_theta / pi_prox per token.

  token:     r_bt = exp(logp_bt - prox_bt)
  sequence:  r_bt = exp(mean_{t in mask} (logp_bt - prox_bt)), the same for every
             token of a sequence (GSPO's length-normalised sequence ratio).
  Off-mask positions get ratio 1; the log-ratio is clamped (module docstring, safe_exp).
  """
  log_r_bt = jnp.where(mask_bt, logp_bt - prox_logp_bt, 0.0)
  if ratio_level == "token":
    return safe_exp(log_r_bt)
  if ratio_level == "sequence":
    len_bt = jnp.maximum(segment_total(mask_bt.astype(jnp.float32), seg_bt), 1.0)
    return jnp.where(mask_bt, safe_exp(segment_total(log_r_bt, seg_bt) / len_bt), 1.0)
  raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")


def tis_weight(*, prox_logp_bt: jax.Array, behavior_logp_bt: jax.Array,
               cap: float) -> tuple[jax.Array, jax.Array]:
  """Truncated importance weight w_bt = min(pi_prox / mu, C), and the truncated flag.

  Corrects for tokens sampled by mu (stale weights, or a sampler whose numerics
  differ from the trainer's). No gradient flows through it. cap = 0 turns it off
  (w = 1, nothing truncated).
  """
  raw_bt = safe_exp(jax.lax.stop_gradient(prox_logp_bt - behavior_logp_bt))
  if cap <= 0:
    return jnp.ones_like(raw_bt), jnp.zeros(raw_bt.shape, bool)
  return jnp.minimum(raw_bt, cap), raw_bt > cap


def clipped_surrogate(*, ratio_bt: jax.Array, adv_bt: jax.Array, eps_low: float,
                      eps_high: float) -> jax.Array:
  """PPO objective per token (to be maximised), with clip-higher (A_bt the advantage of
  the token's sequence, [b, t] or [b, 1]):

  s_bt = min(r_bt A_bt, clip(r_bt, 1 - eps_low, 1 + eps_high) A_bt)
  """
  clipped_bt = jnp.clip(ratio_bt, 1.0 - eps_low, 1.0 + eps_high)
  return jnp.minimum(ratio_bt * adv_bt, clipped_bt * adv_bt)


def kl_penalty(*, logp_bt: jax.Array, ref_logp_bt: jax.Array,
               estimator: Literal["k1", "k3"]) -> jax.Array:
  """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled by the policy.

  k1 = logp - ref_logp
  k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1   (non-negative, lower variance;
       the exponent is clamped as a log-ratio, module docstring)
  """
  if estimator == "k1":
    return logp_bt - ref_logp_bt
  if estimator == "k3":
    d_bt = ref_logp_bt - logp_bt
    return safe_exp(d_bt) - d_bt - 1.0
  raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def grpo_loss(*, logp_bt: jax.Array, prox_logp_bt: jax.Array, behavior_logp_bt: jax.Array,
              ref_logp_bt: jax.Array | None, adv_bt: jax.Array, mask_bt: jax.Array,
              weights_bt: jax.Array, eps_low: float, eps_high: float, tis_cap: float,
              ratio_level: str, kl_beta: float, kl_estimator: str,
              seg_bt: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Decoupled-PPO GRPO loss and token statistics.

  loss   = pg_loss + kl_beta * kl_loss
  pg_loss = -sum_bt W_bt * w_bt * s_bt      (s: clipped_surrogate of r = pi_theta / pi_prox,
                                            w: tis_weight of pi_prox / mu)
  kl_loss = sum_bt W_bt * kl_bt              (0 and no reference needed when kl_beta = 0)

  `adv_bt` is each token's sequence advantage ([b, t], or [b, 1] for one sequence per
  row); `seg_bt` the segment ids of packed rows (module docstring).
  `weights_bt` comes from `loss_weights` and fixes the aggregation mode. The stats
  are masked sums (not means) so that callers can add them over micro-batches:
  tokens, clip_low / clip_high (tokens where the clip binds: A < 0 and r < 1 - eps_low,
  or A > 0 and r > 1 + eps_high), tis_weight, tis_truncated, prox_gap (|logp_prox - mu|),
  kl_behavior (k3 estimate of KL(mu || pi_prox)), kl (the per-token KL to the
  reference). `ratio_bt` holds the ratios with NaN off the mask, for percentiles.
  Every per-token input is zeroed off the mask first (module docstring), so the KL
  penalty and the surrogate are finite there and NaN padding never reaches a gradient.
  """
  on = lambda x_bt: jnp.where(mask_bt, x_bt, 0.0)
  logp_bt, behavior_logp_bt = on(logp_bt), on(behavior_logp_bt)
  prox_logp_bt = jax.lax.stop_gradient(on(prox_logp_bt))
  if ref_logp_bt is not None:
    ref_logp_bt = on(ref_logp_bt)
  ratio_bt = importance_ratio(logp_bt=logp_bt, prox_logp_bt=prox_logp_bt, mask_bt=mask_bt,
                              ratio_level=ratio_level, seg_bt=seg_bt)
  w_bt, truncated_bt = tis_weight(prox_logp_bt=prox_logp_bt,
                                  behavior_logp_bt=behavior_logp_bt, cap=tis_cap)
  surr_bt = clipped_surrogate(ratio_bt=ratio_bt, adv_bt=adv_bt, eps_low=eps_low,
                              eps_high=eps_high)
  pg_loss = -masked_sum(x_bt=weights_bt * w_bt * surr_bt, mask_bt=mask_bt)
  if kl_beta > 0:
    kl_bt = kl_penalty(logp_bt=logp_bt, ref_logp_bt=ref_logp_bt, estimator=kl_estimator)
    kl_loss = masked_sum(x_bt=weights_bt * kl_bt, mask_bt=mask_bt)
    kl_sum = masked_sum(x_bt=jax.lax.stop_gradient(kl_bt), mask_bt=mask_bt)
  else:
    kl_loss = kl_sum = jnp.zeros((), jnp.float32)
  loss = pg_loss + kl_beta * kl_loss

  r_bt = jax.lax.stop_gradient(ratio_bt)
  adv_bt = jnp.broadcast_to(adv_bt, r_bt.shape)
  count = lambda c_bt: masked_sum(x_bt=c_bt.astype(jnp.float32), mask_bt=mask_bt)
  log_gap_bt = prox_logp_bt - behavior_logp_bt  # log(pi_prox / mu)
  stats = dict(
      pg_loss=pg_loss,
      kl_loss=kl_loss,
      tokens=count(jnp.ones_like(r_bt)),
      clip_low=count((adv_bt < 0) & (r_bt < 1.0 - eps_low)),
      clip_high=count((adv_bt > 0) & (r_bt > 1.0 + eps_high)),
      tis_weight=masked_sum(x_bt=w_bt, mask_bt=mask_bt),
      tis_truncated=count(truncated_bt),
      prox_gap=masked_sum(x_bt=jnp.abs(log_gap_bt), mask_bt=mask_bt),
      kl_behavior=masked_sum(x_bt=safe_exp(log_gap_bt) - log_gap_bt - 1.0, mask_bt=mask_bt),
      kl=kl_sum,
      ratio_bt=jnp.where(mask_bt, r_bt, jnp.nan),
  )
  return loss, stats


def logprob_mismatch(*, prox_logp_bt, behavior_logp_bt, mask_bt, versions_bt,
                     policy_version) -> dict[str, jax.Array]:
  """Train/inference mismatch on the tokens the sampler drew with the trainer's params.

  With on_bt = mask_bt & (versions_bt == policy_version) and
  gap_bt = |logp_prox_bt - mu_bt| (trainer vs sampler log-prob of the same token under
  the same weights, so only numerics differ: dtype, kernels, batch shapes):
  mismatch_sum = sum over on_bt of gap_bt, mismatch_max = max over on_bt (0 if none),
  mismatch_tokens = #on_bt.
  """
  on_bt = mask_bt & (versions_bt == policy_version)
  gap_bt = jnp.where(on_bt, jnp.abs(prox_logp_bt - behavior_logp_bt), 0.0)
  return dict(mismatch_sum=gap_bt.sum(), mismatch_max=gap_bt.max(),
              mismatch_tokens=on_bt.sum().astype(jnp.float32))

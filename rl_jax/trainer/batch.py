"""Train batches from rollout groups (host-side numpy), and the rows the step trains.

Shape letters: b = rows of the batch (rollouts plus padding rows), t = token positions
(the length bucket).

Batch layout. Row i holds prompt + completion, right padded with pad_id to the
smallest length bucket that fits. Every per-token array is indexed by the predicting
position (see rl_jax.trainer.grpo): a completion token at position p + j (prompt length
p) is predicted at position p + j - 1, so

  mask_bt[i, t] = 1  iff  tokens_bt[i, t + 1] is a completion token the model sampled,
  behavior_logprobs_bt[i, t] = mu(tokens_bt[i, t + 1]),  versions_bt likewise (-1 off-mask).

Multi-turn rollouts (tool use) interleave model turns with environment observations:
observation tokens are in tokens_bt (context for every later token) but mask_bt is 0
where they are predicted (Rollout.model_mask False), so they enter no loss, KL, entropy
or statistic; their behaviour log-prob is 0 and version -1 there. Supervised warm-up
batches take the same per-token mask (observations inside a demonstration).

Rows are padded to a multiple of `Trainer.batch_multiple` (rl_jax.trainer.train_step)
with all-zero-mask rows so the batch splits evenly over data-parallel devices,
minibatches and micro-batches (make_*_batch(batch_multiple=...) pads on creation;
Trainer.step pads whatever is left).

Trained rows. The step trains `batch_rows(batch, layout)`: the same per-position arrays
laid out by a rl_jax.trainer.buckets.RowLayout, plus advantages_bt (each token's
sequence advantage), positions_bt (0 at each sequence's first token) and segment_ids_bt.
With trainer.packing = "off" the layout is the batch's own padded rows; with "auto",
where the attention kernel takes segment ids (model.attention.SEGMENT_KERNELS), whole
sequences are packed into rows of the same length bucket (buckets module docstring),
attention stays within a sequence and every per-sequence quantity of the loss is taken
per segment (rl_jax.trainer.grpo), so loss, gradient and statistics are those of the
padded rows. train/padding_frac is the share of trained positions holding no token,
train/padding_frac_unpacked the same for the padded rows.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rl_jax.trainer import buckets
from rl_jax.trainer import grpo
from rl_jax.trainer.buckets import pick_bucket
from rl_jax.types import Group

ROW_KEYS = ("tokens_bt", "positions_bt", "segment_ids_bt")
GRPO_KEYS = ROW_KEYS + ("mask_bt", "behavior_logprobs_bt", "advantages_bt", "versions_bt")
SFT_KEYS = ROW_KEYS + ("mask_bt",)


@dataclasses.dataclass
class TrainBatch:
  """Host-side (numpy) train batch; see the module docstring for the layout."""
  tokens_bt: np.ndarray  # int32 [b, t]
  mask_bt: np.ndarray  # bool [b, t], position t predicts a completion token
  behavior_logprobs_bt: np.ndarray  # float32 [b, t], 0 off-mask
  advantages_b: np.ndarray  # float32 [b], 0 for padding rows
  versions_bt: np.ndarray  # int32 [b, t], -1 off-mask
  rewards_b: np.ndarray  # float32 [b], 0 for padding rows
  lengths_b: np.ndarray  # int32 [b], prompt + completion tokens, 0 for padding rows
  num_rollouts: int  # real rows; rows [num_rollouts, b) are padding
  zero_var_groups: int  # groups whose rewards were all equal (advantage 0)

  @property
  def seq_len(self) -> int:
    return int(self.tokens_bt.shape[1])

  @property
  def num_tokens(self) -> int:
    return int(self.mask_bt.sum())


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _pack(prompts, completions, behavior, versions, *, pad_id, length_buckets,
          batch_multiple, masks=None):
  """Right-padded token rows, the position-aligned per-token arrays and the row lengths;
  masks[i] (bool [t_i], None: all True) marks the completion tokens that count."""
  lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
  t = pick_bucket(max(lengths, default=1), length_buckets)
  b = _round_up(max(len(prompts), 1), batch_multiple)
  tokens_bt = np.full((b, t), pad_id, np.int32)
  mask_bt = np.zeros((b, t), bool)
  behavior_bt = np.zeros((b, t), np.float32)
  versions_bt = np.full((b, t), -1, np.int32)
  lengths_b = np.zeros((b,), np.int32)
  lengths_b[:len(lengths)] = lengths
  for i, (p, c) in enumerate(zip(prompts, completions)):
    if len(p) == 0:
      raise ValueError("every prompt needs at least one token (e.g. BOS) to predict the "
                       "first completion token from")
    tokens_bt[i, :len(p)] = p
    tokens_bt[i, len(p):len(p) + len(c)] = c
    pred = slice(len(p) - 1, len(p) + len(c) - 1)
    model = True if masks is None or masks[i] is None else np.asarray(masks[i], bool)
    mask_bt[i, pred] = model
    behavior_bt[i, pred] = np.where(model, behavior[i], 0.0)
    versions_bt[i, pred] = np.where(model, versions[i], -1)
  return tokens_bt, mask_bt, behavior_bt, versions_bt, lengths_b


def make_train_batch(groups: Sequence[Group], *, pad_id: int, length_buckets: Sequence[int],
                     std_normalize: bool, batch_multiple: int = 1,
                     eps: float = 1e-6, mask_truncated: bool = False) -> TrainBatch:
  """A GRPO batch: rows in group order, advantages from `grpo.group_advantages` per group.

  Groups may have different sizes (advantages are computed within each group).
  mask_truncated (rl.overlong="mask"): rollouts cut at the length limit (finish_reason
  "length") keep their row but get an all-False loss mask, so they are out of the loss,
  KL and entropy while their rewards still count in their group's advantages.
  """
  rollouts = [r for g in groups for r in g.rollouts]
  for r in rollouts:
    for name in ("behavior_logprobs", "token_versions", "model_mask"):
      value = getattr(r, name)
      if value is not None and len(value) != len(r.completion_tokens):
        raise ValueError(f"rollout {r.group_id}/{r.sample_index}: {len(value)} {name} for "
                         f"{len(r.completion_tokens)} completion tokens")
  advantages, zero_var = [], 0
  for g in groups:
    adv_ng, z = grpo.group_advantages(
        rewards_ng=np.asarray([r.reward for r in g.rollouts], np.float32)[None],
        std_normalize=std_normalize, eps=eps)
    advantages.extend(adv_ng[0].tolist())
    zero_var += z
  tokens_bt, mask_bt, behavior_bt, versions_bt, lengths_b = _pack(
      [r.prompt_tokens for r in rollouts], [r.completion_tokens for r in rollouts],
      [r.behavior_logprobs for r in rollouts], [r.token_versions for r in rollouts],
      pad_id=pad_id, length_buckets=length_buckets, batch_multiple=batch_multiple,
      masks=[np.zeros(r.num_tokens, bool) if mask_truncated and r.finish_reason == "length"
             else r.model_mask for r in rollouts])
  b = tokens_bt.shape[0]
  advantages_b = np.zeros((b,), np.float32)
  advantages_b[:len(rollouts)] = advantages
  rewards_b = np.zeros((b,), np.float32)
  rewards_b[:len(rollouts)] = [r.reward for r in rollouts]
  return TrainBatch(tokens_bt=tokens_bt, mask_bt=mask_bt, behavior_logprobs_bt=behavior_bt,
                    advantages_b=advantages_b, versions_bt=versions_bt, rewards_b=rewards_b,
                    lengths_b=lengths_b, num_rollouts=len(rollouts), zero_var_groups=zero_var)


def make_sft_batch(prompts_tokens: Sequence[np.ndarray],
                   completions_tokens: Sequence[np.ndarray], *, pad_id: int,
                   length_buckets: Sequence[int], batch_multiple: int = 1,
                   completion_masks: Sequence[np.ndarray | None] | None = None) -> TrainBatch:
  """A supervised batch: the loss mask covers the completion tokens (include EOS in
  them if the model should learn to stop), except where completion_masks[i] (bool per
  completion token) is False: observations in a demonstration are context only.
  Behaviour log-probs and advantages are 0."""
  zeros = [np.zeros(len(c), np.float32) for c in completions_tokens]
  tokens_bt, mask_bt, behavior_bt, versions_bt, lengths_b = _pack(
      prompts_tokens, completions_tokens, zeros, [z.astype(np.int32) for z in zeros],
      pad_id=pad_id, length_buckets=length_buckets, batch_multiple=batch_multiple,
      masks=completion_masks)
  b = tokens_bt.shape[0]
  return TrainBatch(tokens_bt=tokens_bt, mask_bt=mask_bt, behavior_logprobs_bt=behavior_bt,
                    advantages_b=np.zeros((b,), np.float32), versions_bt=versions_bt,
                    rewards_b=np.zeros((b,), np.float32), lengths_b=lengths_b,
                    num_rollouts=len(prompts_tokens), zero_var_groups=0)


def pad_rows(batch: TrainBatch, *, multiple: int, pad_id: int) -> TrainBatch:
  """`batch` with zero-mask padding rows appended up to a multiple of `multiple` rows."""
  extra = _round_up(batch.tokens_bt.shape[0], multiple) - batch.tokens_bt.shape[0]
  if extra == 0:
    return batch
  pad = lambda x, value: np.concatenate(
      [x, np.full((extra,) + x.shape[1:], value, x.dtype)], axis=0)
  return dataclasses.replace(
      batch, tokens_bt=pad(batch.tokens_bt, pad_id), mask_bt=pad(batch.mask_bt, False),
      behavior_logprobs_bt=pad(batch.behavior_logprobs_bt, 0.0),
      advantages_b=pad(batch.advantages_b, 0.0), versions_bt=pad(batch.versions_bt, -1),
      rewards_b=pad(batch.rewards_b, 0.0), lengths_b=pad(batch.lengths_b, 0))


def batch_rows(batch: TrainBatch, layout: buckets.RowLayout, *,
               pad_id: int) -> dict[str, np.ndarray]:
  """The step's inputs (GRPO_KEYS) in `layout`'s rows, [r, t] each (module docstring)."""
  return dict(tokens_bt=layout.scatter(batch.tokens_bt, pad_id),
              positions_bt=layout.positions(), segment_ids_bt=layout.segment_ids(),
              mask_bt=layout.scatter(batch.mask_bt, False),
              behavior_logprobs_bt=layout.scatter(batch.behavior_logprobs_bt, 0.0),
              advantages_bt=layout.spread(batch.advantages_b, 0.0),
              versions_bt=layout.scatter(batch.versions_bt, -1))

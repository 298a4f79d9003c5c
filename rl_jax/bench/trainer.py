"""Throughput benchmark of the GRPO update on synthetic rollouts (launch/bench.py train).

Shape letters: b = rows (rollouts), t = sequence length.

FLOPs per update, counted as model FLOPs (rematerialisation not included):
  per token, one forward pass     = 2 * N_mm + 2 * L * T * H * D_h
  per token, forward + backward   = 3 x that = 6 * N_mm + 6 * L * T * H * D_h
where N_mm is the parameter count that takes part in matmuls (all parameters except
an untied input embedding, whose lookup costs no FLOPs), L layers, T the sequence
length, H query heads of width D_h. The attention term counts QK^T and AV
(2 * 2 * T * H * D_h per token) halved for the causal mask. Forward-only passes
(pi_prox with several minibatches, pi_ref when kl_beta > 0) add one forward each.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.trainer import train_step as ts
from rl_jax.types import Group, Rollout


def train_flops(model_cfg, *, tokens: int, seq_len: int, extra_forwards: int) -> float:
  """Model FLOPs of one update over `tokens` tokens of length-`seq_len` rows (see module doc)."""
  c = model_cfg
  n_mm = model.num_params(c) - (0 if c.tie_embeddings else c.vocab_size * c.hidden_size)
  forward = 2 * n_mm + 2 * c.num_layers * seq_len * c.num_heads * c.head_dim
  return float(tokens) * forward * (3 + extra_forwards)


def synthetic_groups(*, batch: int, seq_len: int, vocab_size: int, group_size: int,
                     seed: int = 0) -> list[Group]:
  """`batch` rollouts filling rows of exactly `seq_len` tokens (a quarter prompt)."""
  rng = np.random.default_rng(seed)
  p_len = max(seq_len // 4, 1)
  c_len = seq_len - p_len
  groups = []
  for g in range(batch // group_size):
    prompt = rng.integers(3, vocab_size, p_len).astype(np.int32)
    rollouts = [Rollout(
        group_id=g, sample_index=k, prompt_tokens=prompt,
        completion_tokens=rng.integers(3, vocab_size, c_len).astype(np.int32),
        behavior_logprobs=np.full(c_len, -np.log(vocab_size), np.float32),
        token_versions=np.zeros(c_len, np.int32), reward=float(rng.integers(0, 2)))
                for k in range(group_size)]
    groups.append(Group(group_id=g, example=None, prompt_tokens=prompt, rollouts=rollouts))
  return groups


def run_train_benchmark(model_cfg, trainer_cfg, *, mesh_shape, batch: int, seq_len: int,
                        steps: int, warmup: int, peak_tflops: float = 0.0) -> dict:
  """Times `steps` Trainer.step calls after `warmup` untimed ones (compilation included there)."""
  mesh = shd.make_mesh(mesh_shape, jax.devices()[:int(np.prod(mesh_shape))])
  trainer_cfg.length_buckets = (seq_len,)
  trainer = ts.Trainer(model_cfg, trainer_cfg, mesh, total_steps=warmup + steps)
  group_size = min(8, batch)
  tb = trainer.make_train_batch(synthetic_groups(
      batch=batch, seq_len=seq_len, vocab_size=model_cfg.vocab_size, group_size=group_size))
  state = trainer.init_state(rng=jax.random.key(0))
  t0 = time.perf_counter()
  for _ in range(warmup):
    state, metrics = trainer.step(state, tb, policy_version=0)
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    # Returns host floats, so the step has finished; the synthetic tokens are version 0.
    state, metrics = trainer.step(state, tb, policy_version=0)
    times.append(time.perf_counter() - t0)
  step_s = float(np.median(times))
  tokens = tb.tokens_bt.size
  extra = int(trainer.num_minibatches > 1) + int(trainer_cfg.kl_beta > 0)
  flops = train_flops(model_cfg, tokens=tokens, seq_len=tb.seq_len, extra_forwards=extra)
  out = dict(
      bench="train", backend=jax.default_backend(), device=jax.devices()[0].device_kind,
      mesh=list(mesh_shape), params=model.num_params(model_cfg), dtype=model_cfg.dtype,
      remat=model_cfg.remat, **trainer.attention.record(),
      logprob_chunk_len=trainer.logprob_chunk_len, batch=tb.tokens_bt.shape[0], seq=tb.seq_len,
      micro_batch_size=trainer.micro_batch_size, num_minibatches=trainer.num_minibatches,
      steps=steps, warmup_s=compile_s, step_ms_p50=1e3 * step_s,
      step_ms_mean=1e3 * float(np.mean(times)), tokens_per_s=tokens / step_s,
      loss_tokens_per_s=tb.num_tokens / step_s, tflops_per_step=flops / 1e12,
      achieved_tflops=flops / step_s / 1e12, loss=metrics["loss"],
      skipped_nonfinite=metrics["skipped_nonfinite_total"])
  if peak_tflops > 0:
    out["mfu"] = flops / step_s / (peak_tflops * 1e12 * mesh.size)
  return out

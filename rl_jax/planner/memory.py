"""Per-device memory of a sampler replica and of the trainer, and whether they fit.

Sizes (bytes; N = parameters, b(x) = bytes per element of dtype x):

  KV per token   = 2 (K and V) * layers * kv_heads * head_dim * b(sampler.dtype)
  KV pool        = sampler.num_pages * page_size * KV per token, or
                   sampler.kv_cache_bytes when num_pages = 0 (per sampler replica)
  sampler device = (2 * N * b(sampler.dtype) + KV pool) / tensor
                   (the RL generator and the held-out evaluator each hold a weight copy;
                   the evaluator borrows the generator's KV pool, Generator.lend_pool)

  trainer device = N * (4 params + 4 grads + 8 AdamW mu, nu) / D    fp32 master state
                 + N * b(model.param_dtype) / D    reference params when kl_beta > 0
                 + N * b(sampler.dtype) / D        weight-sync staging copy
                 + activations / tensor            one micro-batch, per data shard

With LoRA (model.lora.rank r > 0; P = adapter parameters, lora.num_adapter_params;
N_t = parameters of the targeted projections, which the sampler merges):

  sampler device = (N * b(sampler.dtype)                  the base, kept once
                    + 2 * (N_t + P) * b(sampler.dtype)    merged target weights and the
                                                          published adapters, for the
                                                          generator and the evaluator each
                    + KV pool) / tensor
  trainer device = N * b(model.param_dtype) / D    the frozen base (also the KL reference)
                 + P * (4 + 4 + 8 + b(sampler.dtype)) / D    adapter masters, grads, AdamW
                                                             moments, sync staging copy
                 + activations / tensor            as below, plus x A per target (n_t r b)

  D = trainer devices (params, grads and moments are sharded over fsdp x tensor = D).
  Activations of a micro-batch of m rows of length t (the smallest length bucket
  >= data.max_prompt_length + sampler.max_new_tokens), per row-token, b = b(model.dtype):

    per layer, stored for backward: (4 d + 2 h hd + 2 kv hd + 4 f) b     projections
                                    + h t (4 + b)                        naive attention
                                                                         scores fp32 + probs
                                    + n_t r b                            LoRA x A (n_t targets)
    logits: vocab (b + 4)                                                logits + fp32 log-softmax
    remat:  per layer only d b, plus one layer's full set for the recompute

  m = trainer.micro_batch_size (or the whole batch) / data-parallel shards. A device
  fits when need <= usable_fraction * memory (the rest is runtime, compiled programs and
  fragmentation).
"""
from __future__ import annotations

import dataclasses
import math

from rl_jax.sampler import page_table
from rl_jax.trainer.buckets import pick_bucket

# "auto" (sampler.dtype) is bfloat16 on the GPUs and TPUs plans are made for.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
  """rl_jax.sampler.page_table.kv_bytes_per_token with the dtype by name."""
  return page_table.kv_bytes_per_token(num_layers=num_layers, num_kv_heads=num_kv_heads,
                                       head_dim=head_dim, dtype_bytes=DTYPE_BYTES[dtype])


def kv_pool_bytes(*, sampler_cfg, kv_per_token: int) -> int:
  """The KV budget of one sampler replica."""
  if sampler_cfg.num_pages:
    return int(sampler_cfg.num_pages) * int(sampler_cfg.page_size) * kv_per_token
  return int(sampler_cfg.kv_cache_bytes)


def lora_sizes(model_cfg) -> tuple[int, int]:
  """(P adapter parameters, N_t parameters of the targeted weights); (0, 0) without LoRA."""
  if model_cfg.lora_rank <= 0:
    return 0, 0
  from rl_jax.model import lora
  shapes = lora.adapter_shapes(model_cfg)
  # a (l, *in, r), b (l, r, *out): the merged weight is (l, *in, *out).
  targets = sum(math.prod(ab["a"].shape[:-1]) * math.prod(ab["b"].shape[2:])
                for ab in shapes.values())
  return lora.num_adapter_params(model_cfg), targets


def activation_bytes(*, model_cfg, rows: int, seq_len: int, dtype: str, remat: bool) -> int:
  """Stored activations of one forward over rows x seq_len tokens (formula above)."""
  b = DTYPE_BYTES[dtype]
  d, f, h, k, hd = (model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.num_heads,
                    model_cfg.num_kv_heads, model_cfg.head_dim)
  layer = ((4 * d + 2 * h * hd + 2 * k * hd + 4 * f) * b + h * seq_len * (4 + b)
           + len(model_cfg.lora_targets) * model_cfg.lora_rank * b)
  logits = model_cfg.vocab_size * (b + 4)
  if remat:
    per_token = model_cfg.num_layers * d * b + layer + logits
  else:
    per_token = model_cfg.num_layers * layer + logits
  return rows * seq_len * per_token


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per device of each role, and whether both fit."""
  sampler_bytes: int
  trainer_bytes: int
  limit_bytes: int
  kv_tokens_per_replica: int
  weight_bytes_sampler: int
  activation_bytes: int
  # Per device, before a colocated layout adds the two roles: the sampler's weights
  # (with LoRA: base + merged targets + adapters) and KV pool, the trainer's state.
  sampler_weights_bytes: int = 0
  kv_pool_bytes: int = 0
  trainer_state_bytes: int = 0

  @property
  def sampler_fits(self) -> bool:
    return self.sampler_bytes <= self.limit_bytes

  @property
  def trainer_fits(self) -> bool:
    return self.trainer_bytes <= self.limit_bytes

  @property
  def fits(self) -> bool:
    return self.sampler_fits and self.trainer_fits


def estimate(*, cfg, model_cfg, params: int, sampler_tensor: int, trainer_devices: int,
             trainer_tensor: int, memory_gib: float, usable_fraction: float = 0.9,
             colocated: bool = False) -> MemoryEstimate:
  """Memory per device for a layout (formulas in the module docstring).

  Colocated layouts put both roles on every device, so each device holds their sum.
  """
  sampler_b = DTYPE_BYTES[cfg.sampler.dtype]
  kv_tok = kv_bytes_per_token(num_layers=model_cfg.num_layers,
                              num_kv_heads=model_cfg.num_kv_heads,
                              head_dim=model_cfg.head_dim, dtype=cfg.sampler.dtype)
  pool = kv_pool_bytes(sampler_cfg=cfg.sampler, kv_per_token=kv_tok)
  weights_s = params * sampler_b
  adapter_params, target_params = lora_sizes(model_cfg)
  base_b = DTYPE_BYTES[cfg.model.param_dtype]
  if adapter_params:
    held = weights_s + 2 * (target_params + adapter_params) * sampler_b
    state = params * base_b + adapter_params * (4 + 4 + 8 + sampler_b)
  else:
    held = 2 * weights_s
    state = params * (4 + 4 + 8 + (base_b if cfg.trainer.kl_beta > 0 else 0) + sampler_b)
  sampler = (held + pool) // sampler_tensor
  shards = max(trainer_devices // trainer_tensor, 1)
  batch = cfg.rl.groups_per_step * cfg.rl.group_size
  rows = max(-(-(cfg.trainer.micro_batch_size or batch) // shards), 1)
  seq_len = pick_bucket(cfg.data.max_prompt_length + cfg.sampler.max_new_tokens,
                        cfg.trainer.length_buckets)
  acts = activation_bytes(model_cfg=model_cfg, rows=rows, seq_len=seq_len,
                          dtype=cfg.model.dtype, remat=model_cfg.remat == "full")
  trainer = state // trainer_devices + acts // trainer_tensor
  parts = dict(sampler_weights_bytes=int(held // sampler_tensor),
               kv_pool_bytes=int(pool // sampler_tensor),
               trainer_state_bytes=int(state // trainer_devices))
  if colocated:
    sampler = trainer = sampler + trainer
  return MemoryEstimate(sampler_bytes=int(sampler), trainer_bytes=int(trainer),
                        limit_bytes=int(usable_fraction * memory_gib * 2**30),
                        kv_tokens_per_replica=int(pool // kv_tok),
                        weight_bytes_sampler=int(weights_s), activation_bytes=int(acts),
                        **parts)

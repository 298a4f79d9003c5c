"""Model shapes: `ModelConfig`, the named presets, and an arithmetic parameter count.

The real presets copy the published Hugging Face config.json of each model, so a preset
with random weights has exactly the shape (and therefore the memory and FLOPs) of the
real checkpoint. Loading a checkpoint with `from_pretrained` builds its own config from
the checkpoint's config.json instead.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax


# A static pytree (no leaves): jax.jit / eval_shape / grad accept it as an ordinary
# argument and key their caches on its value.
@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer shape (Llama 3 / Qwen2 family).

  `dtype` is the compute dtype and `param_dtype` the stored parameter dtype, both as
  numpy dtype names ("float32", "bfloat16"). `rope_scaling` is None or a dict in Hugging
  Face's llama3 form: {"rope_type": "llama3", "factor", "low_freq_factor",
  "high_freq_factor", "original_max_position_embeddings"}.

  `attention` picks the full-sequence attention kernel (training and prefill), one of
  ATTENTION_IMPLS; see rl_jax.model.attention. `remat` is the layer rematerialisation
  policy, one of REMAT_POLICIES: "none" keeps every activation for the backward pass,
  "full" recomputes each layer's forward in the backward pass (least memory, one more
  forward), "dots" saves the weight-matmul outputs and recomputes the rest
  (jax.checkpoint_policies.dots_with_no_batch_dims_saveable: attention scores are
  batched dots, so they are recomputed). The booleans of older configs map True ->
  "full", False -> "none".
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  # Excluded from the hash (a dict is unhashable) but still compared, so the config
  # stays usable as a static jit argument.
  rope_scaling: dict[str, Any] | None = dataclasses.field(default=None, hash=False)
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qkv_bias: bool = False
  max_position_embeddings: int = 2048
  dtype: str = "float32"
  param_dtype: str = "float32"
  bos_id: int = 1
  eos_id: int = 2
  pad_id: int = 0
  remat: str = "none"
  attention: str = "auto"
  # Low-rank adapters (rl_jax.model.lora): rank 0 = off; alpha / rank scales B A.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ()
  lora_dropout: float = 0.0

  def __post_init__(self):
    if isinstance(self.remat, bool):
      # Frozen dataclass: normalise the legacy boolean in place, once.
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
    if self.attention not in ATTENTION_IMPLS:
      raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
    if isinstance(self.lora_targets, (list, str)):
      targets = self.lora_targets.split(",") if isinstance(self.lora_targets, str) else self.lora_targets
      object.__setattr__(self, "lora_targets", tuple(t.strip() for t in targets if t.strip()))
    _check_lora(self)
    for field in ("dtype", "param_dtype"):
      name = getattr(self, field)
      if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{field} must be float32, bfloat16 or float16, got {name!r}")
    if self.rope_scaling is not None:
      missing = [k for k in _LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
      if self.rope_scaling.get("rope_type", "llama3") != "llama3" or missing:
        raise ValueError(
            f"rope_scaling must be a llama3 dict with keys {_LLAMA3_ROPE_KEYS}, "
            f"got {self.rope_scaling!r}")

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)


REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_IMPLS = ("auto", "jnp", "xla", "cudnn", "splash")

_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _check_lora(cfg) -> None:
  """ValueError naming the first bad LoRA field (model.lora.* in a run config)."""
  if cfg.lora_rank < 0:
    raise ValueError(f"lora rank must be >= 0 (0 = off), got {cfg.lora_rank}")
  if cfg.lora_rank == 0:
    return
  if not cfg.lora_alpha > 0:
    raise ValueError(f"lora alpha must be > 0, got {cfg.lora_alpha}")
  if not 0 <= cfg.lora_dropout < 1:
    raise ValueError(f"lora dropout must be in [0, 1), got {cfg.lora_dropout}")
  unknown = [t for t in cfg.lora_targets if t not in LORA_TARGETS]
  if unknown or not cfg.lora_targets or len(set(cfg.lora_targets)) != len(cfg.lora_targets):
    raise ValueError(f"lora targets must be distinct names from {LORA_TARGETS}, got "
                     f"{cfg.lora_targets!r}")


def _llama3_scaling(factor: float) -> dict[str, Any]:
  return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


PRESETS: dict[str, ModelConfig] = {
    # Char-level model for the embedded default; CharTokenizer ids are all < 128.
    "tiny_char": ModelConfig(
        vocab_size=128, hidden_size=128, intermediate_size=512, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_embeddings=True, max_position_embeddings=1024,
        bos_id=1, eos_id=2, pad_id=0),
    # Qwen2.5-0.5B: <|endoftext|> (151643) is bos, eos and pad of the base model.
    "qwen2_0_5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_embeddings=True, qkv_bias=True, max_position_embeddings=32768,
        bos_id=151643, eos_id=151643, pad_id=151643),
    "qwen2_1_5b": ModelConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_embeddings=True, qkv_bias=True, max_position_embeddings=131072,
        bos_id=151643, eos_id=151643, pad_id=151643),
    # Llama 3.2 1B; Llama 3 has no pad token, 128004 is its reserved fine-tune pad.
    "llama3_1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
        rope_scaling=_llama3_scaling(32.0), rms_norm_eps=1e-5, tie_embeddings=True,
        max_position_embeddings=131072, bos_id=128000, eos_id=128001, pad_id=128004),
    "llama3_8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=_llama3_scaling(8.0), rms_norm_eps=1e-5, tie_embeddings=False,
        max_position_embeddings=131072, bos_id=128000, eos_id=128001, pad_id=128004),
}


def resolve_dtype(name: str, backend: str | None = None) -> str:
  """A config's compute dtype: "auto" is bfloat16 on GPU and TPU (the matmul rate; the
  trainer keeps float32 master params) and float32 on CPU (where bf16 arithmetic is
  emulated and slower); any other name is returned as is."""
  if name != "auto":
    return name
  return "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"


def get_preset(name: str) -> ModelConfig:
  """The preset called `name`; ValueError naming the allowed ones otherwise."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
  return PRESETS[name]


def num_params(cfg: ModelConfig) -> int:
  """Parameter count from the shape alone (matches `init_params`)."""
  d, h, k, hd, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                    cfg.intermediate_size)
  attn = d * h * hd + 2 * d * k * hd + h * hd * d
  bias = (h * hd + 2 * k * hd) if cfg.qkv_bias else 0
  per_layer = attn + bias + 3 * d * f + 2 * d  # + two RMSNorm scales
  embed = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
  return cfg.num_layers * per_layer + embed + d

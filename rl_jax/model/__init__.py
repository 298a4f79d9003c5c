"""rl_jax.model: the Llama 3 / Qwen2 transformer, presets, HF checkpoints, LoRA
adapters (PEFT export), tokenizers.

Parameters are plain nested dicts of arrays; `param_logical_axes` gives the matching
logical axis names for rl_jax.sharding. `forward` takes a pluggable attention so the
sampler's paged KV cache runs the same layer code as `apply` (training). Training takes
`hidden_states` and computes token log-probs from them in chunks (`token_stats`).
"""
from rl_jax.model.hf_io import (CheckpointError, from_pretrained, from_run_config,
                                save_pretrained)
from rl_jax.model.head import TokenStats, token_stats
from rl_jax.model.peft_io import load_peft_adapter, save_peft_adapter
from rl_jax.model.presets import (ATTENTION_IMPLS, PRESETS, REMAT_POLICIES, ModelConfig,
                                  get_preset, num_params)
from rl_jax.model.tokenizer import (CharTokenizer, HFTokenizer, format_prompt,
                                    load_tokenizer)
from rl_jax.model.transformer import (apply, causal_attention, forward, gqa_attention,
                                      hidden_states, init_params, param_logical_axes)

__all__ = [
    "ATTENTION_IMPLS", "CharTokenizer", "CheckpointError", "HFTokenizer", "ModelConfig",
    "PRESETS", "REMAT_POLICIES", "TokenStats", "apply", "causal_attention", "format_prompt",
    "forward", "from_pretrained", "from_run_config", "get_preset", "gqa_attention",
    "hidden_states", "init_params", "load_peft_adapter", "load_tokenizer", "num_params",
    "param_logical_axes", "save_peft_adapter", "save_pretrained", "token_stats",
]

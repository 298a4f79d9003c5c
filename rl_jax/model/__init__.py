"""rl_jax.model: the Llama 3 / Qwen2 transformer, presets, HF checkpoints, tokenizers.

Parameters are plain nested dicts of arrays; `param_logical_axes` gives the matching
logical axis names for rl_jax.sharding. `forward` takes a pluggable attention so the
sampler's paged KV cache runs the same layer code as `apply` (training).
"""
from rl_jax.model.hf_io import (CheckpointError, from_pretrained, from_run_config,
                                save_pretrained)
from rl_jax.model.presets import PRESETS, ModelConfig, get_preset, num_params
from rl_jax.model.tokenizer import (CharTokenizer, HFTokenizer, format_prompt,
                                    load_tokenizer)
from rl_jax.model.transformer import (apply, causal_attention, forward, gqa_attention,
                                      init_params, param_logical_axes)

__all__ = [
    "CharTokenizer", "CheckpointError", "HFTokenizer", "ModelConfig", "PRESETS", "apply",
    "causal_attention", "format_prompt", "forward", "from_pretrained", "from_run_config",
    "get_preset",
    "gqa_attention", "init_params", "load_tokenizer", "num_params", "param_logical_axes",
    "save_pretrained",
]

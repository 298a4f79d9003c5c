"""rl_jax LoRA adapters <-> PEFT adapter directories (adapter_config.json +
adapter_model.safetensors), loadable with `peft.PeftModel.from_pretrained(base, dir)`.

Shape letters as in rl_jax.model.lora: l layers, r rank; `in`/`out` are a target's input
and output axes flattened in row-major order, as Hugging Face flattens them (hf_io).

A PEFT LoRA Linear computes y = x W^T + (alpha / r) (x A^T) B^T with
  lora_A.weight (r, in)    lora_B.weight (out, r)
and rl_jax computes y = x W0 + (alpha / r) (x a) b with a (*in, r), b (r, *out), so per
layer i
  lora_A.weight = a[i].reshape(in, r)^T      lora_B.weight = b[i].reshape(r, out)^T.
Keys are `base_model.model.model.layers.{i}.<module>.lora_{A,B}.weight` (PeftModel's
module path with the adapter name removed, as `PeftModel.save_pretrained` writes them).
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import safetensors.numpy

from rl_jax.model import lora
from rl_jax.model.hf_io import CheckpointError, _open, _read_json
from rl_jax.model.presets import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# rl_jax target -> (Hugging Face module path under model.layers.{i}, PEFT target name).
MODULES = {
    "q": ("self_attn.q_proj", "q_proj"), "k": ("self_attn.k_proj", "k_proj"),
    "v": ("self_attn.v_proj", "v_proj"), "o": ("self_attn.o_proj", "o_proj"),
    "gate": ("mlp.gate_proj", "gate_proj"), "up": ("mlp.up_proj", "up_proj"),
    "down": ("mlp.down_proj", "down_proj"),
}
_TARGET_OF = {hf: t for t, (_, hf) in MODULES.items()}


def key(layer: int, target: str, which: str) -> str:
  """The safetensors key of one layer's lora_A ("a") or lora_B ("b") weight."""
  return (f"base_model.model.model.layers.{layer}.{MODULES[target][0]}."
          f"lora_{which.upper()}.weight")


def adapter_config(model_cfg: ModelConfig, base_model_name_or_path: str | None) -> dict:
  """adapter_config.json for `model_cfg`'s LoRA fields (plain LoRA: no rsLoRA, DoRA,
  biases or per-layer patterns, which rl_jax does not train)."""
  return {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model_name_or_path,
      "r": model_cfg.lora_rank,
      "lora_alpha": model_cfg.lora_alpha,
      "lora_dropout": model_cfg.lora_dropout,
      "target_modules": [MODULES[t][1] for t in lora.TARGETS if t in model_cfg.lora_targets],
      "bias": "none",
      "fan_in_fan_out": False,
      "use_rslora": False,
      "use_dora": False,
      "init_lora_weights": True,
      "inference_mode": True,
      "modules_to_save": None,
      "layers_to_transform": None,
      "rank_pattern": {},
      "alpha_pattern": {},
  }


def to_peft(model_cfg: ModelConfig, adapters: dict) -> dict[str, np.ndarray]:
  """{safetensors key: (r, in) or (out, r) float32 array} from rl_jax adapters
  (host or device arrays of layout lora.adapter_shapes(model_cfg))."""
  out = {}
  r = model_cfg.lora_rank
  for t in model_cfg.lora_targets:
    a = np.asarray(adapters[t]["a"], np.float32)
    b = np.asarray(adapters[t]["b"], np.float32)
    for i in range(model_cfg.num_layers):
      out[key(i, t, "a")] = np.ascontiguousarray(a[i].reshape(-1, r).T)
      out[key(i, t, "b")] = np.ascontiguousarray(b[i].reshape(r, -1).T)
  return out


def save_peft_adapter(out_dir: str, model_cfg: ModelConfig, adapters: dict,
                      base_model_name_or_path: str | None = None) -> None:
  """Write adapter_config.json and adapter_model.safetensors (float32) to `out_dir`."""
  if not lora.enabled(model_cfg):
    raise ValueError("save_peft_adapter needs a model config with lora_rank > 0")
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as fh:
    json.dump(adapter_config(model_cfg, base_model_name_or_path), fh, indent=2)
  # transformers / peft refuse safetensors files without a known "format" in the metadata.
  safetensors.numpy.save_file(to_peft(model_cfg, adapters),
                              os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})


def _lora_fields(hf: dict, where: str) -> dict:
  """ModelConfig LoRA fields from an adapter_config.json dict; CheckpointError naming
  the first field rl_jax cannot represent."""
  if hf.get("peft_type") != "LORA":
    raise CheckpointError(f"{where} has peft_type {hf.get('peft_type')!r}; rl_jax reads LORA")
  if hf.get("bias", "none") != "none":
    raise CheckpointError(f"{where} sets bias={hf['bias']!r}; rl_jax's LoRA has no biases")
  for field in ("use_rslora", "use_dora", "fan_in_fan_out", "lora_bias", "layers_to_transform",
                "layer_replication", "modules_to_save", "exclude_modules", "target_parameters",
                "trainable_token_indices", "rank_pattern", "alpha_pattern"):
    if hf.get(field):
      raise CheckpointError(f"{where} sets {field}={hf[field]!r}, which rl_jax's LoRA does "
                            f"not support")
  modules = hf.get("target_modules")
  if isinstance(modules, str) or not modules or any(m not in _TARGET_OF for m in modules):
    raise CheckpointError(f"{where} target_modules {modules!r} must be a list of names from "
                          f"{sorted(_TARGET_OF)}")
  return dict(lora_rank=int(hf["r"]), lora_alpha=float(hf["lora_alpha"]),
              lora_dropout=float(hf.get("lora_dropout") or 0.0),
              lora_targets=tuple(t for t in lora.TARGETS if MODULES[t][1] in modules))


def load_peft_adapter(path: str, model_cfg: ModelConfig) -> tuple[ModelConfig, dict]:
  """(model_cfg with the adapter's LoRA fields, float32 numpy adapters) from a PEFT dir
  written for a base of `model_cfg`'s shape. Raises CheckpointError naming the file,
  field or tensor it cannot read."""
  where = os.path.join(path, CONFIG_FILE)
  cfg = model_cfg.replace(**_lora_fields(_read_json(where), where))
  shapes = lora.adapter_shapes(cfg)
  file = os.path.join(path, WEIGHTS_FILE)
  adapters = {}
  with _open(file) as handle:
    names = set(handle.keys())
    for t in cfg.lora_targets:
      adapters[t] = {}
      for which in ("a", "b"):
        shape = shapes[t][which].shape  # (l, *in, r) or (l, r, *out)
        per_layer = shape[1:]
        hf_shape = ((per_layer[-1], math.prod(per_layer[:-1])) if which == "a" else
                    (math.prod(per_layer[1:]), per_layer[0]))
        stacked = np.empty(shape, np.float32)
        for i in range(cfg.num_layers):
          name = key(i, t, which)
          if name not in names:
            raise CheckpointError(f"tensor {name!r} is missing from {file}")
          w = handle.get_tensor(name)
          if tuple(w.shape) != hf_shape:
            raise CheckpointError(f"tensor {name!r} in {file} has shape {tuple(w.shape)} but "
                                  f"{CONFIG_FILE} and the base imply {hf_shape}")
          stacked[i] = w.astype(np.float32).T.reshape(per_layer)
        adapters[t][which] = stacked
  return cfg, adapters

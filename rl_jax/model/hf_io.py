"""Hugging Face checkpoints (LlamaForCausalLM, Qwen2ForCausalLM) <-> rl_jax params.

Reads and writes config.json plus safetensors (one `model.safetensors`, or shards listed
in `model.safetensors.index.json`) with the `safetensors` numpy API; no torch.

Shape letters: l layers, e embed, h query heads, k kv heads, d head_dim, f mlp, v vocab.

Layout: a Hugging Face Linear stores weight [out, in] and computes x @ W^T, so
  q_proj.weight (h*d, e)  -> layers/q  (e, h, d)   = W^T reshaped
  o_proj.weight (e, h*d)  -> layers/o  (h, d, e)   = W^T reshaped
  gate/up_proj  (f, e)    -> (e, f);  down_proj (e, f) -> (f, e);  lm_head (v, e) -> (e, v)
and per-layer tensors are stacked on a leading `l` axis. Both families apply RoPE with
rotate_half, as rl_jax does, so q/k weights load without permutation.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from rl_jax.errors import UserError
from rl_jax.model.presets import ModelConfig
from rl_jax.model.transformer import init_params

_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointError(UserError, ValueError):
  """A checkpoint rl_jax cannot read: the message names the file, field or tensor."""


def _layer_specs(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...], bool]]:
  """(rl_jax name, HF name after `model.layers.{i}.`, HF shape, is a Linear weight)."""
  e, h, k, d, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)
  specs = [
      ("attn_norm", "input_layernorm.weight", (e,), False),
      ("q", "self_attn.q_proj.weight", (h * d, e), True),
      ("k", "self_attn.k_proj.weight", (k * d, e), True),
      ("v", "self_attn.v_proj.weight", (k * d, e), True),
      ("o", "self_attn.o_proj.weight", (e, h * d), True),
      ("mlp_norm", "post_attention_layernorm.weight", (e,), False),
      ("gate", "mlp.gate_proj.weight", (f, e), True),
      ("up", "mlp.up_proj.weight", (f, e), True),
      ("down", "mlp.down_proj.weight", (e, f), True),
  ]
  if cfg.qkv_bias:
    specs += [
        ("q_bias", "self_attn.q_proj.bias", (h * d,), False),
        ("k_bias", "self_attn.k_proj.bias", (k * d,), False),
        ("v_bias", "self_attn.v_proj.bias", (k * d,), False),
    ]
  return specs


def _top_specs(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...], bool]]:
  specs = [("embed", "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), False),
           ("final_norm", "model.norm.weight", (cfg.hidden_size,), False)]
  if not cfg.tie_embeddings:
    specs.append(("lm_head", "lm_head.weight", (cfg.vocab_size, cfg.hidden_size), True))
  return specs


def _to_ours(w: np.ndarray, shape: tuple[int, ...], linear: bool, dtype) -> np.ndarray:
  return (w.T if linear else w).reshape(shape).astype(dtype)


def _to_hf(p: np.ndarray, hf_shape: tuple[int, ...], linear: bool) -> np.ndarray:
  if linear:
    return np.ascontiguousarray(p.reshape(hf_shape[::-1]).T)
  return np.ascontiguousarray(p.reshape(hf_shape))


def _read_json(file: str) -> dict:
  if not os.path.exists(file):
    raise CheckpointError(f"checkpoint file {file} does not exist")
  try:
    with open(file) as fh:
      return json.load(fh)
  except json.JSONDecodeError as err:
    raise CheckpointError(f"{file} is not valid JSON ({err})") from err


def config_from_hf(hf: dict, *, dtype: str = "float32", where: str = "config.json") -> ModelConfig:
  """ModelConfig from a Hugging Face config.json dict; `where` names it in errors."""
  archs = hf.get("architectures") or []
  arch = next((a for a in archs if a in _ARCHITECTURES), None)
  if arch is None and not archs:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(hf.get("model_type"))
  if arch is None:
    raise CheckpointError(
        f"{where} declares architectures {archs or hf.get('model_type')!r}; rl_jax reads "
        f"only {sorted(_ARCHITECTURES)}")
  family = _ARCHITECTURES[arch]

  def need(key):
    if hf.get(key) is None:
      raise CheckpointError(f"{where} has no {key!r} field")
    return hf[key]

  def unsupported(what):
    raise CheckpointError(f"{where} uses {what}, which rl_jax's {arch} does not support")

  if hf.get("hidden_act", "silu") != "silu":
    unsupported(f"hidden_act={hf['hidden_act']!r}")
  if family == "llama" and hf.get("attention_bias"):
    unsupported("attention_bias=true")
  if hf.get("mlp_bias"):
    unsupported("mlp_bias=true")
  if family == "qwen2" and hf.get("use_sliding_window"):
    unsupported("use_sliding_window=true")

  hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
  max_pos = int(hf.get("max_position_embeddings") or (2048 if family == "llama" else 32768))
  # transformers >= 5 writes `rope_parameters` (theta inside); older versions write
  # `rope_theta` next to an optional `rope_scaling`.
  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)
  if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0)) != 1.0:
    unsupported("partial_rotary_factor != 1")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "default":
    rope_scaling = None
  elif rope_type == "llama3":
    try:
      rope_scaling = {
          "rope_type": "llama3", "factor": float(rope["factor"]),
          "low_freq_factor": float(rope["low_freq_factor"]),
          "high_freq_factor": float(rope["high_freq_factor"]),
          "original_max_position_embeddings":
              int(rope.get("original_max_position_embeddings") or max_pos)}
    except KeyError as err:
      raise CheckpointError(f"{where} llama3 rope scaling has no {err.args[0]!r} field") from err
  else:
    unsupported(f"rope_type={rope_type!r}")

  eos = hf.get("eos_token_id")
  if isinstance(eos, list):  # several stop tokens: the first is the canonical eos
    eos = eos[0] if eos else None
  bos, pad = hf.get("bos_token_id"), hf.get("pad_token_id")
  # The tokenizer's special ids are authoritative; an id config.json lacks falls back
  # to another special id so that it is at least a valid token.
  fallback = next((i for i in (eos, bos, pad) if i is not None), 0)
  return ModelConfig(
      vocab_size=int(need("vocab_size")),
      hidden_size=hidden,
      intermediate_size=int(need("intermediate_size")),
      num_layers=int(need("num_hidden_layers")),
      num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or hidden // heads),
      rope_theta=theta,
      rope_scaling=rope_scaling,
      rms_norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=family == "qwen2",
      max_position_embeddings=max_pos,
      dtype=dtype,
      param_dtype=dtype,
      bos_id=int(fallback if bos is None else bos),
      eos_id=int(fallback if eos is None else eos),
      pad_id=int(fallback if pad is None else pad),
  )


def config_to_hf(cfg: ModelConfig) -> dict:
  """config.json dict for `cfg` (Qwen2ForCausalLM when it has qkv biases, else Llama)."""
  arch = "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"
  hf: dict[str, Any] = {
      "architectures": [arch],
      "model_type": _ARCHITECTURES[arch],
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta,
      "max_position_embeddings": cfg.max_position_embeddings,
      "tie_word_embeddings": cfg.tie_embeddings,
      "bos_token_id": cfg.bos_id,
      "eos_token_id": cfg.eos_id,
      "pad_token_id": cfg.pad_id,
      "torch_dtype": cfg.param_dtype,
  }
  # The pre-5.0 spelling; transformers 5 still reads it and older releases need it.
  if cfg.rope_scaling is not None:
    hf["rope_scaling"] = dict(cfg.rope_scaling)
  if cfg.qkv_bias:
    hf["use_sliding_window"] = False
  else:
    hf["attention_bias"] = False
    hf["mlp_bias"] = False
  return hf


def _tensor_files(path: str) -> dict[str, str]:
  """HF tensor name -> safetensors file holding it."""
  index_file = os.path.join(path, _INDEX)
  if os.path.exists(index_file):
    weight_map = _read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index_file} has no 'weight_map' field")
    return {name: os.path.join(path, f) for name, f in weight_map.items()}
  files = ([_SINGLE] if os.path.exists(os.path.join(path, _SINGLE)) else
           sorted(f for f in os.listdir(path) if f.endswith(".safetensors")))
  if not files:
    raise CheckpointError(f"checkpoint directory {path} has no .safetensors file")
  out = {}
  for f in files:
    with _open(os.path.join(path, f)) as handle:
      out.update(dict.fromkeys(handle.keys(), os.path.join(path, f)))
  return out


def _open(file: str):
  if not os.path.exists(file):
    raise CheckpointError(f"safetensors file {file} does not exist")
  try:
    return safetensors.safe_open(file, framework="np")
  except Exception as err:  # SafetensorError, or OSError from a truncated file.
    raise CheckpointError(f"{file} has a corrupt safetensors header ({err})") from err


def dtype_name(dtype) -> str:
  """"float32" | "bfloat16" | "float16" from a name or a dtype object (jnp.float32,
  np.dtype("float16"), ...); ValueError naming the allowed ones otherwise."""
  try:
    name = jnp.dtype(dtype).name
  except TypeError:
    name = None
  if name not in ("float32", "bfloat16", "float16"):
    raise ValueError(f"dtype must be float32, bfloat16 or float16 (a name or a dtype such "
                     f"as jnp.float32), got {dtype!r}")
  return name


def from_run_config(section, *, weights: bool = False,
                    weights_dtype: str = "float32") -> tuple[ModelConfig, dict | None]:
  """The model a run's `model` config section names: model.path's Hugging Face config
  (its params too, host arrays of `weights_dtype`, when `weights`) or model.preset
  (params None), with the section's dtype ("auto" resolved for this backend),
  param_dtype, remat and attention."""
  from rl_jax.model.presets import get_preset, resolve_dtype
  params = None
  if not section.path:
    mc = get_preset(section.preset)
  elif weights:
    mc, params = from_pretrained(section.path, dtype=weights_dtype)
  else:
    where = os.path.join(section.path, "config.json")
    mc = config_from_hf(_read_json(where), where=where)
  lora = section.get("lora")
  lora_fields = {} if lora is None or not lora.rank else dict(
      lora_rank=int(lora.rank), lora_alpha=float(lora.alpha),
      lora_targets=str(lora.targets), lora_dropout=float(lora.dropout))
  return mc.replace(dtype=resolve_dtype(section.dtype), param_dtype=section.param_dtype,
                    remat=section.remat, attention=section.attention, **lora_fields), params


def from_pretrained(path: str, dtype="float32") -> tuple[ModelConfig, dict]:
  """(model_cfg, params) from a Hugging Face LlamaForCausalLM / Qwen2ForCausalLM dir.

  `dtype` is a name ("bfloat16") or a dtype object (jnp.bfloat16, np.float32). Params
  are host numpy arrays of that dtype (device_put them with the wanted shardings); the
  returned config has both `dtype` and `param_dtype` set to its name.
  Raises CheckpointError for anything it cannot read.
  """
  dtype = dtype_name(dtype)
  cfg = config_from_hf(_read_json(os.path.join(path, "config.json")), dtype=dtype,
                       where=os.path.join(path, "config.json"))
  shapes = jax.eval_shape(init_params, cfg, jax.random.key(0))
  np_dtype = jnp.dtype(dtype)
  files = _tensor_files(path)
  with contextlib.ExitStack() as stack:
    handles: dict[str, Any] = {}

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
      if name not in files:
        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {path}")
      file = files[name]
      if file not in handles:
        handles[file] = stack.enter_context(_open(file))
      try:
        w = handles[file].get_tensor(name)
      except Exception as err:
        raise CheckpointError(f"tensor {name!r} cannot be read from {file} ({err})") from err
      if tuple(w.shape) != shape:
        raise CheckpointError(
            f"tensor {name!r} in {file} has shape {tuple(w.shape)} but config.json implies "
            f"{shape}")
      return w

    params: dict[str, Any] = {"layers": {}}
    for ours, hf_name, hf_shape, linear in _top_specs(cfg):
      params[ours] = _to_ours(read(hf_name, hf_shape), shapes[ours].shape, linear, np_dtype)
    for ours, suffix, hf_shape, linear in _layer_specs(cfg):
      stacked = np.empty(shapes["layers"][ours].shape, np_dtype)
      for i in range(cfg.num_layers):
        stacked[i] = _to_ours(read(f"model.layers.{i}.{suffix}", hf_shape),
                              stacked.shape[1:], linear, np_dtype)
      params["layers"][ours] = stacked
  return cfg, params


def _hf_tensors(cfg: ModelConfig, params: dict):
  """[(HF name, nbytes, convert)] in checkpoint order; convert() builds one HF tensor."""
  host = jax.tree.map(np.asarray, jax.device_get(params))

  out = []

  def add(hf_name, array, hf_shape, linear):
    out.append((hf_name, array.nbytes, functools.partial(_to_hf, array, hf_shape, linear)))

  # transformers' order: embeddings, layers, final norm, lm_head.
  embed, *tail = _top_specs(cfg)
  for ours, hf_name, hf_shape, linear in [embed]:
    add(hf_name, host[ours], hf_shape, linear)
  for i in range(cfg.num_layers):
    for ours, suffix, hf_shape, linear in _layer_specs(cfg):
      add(f"model.layers.{i}.{suffix}", host["layers"][ours][i], hf_shape, linear)
  for ours, hf_name, hf_shape, linear in tail:
    add(hf_name, host[ours], hf_shape, linear)
  return out


def save_pretrained(path: str, model_cfg: ModelConfig, params: dict, *,
                    max_shard_bytes: int = 4 * 2**30) -> None:
  """Write config.json and safetensors that transformers and `from_pretrained` read.

  Tensors keep the params' dtype. Above `max_shard_bytes` the weights are split into
  model-0000i-of-0000n.safetensors files plus model.safetensors.index.json; each shard
  is converted and written before the next, so at most one shard is held twice.
  """
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump(config_to_hf(model_cfg), fh, indent=2)
  shards: list[list] = [[]]
  size = 0
  for entry in _hf_tensors(model_cfg, params):
    if shards[-1] and size + entry[1] > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(entry)
    size += entry[1]
  # transformers refuses safetensors files without a known "format" in the metadata.
  metadata = {"format": "pt"}
  names = ([_SINGLE] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  for file, shard in zip(names, shards):
    safetensors.numpy.save_file({name: convert() for name, _, convert in shard},
                                os.path.join(path, file), metadata=metadata)
  if len(shards) > 1:
    weight_map = {name: file for file, shard in zip(names, shards) for name, _, _ in shard}
    total = sum(nbytes for shard in shards for _, nbytes, _ in shard)
    with open(os.path.join(path, _INDEX), "w") as fh:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)

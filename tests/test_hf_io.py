"""rl_jax.model.hf_io: save/load round trips, transformers compatibility, clear errors."""
import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from rl_jax import model as M


def _cfg(**kw):
  base = dict(vocab_size=80, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8, tie_embeddings=False, qkv_bias=True,
              rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=128,
              bos_id=1, eos_id=2, pad_id=0)
  return M.ModelConfig(**{**base, **kw})


def _random_params(cfg, seed):
  # Random values everywhere (including norms and biases) so a swapped or transposed
  # tensor cannot round-trip by accident.
  shapes = jax.eval_shape(M.init_params, cfg, jax.random.key(0))
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda s: rng.randn(*s.shape).astype(s.dtype), shapes)


def _assert_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kw", [
    dict(),
    dict(qkv_bias=False, tie_embeddings=True,
         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    dict(param_dtype="bfloat16", dtype="bfloat16"),
], ids=["qwen2_untied", "llama_tied_llama3", "bfloat16"])
def test_save_load_round_trip_is_bit_exact(kw, tmp_path):
  cfg = _cfg(**kw)
  params = _random_params(cfg, seed=0)
  M.save_pretrained(str(tmp_path), cfg, params)
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
  loaded_cfg, loaded = M.from_pretrained(str(tmp_path), dtype=cfg.param_dtype)
  assert loaded_cfg == cfg
  _assert_same(loaded, params)


def test_sharded_save_writes_an_index_and_round_trips(tmp_path):
  cfg = _cfg()
  params = _random_params(cfg, seed=1)
  M.save_pretrained(str(tmp_path), cfg, params, max_shard_bytes=20_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  shard_files = sorted(set(index["weight_map"].values()))
  assert len(shard_files) > 2 and not (tmp_path / "model.safetensors").exists()
  assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors")) == shard_files
  _assert_same(M.from_pretrained(str(tmp_path))[1], params)


@pytest.mark.parametrize("qkv_bias", [True, False], ids=["qwen2", "llama"])
def test_transformers_reads_saved_checkpoints(qkv_bias, tmp_path):
  # Llama also checks that transformers reads the legacy rope_scaling spelling.
  llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
  cfg = _cfg(qkv_bias=qkv_bias, tie_embeddings=not qkv_bias,
             rope_scaling=None if qkv_bias else llama3)
  params = jax.tree.map(lambda x: 0.3 * x, _random_params(cfg, seed=2))
  params["layers"]["attn_norm"] = 1 + params["layers"]["attn_norm"]
  params["layers"]["mlp_norm"] = 1 + params["layers"]["mlp_norm"]
  M.save_pretrained(str(tmp_path), cfg, params)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  assert type(hf_model).__name__ == ("Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM")
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 12))
  with torch.no_grad():
    ref = hf_model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(jax.jit(M.apply)(cfg, params, tokens), ref, atol=1e-4, rtol=0)


@pytest.fixture
def saved(tmp_path):
  cfg = _cfg()
  M.save_pretrained(str(tmp_path), cfg, _random_params(cfg, seed=3))
  return tmp_path


def _edit_config(path, **changes):
  file = path / "config.json"
  hf = json.loads(file.read_text())
  for key, value in changes.items():
    if value is None:
      del hf[key]
    else:
      hf[key] = value
  file.write_text(json.dumps(hf))


def _load_error(path) -> str:
  with pytest.raises(M.CheckpointError) as err:
    M.from_pretrained(str(path))
  assert isinstance(err.value, ValueError)
  return str(err.value)


def test_unsupported_architecture_is_named(saved):
  _edit_config(saved, architectures=["MistralForCausalLM"])
  message = _load_error(saved)
  assert "MistralForCausalLM" in message and "LlamaForCausalLM" in message


def test_unsupported_rope_type_is_named(saved):
  _edit_config(saved, rope_scaling={"rope_type": "yarn", "factor": 4.0})
  assert "yarn" in _load_error(saved)


def test_missing_config_field_is_named(saved):
  _edit_config(saved, hidden_size=None)
  assert "'hidden_size'" in _load_error(saved)


def test_missing_config_file_is_named(saved):
  (saved / "config.json").unlink()
  assert "config.json" in _load_error(saved)


def test_missing_tensor_is_named(saved):
  file = str(saved / "model.safetensors")
  tensors = safetensors.numpy.load_file(file)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  safetensors.numpy.save_file(tensors, file)
  assert "'model.layers.1.mlp.up_proj.weight'" in _load_error(saved)


def test_missing_lm_head_of_untied_model_is_named(saved):
  file = str(saved / "model.safetensors")
  tensors = safetensors.numpy.load_file(file)
  del tensors["lm_head.weight"]
  safetensors.numpy.save_file(tensors, file)
  assert "'lm_head.weight'" in _load_error(saved)


def test_shape_mismatch_is_named(saved):
  _edit_config(saved, intermediate_size=48)
  message = _load_error(saved)
  assert "'model.layers.0.mlp.gate_proj.weight'" in message and "(48, 32)" in message


def test_corrupt_header_names_the_file(saved):
  file = saved / "model.safetensors"
  data = bytearray(file.read_bytes())
  data[8:40] = b"#" * 32  # the JSON header starts after an 8-byte length
  file.write_bytes(bytes(data))
  message = _load_error(saved)
  assert "model.safetensors" in message and "header" in message


def test_truncated_file_names_the_file(saved):
  file = saved / "model.safetensors"
  file.write_bytes(file.read_bytes()[:6])
  assert "model.safetensors" in _load_error(saved)


def test_index_pointing_at_a_missing_shard_names_it(tmp_path):
  cfg = _cfg()
  M.save_pretrained(str(tmp_path), cfg, _random_params(cfg, seed=4), max_shard_bytes=20_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  shard = sorted(set(index["weight_map"].values()))[1]
  (tmp_path / shard).unlink()
  assert shard in _load_error(tmp_path)


@pytest.mark.parametrize("dtype, name", [
    ("float32", "float32"), (jax.numpy.float32, "float32"), (jax.numpy.bfloat16, "bfloat16"),
    (np.dtype("float16"), "float16"), (np.float32, "float32")])
def test_from_pretrained_takes_dtype_names_and_objects(tmp_path, dtype, name):
  cfg = _cfg()
  params = _random_params(cfg, seed=1)
  M.save_pretrained(str(tmp_path), cfg, params)
  loaded_cfg, loaded = M.from_pretrained(str(tmp_path), dtype=dtype)
  assert (loaded_cfg.dtype, loaded_cfg.param_dtype) == (name, name)
  assert {str(x.dtype) for x in jax.tree.leaves(loaded)} == {name}
  want = jax.tree.map(lambda x: np.asarray(x).astype(jax.numpy.dtype(name)), params)
  _assert_same(loaded, want)


@pytest.mark.parametrize("dtype", ["int8", jax.numpy.int32, "fp8", object()])
def test_from_pretrained_rejects_other_dtypes(saved, dtype):
  with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
    M.from_pretrained(str(saved), dtype=dtype)

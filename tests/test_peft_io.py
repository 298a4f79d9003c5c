"""rl_jax.model.peft_io: PEFT adapters that peft loads with rl_jax's logits, the merged
export, the key format peft itself writes, round trips and clear errors."""
import dataclasses
import json
import os
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import tiny_hf
from rl_jax import model as M
from rl_jax.model import lora, peft_io

peft = pytest.importorskip("peft")


def _cfg(**kw):
  base = dict(vocab_size=80, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8, tie_embeddings=False, qkv_bias=True,
              rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=128,
              bos_id=1, eos_id=2, pad_id=0, lora_rank=4, lora_alpha=8.0,
              lora_targets=lora.TARGETS)
  return M.ModelConfig(**{**base, **kw})


def _random(cfg, seed):
  """Random base params (norms near 1) and adapters with A and B both non-zero."""
  rng = np.random.RandomState(seed)
  shapes = jax.eval_shape(M.init_params, cfg, jax.random.key(0))
  params = jax.tree.map(lambda s: 0.3 * rng.randn(*s.shape).astype(s.dtype), shapes)
  for norm in ("attn_norm", "mlp_norm"):
    params["layers"][norm] = 1 + params["layers"][norm]
  adapters = jax.tree.map(lambda s: 0.2 * rng.randn(*s.shape).astype(np.float32),
                          lora.adapter_shapes(cfg))
  return params, adapters


@pytest.mark.parametrize("kw", [
    dict(qkv_bias=False, tie_embeddings=True),
    dict(lora_targets=("q", "v", "down")),
], ids=["llama_all_targets", "qwen2_qv_down"])
def test_peft_and_merged_exports_give_rl_jax_logits(kw, tmp_path):
  cfg = _cfg(**kw)
  params, adapters = _random(cfg, seed=0)
  base_dir, adapter_dir, merged_dir = (str(tmp_path / n) for n in ("base", "adapter", "merged"))
  M.save_pretrained(base_dir, cfg, params)
  peft_io.save_peft_adapter(adapter_dir, cfg, adapters, base_model_name_or_path=base_dir)
  M.save_pretrained(merged_dir, cfg, lora.merge_params(cfg, params, adapters))

  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 12))
  apply = jax.jit(M.apply)
  ours = np.asarray(apply(cfg, params, tokens, adapters=adapters))
  base_logits = np.asarray(apply(cfg, params, tokens))
  assert np.abs(ours - base_logits).max() > 0.1  # the adapter matters at this tolerance

  hf_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
  peft_model = peft.PeftModel.from_pretrained(hf_base, adapter_dir).eval()
  merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
  with torch.no_grad():
    peft_logits = peft_model(torch.tensor(tokens)).logits.numpy()
    merged_logits = merged(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(peft_logits, ours, atol=1e-4, rtol=0)
  np.testing.assert_allclose(merged_logits, ours, atol=1e-4, rtol=0)
  np.testing.assert_allclose(merged_logits, peft_logits, atol=1e-4, rtol=0)


def test_keys_and_shapes_are_the_ones_peft_writes(tmp_path):
  cfg = _cfg(qkv_bias=False, lora_targets=("k", "o", "gate", "up"))
  params, adapters = _random(cfg, seed=2)
  M.save_pretrained(str(tmp_path / "base"), cfg, params)
  hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
  peft_cfg = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, task_type="CAUSAL_LM",
                             target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])
  peft.get_peft_model(hf_base, peft_cfg).save_pretrained(str(tmp_path / "peft"))
  peft_io.save_peft_adapter(str(tmp_path / "ours"), cfg, adapters, str(tmp_path / "base"))

  def tensors(d):
    return {k: v.shape for k, v in
            safetensors.numpy.load_file(str(tmp_path / d / peft_io.WEIGHTS_FILE)).items()}

  assert tensors("ours") == tensors("peft")
  theirs = json.loads((tmp_path / "peft" / peft_io.CONFIG_FILE).read_text())
  ours = json.loads((tmp_path / "ours" / peft_io.CONFIG_FILE).read_text())
  for field, value in ours.items():
    if field != "target_modules":
      assert theirs[field] == value, field
  assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"])


def test_save_load_round_trip_is_exact(tmp_path):
  cfg = _cfg(lora_targets=("o", "up"), lora_dropout=0.1)
  _, adapters = _random(cfg, seed=3)
  peft_io.save_peft_adapter(str(tmp_path), cfg, adapters)
  assert sorted(os.listdir(tmp_path)) == [peft_io.CONFIG_FILE, peft_io.WEIGHTS_FILE]
  loaded_cfg, loaded = peft_io.load_peft_adapter(str(tmp_path), _cfg(lora_rank=0))
  assert loaded_cfg == cfg
  assert jax.tree.structure(loaded) == jax.tree.structure(adapters)
  for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(adapters)):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("change, message", [
    (dict(use_rslora=True), "use_rslora=True"),
    (dict(bias="all"), "bias='all'"),
    (dict(target_modules="q_proj|v_proj"), "target_modules"),
    (dict(target_modules=["q_proj", "lm_head"]), "target_modules"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
    (dict(peft_type="IA3"), "peft_type 'IA3'"),
])
def test_unsupported_adapter_configs_fail_in_one_line(change, message, tmp_path):
  cfg = _cfg(lora_targets=("q", "v"))
  peft_io.save_peft_adapter(str(tmp_path), cfg, _random(cfg, seed=4)[1])
  file = tmp_path / peft_io.CONFIG_FILE
  file.write_text(json.dumps({**json.loads(file.read_text()), **change}))
  with pytest.raises(M.CheckpointError, match=message) as err:
    peft_io.load_peft_adapter(str(tmp_path), cfg)
  assert "\n" not in str(err.value) and str(file) in str(err.value)


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
  cfg = _cfg(lora_targets=("q",))
  peft_io.save_peft_adapter(str(tmp_path), cfg, _random(cfg, seed=5)[1])
  with pytest.raises(M.CheckpointError, match=r"lora_A\.weight' .* has shape \(4, 32\)"):
    peft_io.load_peft_adapter(str(tmp_path), _cfg(hidden_size=48))


def _save_lora_run(workdir, cfg, base, adapters, *, model_path="", made):
  """Step 5 of a LoRA run as the loop checkpoints it: adapters (and an optimizer state),
  the base's record, and the base itself under checkpoints/base when the run made it."""
  from rl_jax import checkpoint
  from rl_jax import config as config_lib
  run = config_lib.base_config()
  run.model.path = model_path
  run.model.lora.rank, run.model.lora.alpha = cfg.lora_rank, cfg.lora_alpha
  run.model.lora.targets = ",".join(cfg.lora_targets)
  ck = checkpoint.Checkpointer(workdir, run.checkpoint)
  if made:
    ck.save_base(base)
  record = {"source": ck.base_path() if made else f"model.path {model_path!r}",
            "made_by_run": made, "fingerprint": checkpoint.fingerprint(base)}
  ck.save(5, params=adapters, opt_state={"mu": adapters}, ref_params=None, loop={"step": 5},
          config={"run": run.to_dict(), "model": dataclasses.asdict(cfg), "lora_base": record},
          wait=True)
  ck.close()


# run: a preset's random init; model_path: model.path as is; warmed_up: model.path changed
# by the supervised warm-up, which makes it the run's own base too.
@pytest.mark.parametrize("base_from", ["run", "model_path", "warmed_up"])
def test_export_of_a_lora_run_loads_in_peft_and_merged(base_from, tmp_path, capsys):
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "launch"))
  import export  # launch/export.py
  cfg = _cfg(qkv_bias=False, lora_targets=("q", "o", "up"))
  params, adapters = _random(cfg, seed=6)
  model_path = "" if base_from == "run" else str(tmp_path / "hf_base")
  made = base_from != "model_path"
  if model_path:
    M.save_pretrained(model_path, cfg, params if not made else jax.tree.map(
        lambda x: 0.5 * x, params))
    with open(os.path.join(model_path, "tokenizer_config.json"), "w") as f:
      f.write("{}")  # copied along with the export (and into a written base)
  workdir, out, merged_out = (str(tmp_path / n) for n in ("run", "adapter", "merged"))
  _save_lora_run(workdir, cfg, params, adapters, model_path=model_path, made=made)
  assert export.main(["--workdir", workdir, "--out", out]) == 0
  assert export.main(["--workdir", workdir, "--out", merged_out, "--merged"]) == 0
  assert "PEFT adapter (rank 4)" in capsys.readouterr().out
  files = ["adapter_config.json", "adapter_model.safetensors"]
  tokenizer = ["tokenizer_config.json"] if model_path else []
  # PEFT needs the base as a Hugging Face checkpoint: a base the run made is written.
  base_dir = os.path.join(out, "base") if made else model_path
  assert sorted(os.listdir(out)) == sorted(files + tokenizer + (["base"] if made else []))
  if made:
    assert sorted(os.listdir(base_dir)) == sorted(["config.json", "model.safetensors"]
                                                  + tokenizer)
  written = json.loads(open(os.path.join(out, peft_io.CONFIG_FILE)).read())
  assert written["base_model_name_or_path"] == os.path.abspath(base_dir)
  assert not os.path.exists(os.path.join(merged_out, peft_io.CONFIG_FILE))

  tokens = np.random.RandomState(7).randint(0, cfg.vocab_size, (2, 10))
  ours = np.asarray(jax.jit(M.apply)(cfg, params, tokens, adapters=adapters))
  hf_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
  with torch.no_grad():
    peft_logits = peft.PeftModel.from_pretrained(hf_base, out).eval()(
        torch.tensor(tokens)).logits.numpy()
    merged_logits = transformers.AutoModelForCausalLM.from_pretrained(merged_out).eval()(
        torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(peft_logits, ours, atol=1e-4, rtol=0)
  np.testing.assert_allclose(merged_logits, ours, atol=1e-4, rtol=0)


def test_an_adapter_made_by_peft_on_a_transformers_checkpoint_loads(tmp_path):
  """The other direction, with nothing written by rl_jax: a transformers Qwen2 checkpoint
  and a peft adapter with random A and B load into rl_jax with peft's logits."""
  base_dir = str(tmp_path / "ckpt")
  tiny_hf.write_checkpoint(base_dir)
  torch.manual_seed(1)
  hf_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
  peft_cfg = peft.LoraConfig(r=4, lora_alpha=12, init_lora_weights=False, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
  peft_model = peft.get_peft_model(hf_base, peft_cfg).eval()
  peft_model.save_pretrained(str(tmp_path / "adapter"))

  cfg, params = M.from_pretrained(base_dir)
  lora_cfg, adapters = peft_io.load_peft_adapter(str(tmp_path / "adapter"), cfg)
  assert (lora_cfg.lora_rank, lora_cfg.lora_alpha, lora_cfg.lora_targets) == (
      4, 12.0, ("q", "v", "o", "up"))
  assert all(np.abs(ab["b"]).max() > 0 for ab in adapters.values())
  tokens = np.random.RandomState(8).randint(0, cfg.vocab_size, (2, 12))
  with torch.no_grad():
    ref = peft_model(torch.tensor(tokens)).logits.numpy()
  ours = np.asarray(jax.jit(M.apply)(lora_cfg, params, tokens, adapters=adapters))
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
  assert np.abs(ours - np.asarray(jax.jit(M.apply)(cfg, params, tokens))).max() > 1e-2

"""LoRA training (model.lora.rank > 0): the trainer trains adapters on a frozen base
(rl_jax/trainer/train_step.py); checkpoints hold the adapters and the base's fingerprint
(rl_jax/checkpoint.py, rl_jax/orchestration/checkpointing.py)."""
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import model
from rl_jax.model import lora
from rl_jax.trainer import train_step as ts
from test_train_step import _groups, _host, _mesh, _model_cfg, _trainer_cfg

RANK, ALPHA = 2, 3.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lora_cfg(**kw):
  return _model_cfg().replace(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=lora.TARGETS, **kw)


@pytest.fixture(scope="module")
def base0():
  return model.init_params(_model_cfg(), jax.random.key(2))


def _nonzero_adapters(cfg, seed):
  """Adapters with B != 0 as well (an initialised B = 0 would hide dL/dA); NumPy, so
  drawing them compiles nothing."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(s.dtype),
                      lora.adapter_shapes(cfg))


def _next_token_logp(cfg, params, tokens_bt, adapters=None):
  """log pi(tokens[t + 1] | tokens[:t + 1]) from the full logits (model.apply), as one
  program (op by op, model.apply compiles every primitive separately)."""
  def logp(params, tokens_bt, adapters):
    logp_btv = jax.nn.log_softmax(model.apply(cfg, params, tokens_bt, adapters=adapters), -1)
    return jnp.take_along_axis(logp_btv[:, :-1], tokens_bt[:, 1:, None], axis=-1)[..., 0]
  run = jax.jit(logp, in_shardings=None, out_shardings=None, donate_argnums=())
  return np.asarray(run(params, tokens_bt, adapters))


def test_adapter_gradient_is_the_full_gradient_projected(base0):
  """With W = W0 + s A B (s = alpha / r) per layer and target, the chain rule gives
  dL/dA = s dL/dW B^T and dL/dB = s A^T dL/dW: the LoRA trainer's gradient against a
  full fine-tuning trainer's gradient at the merged weights (float32, the same pi_prox)."""
  cfg, mesh = _lora_cfg(), _mesh((1, 1, 1))
  tcfg = _trainer_cfg(kl_beta=0.0, loss_agg="seq_mean_token_mean")
  trainer = ts.Trainer(cfg, tcfg, mesh, total_steps=1)
  trainer.init_state(params=base0)
  full = ts.Trainer(_model_cfg(), tcfg, mesh, total_steps=1)
  adapters = _nonzero_adapters(cfg, 0)
  merged = lora.merge_params(cfg, base0, adapters)
  batch = trainer.make_train_batch(_groups(2))
  prox = trainer.logprobs(jax.tree.map(lambda x: 1.1 * x, adapters), batch)
  loss, grads = trainer.loss_and_grad(adapters, batch, prox)
  want_loss, full_grads = full.loss_and_grad(merged, batch, prox)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  s = ALPHA / RANK
  for t in cfg.lora_targets:
    a, b = (np.asarray(adapters[t][k]) for k in ("a", "b"))
    l, r = a.shape[0], a.shape[-1]
    g_w = np.asarray(full_grads["layers"][t]).reshape(l, -1, b[0].size // r)  # (l, in, out)
    a2, b2 = a.reshape(l, -1, r), b.reshape(l, r, -1)
    want_a = s * np.einsum("lio,lro->lir", g_w, b2)
    want_b = s * np.einsum("lir,lio->lro", a2, g_w)
    got_a = np.asarray(grads[t]["a"]).reshape(want_a.shape)
    got_b = np.asarray(grads[t]["b"]).reshape(want_b.shape)
    scale_a, scale_b = np.abs(want_a).max(), np.abs(want_b).max()
    assert scale_a > 1e-4 and scale_b > 1e-4, t
    np.testing.assert_allclose(got_a, want_a, atol=1e-4 * scale_a, rtol=1e-3, err_msg=t)
    np.testing.assert_allclose(got_b, want_b, atol=1e-4 * scale_b, rtol=1e-3, err_msg=t)


def test_lora_state_starts_at_the_base_and_trains_only_adapters(base0):
  """Sharded over 8 devices with a bfloat16 frozen base and the KL term on: step 0's
  policy is the base; steps leave the base bitwise unchanged and move the adapters; the
  optimizer state is the adapters' Adam moments only; the KL reference is the base
  without adapters (zero KL at the first step, positive once B != 0). Adapter dropout
  (0.5) acts in the step: Adam's first update of B = 0 is -lr sign(dL/dB), whose signs
  then disagree with the dropout-free gradient's in many places."""
  cfg = _lora_cfg(param_dtype="bfloat16", lora_dropout=0.5)
  trainer = ts.Trainer(cfg, _trainer_cfg(kl_beta=0.1, kl_estimator="k3"), _mesh((2, 2, 2)),
                       total_steps=4)
  state = trainer.init_state(params=base0, rng=jax.random.key(1))
  base = trainer.base_params
  assert not trainer.ref_params  # the base is the reference: no second copy
  for leaf, full_leaf, want in zip(jax.tree.leaves(base), jax.tree.leaves(base0),
                                   jax.tree.leaves(trainer.full_shardings)):
    assert leaf.dtype == jnp.bfloat16 and leaf.sharding == want
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(full_leaf.astype(jnp.bfloat16)))
  for leaf, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(trainer.param_shardings)):
    assert leaf.dtype == jnp.float32 and leaf.sharding == want
  assert sorted(state.params) == sorted(cfg.lora_targets)
  assert not any(np.any(np.asarray(state.params[t]["b"])) for t in cfg.lora_targets)

  batch = trainer.make_train_batch(_groups(3))
  prox = trainer.logprobs(state.params, batch)
  _, grads = trainer.loss_and_grad(state.params, batch, prox)  # no dropout
  got = np.asarray(prox)
  base_f32 = jax.tree.map(lambda x: x.astype(jnp.float32), _host(base))
  want = _next_token_logp(_model_cfg(), base_f32, jnp.asarray(batch.tokens_bt))
  mask = batch.mask_bt[:, :-1]  # the completion tokens (padding positions differ)
  np.testing.assert_allclose(got[:, :-1][mask], want[mask], atol=1e-5, rtol=0)

  # Adam moments only for the adapters: two adapter-shaped trees plus scalar counters.
  adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
  opt_leaves = jax.tree.leaves(state.opt_state)
  opt_bytes = sum(x.nbytes for x in opt_leaves)
  assert sum(x.ndim > 0 for x in opt_leaves) == 2 * len(jax.tree.leaves(state.params))
  assert 2 * adapter_bytes <= opt_bytes <= 2 * adapter_bytes + 64
  assert adapter_bytes < 0.2 * sum(x.nbytes for x in jax.tree.leaves(base0))

  before = _host(base)
  state, m1 = trainer.step(state, batch)
  b1 = {t: np.asarray(state.params[t]["b"]) for t in cfg.lora_targets}
  state, m2 = trainer.step(state, batch)
  jax.tree.map(np.testing.assert_array_equal, _host(trainer.base_params), before)
  assert all(np.any(np.asarray(state.params[t]["b"])) for t in cfg.lora_targets)
  assert m1["kl"] == 0.0 and m2["kl"] > 0
  flips = [np.sign(b1[t]) != -np.sign(np.asarray(grads[t]["b"])) for t in cfg.lora_targets]
  assert np.mean(np.concatenate([x.ravel() for x in flips])) > 0.05
  assert m1["skipped_nonfinite"] == m2["skipped_nonfinite"] == 0
  # The trained policy is base + adapters: its log-probs moved off the base's.
  moved = np.asarray(trainer.logprobs(state.params, batch))
  assert np.abs(moved - got)[batch.mask_bt].max() > 1e-4


LOOP = ["--config.rl.mode=sync", "--config.rl.total_steps=3", "--config.rl.groups_per_step=4",
        "--config.rl.group_size=4", "--config.rl.eval_every=0", "--config.task.digits=1",
        "--config.task.heldout_size=8", "--config.warmstart.steps=2",
        "--config.sampler.max_concurrent_decodes=16", "--config.sampler.max_new_tokens=6",
        "--config.trainer.length_buckets=(32,)", "--config.trainer.kl_beta=0.01",
        "--config.metrics.console=false", "--config.metrics.tensorboard=false",
        "--config.checkpoint.every=1", "--config.checkpoint.keep=10",
        "--config.model.lora.rank=4", "--config.model.lora.dropout=0.1"]
# Row entries a bitwise-identical continuation reproduces (timings and rates differ).
EXACT = ("optim/loss", "optim/grad_norm", "optim/update_norm", "policy/kl", "policy/entropy",
         "reward/train", "optim/tokens", "weight_sync/bytes")


def _loop_rows(workdir):
  import json
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return {r["step"]: r for r in rows if "optim/loss" in r}


def test_lora_run_resumes_exactly_and_refuses_another_base(tmp_path):
  """A sync LoRA run (warm-up, then adapters on the warmed-up base, KL to the base,
  dropout on): its checkpoints hold adapters only, the base once in checkpoints/base.
  Resumed from its step-1 checkpoint it repeats the uninterrupted run's rows and
  adapters bitwise; restore_params merges W0 + (alpha / r) A B; a resume against a
  different base stops with one line."""
  from rl_jax import checkpoint as ck
  from rl_jax import config as config_lib
  from rl_jax.orchestration import loop
  cfg, _ = config_lib.parse_args(["--config", os.path.join(ROOT, "configs/default.py"), *LOOP])
  cfg = config_lib.validate(cfg)
  ref, res = str(tmp_path / "ref"), str(tmp_path / "res")
  loop.Pipeline(cfg, ref).run()
  shutil.copytree(ref, res)
  for step in ("2", "3"):  # as if the run had stopped after committing step 1
    shutil.rmtree(os.path.join(ck.directory(res), step))
  summary = loop.Pipeline(cfg, res).run()
  assert summary["resumes"][0]["step"] == 1

  want, got = _loop_rows(ref), _loop_rows(res)
  assert sorted(got) == [1, 2, 3]
  for step in (2, 3):
    assert {k: got[step][k] for k in EXACT} == {k: want[step][k] for k in EXACT}
  assert want[3]["policy/kl"] > 0
  # The adapters' sync bytes: rank 4 on every projection of the tiny model.
  mcfg = ck.model_config(cfg)
  assert want[1]["weight_sync/bytes"] == 4 * lora.num_adapter_params(mcfg) < (
      0.1 * 4 * model.num_params(mcfg))

  ref_ck, res_ck = (ck.Checkpointer(w, read_only=True) for w in (ref, res))
  step, mcfg, base, adapters, _ = res_ck.restore_lora(3)
  _, _, ref_base, ref_adapters, _ = ref_ck.restore_lora(3)
  jax.tree.map(np.testing.assert_array_equal, (base, adapters), (ref_base, ref_adapters))
  assert sorted(adapters) == sorted(mcfg.lora_targets)
  assert os.path.isdir(os.path.join(ck.directory(ref), "base"))
  # Merged export params: W0 + (alpha / r) A B, written out in NumPy.
  merged = res_ck.restore_params(3)[1]
  s = mcfg.lora_alpha / mcfg.lora_rank
  for t in mcfg.lora_targets:
    a, b, w0 = adapters[t]["a"], adapters[t]["b"], base["layers"][t]
    prod = np.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]),
                     b.reshape(b.shape[0], b.shape[1], -1)).reshape(w0.shape)
    np.testing.assert_allclose(merged["layers"][t], w0 + s * prod, rtol=1e-6, atol=1e-6)
    assert np.abs(s * prod).max() > 1e-4
  np.testing.assert_array_equal(merged["embed"], base["embed"])

  # Another base under the same checkpoints: refused in one line naming both.
  res_ck.save_base(jax.tree.map(lambda x: x * 1.01, base))
  with pytest.raises(loop.RunError) as e:
    loop.Pipeline(cfg, res).run()
  line = str(e.value)
  assert "\n" not in line and "holds LoRA adapters trained on the base from" in line
  # The recorded base (written by the run this one was copied from) and the one found.
  assert f"from {os.path.join(ck.directory(ref), 'base')} (fingerprint" in line
  assert f"but the base from {res_ck.base_path()} has fingerprint" in line
  with pytest.raises(ck.RestoreError, match="fingerprint"):
    res_ck.restore_params(3)


def test_restore_lora_reads_a_model_path_base_and_refuses_a_changed_one(tmp_path):
  """A LoRA checkpoint of a run on model.path holds no base: restore_lora reads it from
  model.path again and refuses it once the directory holds other weights."""
  import dataclasses
  from rl_jax import checkpoint as ck
  from rl_jax import config as config_lib
  hf, workdir = str(tmp_path / "hf"), str(tmp_path / "run")
  base = jax.tree.map(np.asarray, model.init_params(_model_cfg(), jax.random.key(3)))
  model.save_pretrained(hf, _model_cfg(), base)
  cfg = config_lib.base_config()
  cfg.model.path, cfg.model.lora.rank, cfg.model.lora.alpha = hf, RANK, ALPHA
  mcfg = ck.model_config(cfg)
  adapters = jax.tree.map(np.asarray, _nonzero_adapters(mcfg, 1))
  record = {"source": f"model.path {hf!r}", "made_by_run": False,
            "fingerprint": ck.fingerprint(base)}
  writer = ck.Checkpointer(workdir, cfg.checkpoint)
  writer.save(4, params=adapters, opt_state=adapters, ref_params=None, loop={"step": 4},
              config={"run": cfg.to_dict(), "model": dataclasses.asdict(mcfg),
                      "lora_base": record}, wait=True)
  writer.close()
  reader = ck.Checkpointer(workdir, read_only=True)
  step, got_cfg, got_base, got_adapters, _ = reader.restore_lora()
  assert step == 4 and got_cfg == mcfg and not os.path.exists(reader.base_path())
  jax.tree.map(np.testing.assert_array_equal, (got_base, got_adapters), (base, adapters))

  model.save_pretrained(hf, _model_cfg(), jax.tree.map(lambda x: x * 1.01, base))
  with pytest.raises(ck.RestoreError) as e:
    reader.restore_lora()
  assert str(e.value).count(f"model.path {hf!r}") == 2 and "\n" not in str(e.value)


def test_a_lora_base_without_warm_up_is_read_in_param_dtype(tmp_path):
  """model.path's weights are read straight into model.param_dtype when they only become
  a frozen LoRA base (no float32 copy), and that base equals the float32 read cast down
  (the fingerprint a checkpoint records does not depend on the route)."""
  from rl_jax import checkpoint as ck
  from rl_jax import config as config_lib
  from rl_jax.model import hf_io
  from rl_jax.orchestration import build
  hf = str(tmp_path / "hf")
  base = jax.tree.map(np.asarray, model.init_params(_model_cfg(), jax.random.key(5)))
  model.save_pretrained(hf, _model_cfg(), base)
  cfg = config_lib.base_config()
  cfg.model.path, cfg.model.param_dtype = hf, "bfloat16"
  cfg.warmstart.steps = 0
  assert build.initial_weights_dtype(cfg) == "float32"  # full fine-tuning: master params
  cfg.model.lora.rank = RANK
  assert build.initial_weights_dtype(cfg) == "bfloat16"
  cfg.warmstart.steps = 5  # the warm-up trains the full model first
  assert build.initial_weights_dtype(cfg) == "float32"
  _, direct = hf_io.from_run_config(cfg.model, weights=True, weights_dtype="bfloat16")
  _, f32 = hf_io.from_run_config(cfg.model, weights=True)
  cast = jax.tree.map(lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16)), f32)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(direct))
  jax.tree.map(np.testing.assert_array_equal, direct, cast)
  assert ck.fingerprint(direct) == ck.fingerprint(cast)

"""rl_jax.checkpoint: round trips onto other shardings, retention, atomicity and fallback,
compatibility errors, and the export round trip (launch/export.py)."""
import dataclasses
import glob
import json
import os
import sys

import jax
import numpy as np
import pytest

from rl_jax import checkpoint as ck
from rl_jax import config as config_lib
from rl_jax import model as model_lib
from rl_jax import sharding
from rl_jax.trainer.train_step import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
import export  # noqa: E402  (launch/export.py)


def _run_cfg(**trainer_mesh):
  cfg = config_lib.base_config()
  cfg.checkpoint.keep = 2
  cfg.mesh.trainer.update(trainer_mesh)
  return cfg


def _trainer(cfg):
  model_cfg = ck.model_config(cfg)
  mesh = sharding.make_meshes(cfg.mesh).trainer
  return Trainer(model_cfg, cfg.trainer, mesh, total_steps=10), model_cfg


def _config_item(cfg, model_cfg):
  return {"run": cfg.to_dict(), "model": dataclasses.asdict(model_cfg)}


def _save(checkpointer, step, state, cfg, model_cfg, heldout=None):
  checkpointer.save(step, params=state.params, opt_state=state.opt_state, ref_params=None,
                    loop={"step": step}, config=_config_item(cfg, model_cfg), heldout=heldout,
                    wait=True)


def _restore(checkpointer, state, **kw):
  return checkpointer.restore(abstract_params=ck.abstract(state.params),
                              abstract_opt_state=ck.abstract(state.opt_state), **kw)


def _assert_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _corrupt(workdir, step):
  """Flips the second half of every array data file of one step."""
  files = [f for f in glob.glob(os.path.join(ck.directory(workdir), str(step), "params", "**"),
                                recursive=True)
           if os.path.isfile(f) and os.sep + "d" + os.sep in f]
  assert files
  for f in files:
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2:] = bytes(b ^ 0xFF for b in data[len(data) // 2:])
    open(f, "wb").write(bytes(data))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  """Steps 0..3 of a (fsdp=2, tensor=2) trainer, step 1 with the best held-out reward."""
  workdir = str(tmp_path_factory.mktemp("run"))
  cfg = _run_cfg(data=1, fsdp=2, tensor=2)
  cfg.checkpoint.keep_best = True
  trainer, model_cfg = _trainer(cfg)
  states = []
  checkpointer = ck.Checkpointer(workdir, cfg.checkpoint)
  for step in range(4):
    state = trainer.init_state(rng=jax.random.key(step))
    _save(checkpointer, step, state, cfg, model_cfg, heldout=[None, 0.9, None, 0.1][step])
    states.append(jax.device_get(state))
  checkpointer.close()
  return workdir, cfg, model_cfg, states


def test_round_trip_onto_other_shardings_and_retention(saved_run):
  workdir, _, _, states = saved_run
  # keep=2 newest (2, 3) plus keep_best (1, held-out 0.9 beats 0.1).
  assert ck.Checkpointer(workdir, read_only=True).steps() == [1, 2, 3]
  other = _run_cfg(data=4, fsdp=1, tensor=1)
  trainer, _ = _trainer(other)
  target = trainer.init_state(rng=jax.random.key(99))
  restored = _restore(ck.Checkpointer(workdir, other.checkpoint), target)
  assert restored.step == 3 and restored.skipped_steps == [] and restored.loop["step"] == 3
  _assert_same(restored.params, states[3].params)
  _assert_same(restored.opt_state, states[3].opt_state)
  for x, y in zip(jax.tree.leaves(restored.params), jax.tree.leaves(target.params)):
    assert x.sharding == y.sharding  # laid out as the restoring trainer asks


def _save_two_and_corrupt_the_newest(workdir, trainer, cfg, model_cfg):
  """Checkpoints 1 and 2 of distinct states in `workdir`, then step 2 damaged."""
  checkpointer = ck.Checkpointer(workdir, cfg.checkpoint)
  for step in (1, 2):
    _save(checkpointer, step, trainer.init_state(rng=jax.random.key(step)), cfg, model_cfg)
  checkpointer.close()
  _corrupt(workdir, 2)


def test_unreadable_or_unfinished_latest_falls_back_with_a_warning(tmp_path, saved_run):
  _, cfg, model_cfg, states = saved_run
  trainer, _ = _trainer(cfg)
  state = trainer.init_state(rng=jax.random.key(0))
  workdir = str(tmp_path)
  _save_two_and_corrupt_the_newest(workdir, trainer, cfg, model_cfg)
  # What a crash in the middle of a save leaves behind: never listed, never restored.
  os.makedirs(os.path.join(ck.directory(workdir), "3.orbax-checkpoint-tmp-1234", "params"))
  warnings = []
  checkpointer = ck.Checkpointer(workdir, cfg.checkpoint)
  assert checkpointer.steps() == [1, 2]
  restored = _restore(checkpointer, state, warn=warnings.append)
  assert restored.step == 1 and restored.skipped_steps == [2]
  assert len(warnings) == 1 and "checkpoints/2 cannot be restored" in warnings[0]
  assert "using step 1" in warnings[0]
  _assert_same(restored.params, jax.device_get(trainer.init_state(rng=jax.random.key(1)).params))
  _corrupt(workdir, 1)
  with pytest.raises(ck.RestoreError, match="no checkpoint in .* can be restored"):
    _restore(checkpointer, state, warn=warnings.append)


def test_fingerprint_mismatch_falls_back(tmp_path, saved_run):
  _, cfg, model_cfg, _ = saved_run
  trainer, _ = _trainer(cfg)
  state = trainer.init_state(rng=jax.random.key(0))
  workdir = str(tmp_path)
  checkpointer = ck.Checkpointer(workdir, cfg.checkpoint)
  for step in (1, 2):
    _save(checkpointer, step, state, cfg, model_cfg)
  checkpointer.close()
  # Arrays that read back fine but are not what was saved (e.g. a bit flip on disk).
  loop_file = os.path.join(ck.directory(workdir), "2", "loop", "metadata")
  loop = json.load(open(loop_file))
  loop["fingerprint"]["params"][0] += 1
  json.dump(loop, open(loop_file, "w"))
  warnings = []
  restored = _restore(ck.Checkpointer(workdir, cfg.checkpoint), state, warn=warnings.append)
  assert restored.step == 1
  assert "do not match the fingerprint" in warnings[0]


def test_incompatible_config_names_the_field():
  cfg = config_lib.base_config()
  model_cfg = ck.model_config(cfg)
  saved = {**_config_item(cfg, model_cfg), "has_ref_params": False}
  where = "checkpoint /w/checkpoints/5"
  other = config_lib.base_config()
  other.model.preset = "qwen2_0_5b"
  with pytest.raises(ck.RestoreError, match=r"vocab_size=128 .* builds vocab_size=151936"):
    ck.check_compatible(saved, other, ck.model_config(other), where=where)
  for field, value in (("seed", 1), ("task.digits", 3), ("data.shuffle", False)):
    other = config_lib.base_config()
    section, _, key = field.rpartition(".")
    (other[section] if section else other)[key] = value
    with pytest.raises(ck.RestoreError, match=f"written with {field}="):
      ck.check_compatible(saved, other, model_cfg, where=where)
  other = config_lib.base_config()
  other.rl.total_steps = 500
  other.task.heldout_size = 64
  assert ck.check_compatible(saved, other, model_cfg, where=where) == [
      "rl.total_steps: 100 -> 500", "task.heldout_size: 256 -> 64"]
  other.trainer.kl_beta = 0.1
  with pytest.raises(ck.RestoreError, match="trainer.kl_beta"):
    ck.check_compatible(saved, other, model_cfg, where=where)


def test_checkpoint_config_fields_are_validated():
  cfg = config_lib.base_config()
  cfg.checkpoint.grace_period_s = 0.0
  with pytest.raises(config_lib.ConfigError, match="checkpoint.grace_period_s"):
    ck.validate_config(cfg)


def test_export_round_trip(tmp_path, saved_run, capsys):
  workdir, _, model_cfg, states = saved_run
  out = str(tmp_path / "hf")
  export.main(["--workdir", workdir, "--out", out, "--step", "2"])
  assert f"exported step 2 of {workdir}" in capsys.readouterr().out
  loaded_cfg, params = model_lib.from_pretrained(out)
  assert loaded_cfg.replace(remat=model_cfg.remat) == model_cfg
  _assert_same(params, states[2].params)
  capsys.readouterr()
  assert export.main(["--workdir", workdir, "--out", out, "--step", "7"]) == 1
  assert "has no step 7" in capsys.readouterr().err
  assert export.main(["--workdir", str(tmp_path / "nothing"), "--out", out]) == 1
  assert "has no checkpoints" in capsys.readouterr().err


def test_corrupt_newest_step_is_replaced_when_saved_again(tmp_path, saved_run):
  """After falling back from a corrupt step 2, saving step 2 again writes it anew (it is
  not skipped because the step number exists) and it restores."""
  _, cfg, model_cfg, _ = saved_run
  trainer, _ = _trainer(cfg)
  workdir = str(tmp_path)
  _save_two_and_corrupt_the_newest(workdir, trainer, cfg, model_cfg)
  checkpointer = ck.Checkpointer(workdir, cfg.checkpoint)
  state = trainer.init_state(rng=jax.random.key(7))
  assert _restore(checkpointer, state, warn=lambda _: None).step == 1
  assert checkpointer.saved(1) and not checkpointer.saved(2) and not checkpointer.saved(3)
  _save(checkpointer, 2, state, cfg, model_cfg)
  assert checkpointer.last_committed_step() == 2 and checkpointer.saved(2)
  checkpointer.close()
  restored = _restore(ck.Checkpointer(workdir, cfg.checkpoint), state, warn=pytest.fail)
  assert restored.step == 2
  _assert_same(restored.params, jax.device_get(state.params))
  # A step that restored fine is still never overwritten.
  checkpointer = ck.Checkpointer(workdir, cfg.checkpoint)
  assert not checkpointer.save(2, params=state.params, opt_state=state.opt_state,
                               ref_params=None, loop={}, config=_config_item(cfg, model_cfg))
  checkpointer.close()


def _fail_commit(monkeypatch, error):
  """Makes orbax's final rename of a step (its commit) raise `error`."""
  atomicity = pytest.importorskip("orbax.checkpoint._src.path.atomicity")
  cls = getattr(atomicity, "AtomicRenameTemporaryPath", None)
  if cls is None or not hasattr(cls, "finalize"):
    pytest.skip("this orbax has no AtomicRenameTemporaryPath.finalize to inject a fault into")

  async def finalize(self, *args, **kwargs):
    raise error
  monkeypatch.setattr(cls, "finalize", finalize)


@pytest.mark.parametrize("async_save", [True, False])
def test_disk_full_is_one_line_naming_the_last_good_step(tmp_path, saved_run, monkeypatch,
                                                         capfd, async_save):
  import errno
  _, cfg, model_cfg, _ = saved_run
  cfg = config_lib.base_config().copy_and_resolve_references()
  cfg.checkpoint.async_save = async_save
  trainer, _ = _trainer(_run_cfg(data=1, fsdp=2, tensor=2))
  state = trainer.init_state(rng=jax.random.key(0))
  checkpointer = ck.Checkpointer(str(tmp_path), cfg.checkpoint)
  _save(checkpointer, 1, state, cfg, model_cfg)
  assert checkpointer.last_committed_step() == 1
  _fail_commit(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
  with pytest.raises(ck.SaveError) as e:
    checkpointer.save(2, params=state.params, opt_state=state.opt_state, ref_params=None,
                      loop={"step": 2}, config=_config_item(cfg, model_cfg))
    checkpointer.wait()  # an async write fails in the background: reported here
  msg = str(e.value)
  assert "\n" not in msg
  assert "step 2" in msg and "No space left on device" in msg, msg
  assert msg.endswith(f"the newest complete checkpoint is {checkpointer.where(1)}"), msg
  assert checkpointer.last_committed_step() == 1
  monkeypatch.undo()
  checkpointer.close()
  assert "Traceback" not in capfd.readouterr().err
  assert ck.Checkpointer(str(tmp_path), read_only=True).steps() == [1]


def test_last_committed_step_counts_only_finished_writes(tmp_path, saved_run, monkeypatch):
  _, cfg, model_cfg, _ = saved_run
  trainer, _ = _trainer(cfg)
  state = trainer.init_state(rng=jax.random.key(0))
  checkpointer = ck.Checkpointer(str(tmp_path), cfg.checkpoint)
  assert checkpointer.last_committed_step() is None
  monkeypatch.setattr(checkpointer, "_saving", lambda: True)  # a write still running
  checkpointer.save(3, params=state.params, opt_state=state.opt_state, ref_params=None,
                    loop={"step": 3}, config=_config_item(cfg, model_cfg))
  assert checkpointer.last_committed_step() is None
  checkpointer.wait()
  assert checkpointer.last_committed_step() == 3
  checkpointer.close()


def test_an_earlier_runs_unfinished_writes_are_gone_before_the_base_is_written(
    tmp_path, monkeypatch):
  # orbax removes *.orbax-checkpoint-tmp-* in a background thread; made slow here (as on a
  # loaded machine), it would remove the LoRA base's write, begun beside the steps, under
  # it. The Checkpointer waits for it, so the leftover is gone once it exists.
  from orbax.checkpoint import checkpoint_manager as cm
  real = cm.temporary_paths.cleanup_temporary_paths

  async def slow_cleanup(*args, **kw):
    import asyncio
    await asyncio.sleep(1.5)
    return await real(*args, **kw)

  monkeypatch.setattr(cm.temporary_paths, "cleanup_temporary_paths", slow_cleanup)
  workdir = str(tmp_path)
  leftover = os.path.join(ck.directory(workdir), "3.orbax-checkpoint-tmp-1234", "params")
  os.makedirs(leftover)
  checkpointer = ck.Checkpointer(workdir, _run_cfg().checkpoint)
  assert not os.path.exists(os.path.dirname(leftover))
  base = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float16)}
  checkpointer.save_base(base)
  _assert_same(checkpointer.restore_base(), base)
  checkpointer.close()

"""Run checkpoints: everything a run needs to continue, saved with orbax.

Layout: `<workdir>/checkpoints/<step>/` with one orbax item each for
  params, opt_state  trainer master params and optax state (arrays, trainer shardings;
                     restored onto whatever shardings the restoring run asks for)
  ref_params         the KL reference policy, only when trainer.kl_beta > 0
  loop               JSON: the orchestration state (policy version, train-state counters,
                     prompt iterator state, group-id and verifier-call cursors, counters
                     behind summary.json, held-out curve) plus `fingerprint` (below)
  config             JSON: {"run": the run config, "model": the ModelConfig fields}
`step` is the number of optimizer steps (Trainer.step calls) the params have taken; step 0
is the state right after the supervised warm-up.

LoRA runs (model.lora.rank > 0): `params` and `opt_state` are the adapters and their
optimizer state, and the config item's `lora_base` names the frozen base (`source`,
`made_by_run`) with its fingerprint; no step holds a copy of the base. A base that
model.path supplies is read from there again; a base the run made (a random init and/or
the supervised warm-up) is written once, before the first step, to
`<workdir>/checkpoints/base` (orbax ignores the name: it is not a step). A resume, an
export and `restore_params` (which merges W0 + (alpha / r) A B) refuse a base whose
fingerprint differs from the recorded one.

Retention: the newest `checkpoint.keep` steps, plus with `checkpoint.keep_best` the step
with the highest held-out reward among steps saved together with one.

Atomicity: orbax writes a step under a temporary name and renames it (object stores:
writes commit_success.txt) once every item is complete, so a step that never finished is
invisible here and removed at the next start. Restore also recomputes

  fingerprint(x) = sum over elements of x's bit pattern as an unsigned integer, mod 2**32

for every array leaf and compares it with the value recorded at save time. A step that
cannot be read or does not match is skipped with a warning in favour of the next older one,
and is deleted and written again when the run saves that step number again.

Commit tracking: `last_committed_step()` is the newest step whose write has finished (a
background save counts once orbax has renamed it into place), never one merely started.
A write that fails (disk full, permissions) raises SaveError at the call that finds out
(the next save, wait or close): one line naming the failed step and the newest complete
one; orbax's own tracebacks of the failure are not printed.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from rl_jax import config as config_lib
from rl_jax.errors import UserError

ARRAY_ITEMS = ("params", "opt_state", "ref_params")
BASE_DIR = "base"  # a LoRA run's base, when the run made it (module docstring)
# Config fields a resumed run must share with its checkpoint: config.resume_must_match.
_MODEL_MAY_DIFFER = ("remat", "attention")


class RestoreError(UserError, RuntimeError):
  """A checkpoint that cannot be used: one sentence naming the step, file or field."""


class SaveError(UserError, RuntimeError):
  """A checkpoint could not be written (disk full, permissions, ...): one sentence naming
  the step that failed and the newest step that is complete on disk."""


def directory(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def validate_config(cfg) -> None:
  """ConfigError naming the first bad `checkpoint` field."""
  c = cfg.checkpoint
  for name, ok, rule in (("every", c.every >= 0, ">= 0 (0 = off)"), ("keep", c.keep >= 1, ">= 1"),
                         ("grace_period_s", c.grace_period_s > 0, "> 0")):
    if not ok:
      raise config_lib.ConfigError(
          f"config field 'checkpoint.{name}' must be {rule}; got {c[name]}")


def model_config(cfg):
  """The ModelConfig a run of `cfg` builds, without loading any weights."""
  from rl_jax import model as model_lib
  return model_lib.from_run_config(cfg.model)[0]


def model_config_from_dict(fields: dict):
  """ModelConfig from the `model` entry of a checkpoint's config item."""
  from rl_jax.model import ModelConfig
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  fields = {k: v for k, v in fields.items() if k in known}  # fields removed since the save
  if fields.get("rope_scaling") is not None:
    fields["rope_scaling"] = dict(fields["rope_scaling"])
  return ModelConfig(**fields)


def run_config_from_dict(saved: dict):
  """The run ConfigDict from the `run` entry of a checkpoint's config item (JSON turns
  tuples into lists; the base tree's types are restored, fields it lacks keep defaults)."""
  cfg = config_lib.base_config()

  def fill(node, values):
    for key, value in values.items():
      if key not in node:
        continue  # a field this version of rl_jax no longer has
      if hasattr(node[key], "keys"):
        fill(node[key], value)
      else:
        with node.ignore_type():
          node[key] = tuple(value) if isinstance(node[key], tuple) else value

  fill(cfg, saved)
  return cfg


def check_compatible(saved: dict, cfg, model_cfg, *, where: str) -> list[str]:
  """Raises RestoreError naming the first field that makes `saved` (a checkpoint's config
  item) unusable for `cfg`; returns "field: old -> new" for fields that changed harmlessly."""
  ours = dataclasses.asdict(model_cfg)
  source = (f"model.path {cfg.model.path!r}" if cfg.model.path
            else f"model.preset {cfg.model.preset!r}")
  for key, old in saved["model"].items():
    new = ours.get(key)
    if key in ours and key not in _MODEL_MAY_DIFFER and _canonical(old) != _canonical(new):
      raise RestoreError(
          f"{where} holds a model with {key}={old!r} but this config ({source}) builds "
          f"{key}={new!r}; resume with the checkpoint's model or use a new --workdir")
  old_run, new_run = config_lib.flatten(saved["run"]), config_lib.flatten(cfg.to_dict())
  changed = []
  # A field only one side has was added or removed by a code change in between; its
  # value then was the behaviour of the code then, so only shared fields are compared.
  for key in sorted(set(old_run) & set(new_run)):
    old, new = old_run.get(key), new_run.get(key)
    if _canonical(old) == _canonical(new):
      continue
    if config_lib.resume_must_match(key):
      raise RestoreError(
          f"{where} was written with {key}={old!r} but this config has {key}={new!r}; "
          "the saved state only continues a run with the same value (or use a new --workdir)")
    changed.append(f"{key}: {old!r} -> {new!r}")
  # A LoRA run's reference is its base, which no step holds.
  if (cfg.trainer.kl_beta > 0 and not model_cfg.lora_rank
      and not saved.get("has_ref_params", False)):
    raise RestoreError(
        f"{where} was written with trainer.kl_beta=0 and holds no reference policy, but this "
        f"config has trainer.kl_beta={cfg.trainer.kl_beta}; use a new --workdir")
  return changed


def check_workdir(cfg, workdir: str) -> None:
  """RestoreError naming the field when the newest checkpoint in `workdir` cannot continue
  a run of `cfg`; reads only JSON, so it runs before anything is built or compiled."""
  if not os.path.isdir(directory(workdir)):
    return
  ck = Checkpointer(workdir, read_only=True)
  try:
    step = ck.latest_step()
    if step is None:
      return
    try:
      saved = ck.read_json(step, "config")
      model_cfg = model_config(cfg)
    except Exception:  # noqa: BLE001  (the full restore reports these, or falls back)
      return
    check_compatible(saved, cfg, model_cfg, where=ck.where(step))
  finally:
    ck.close()


def _canonical(v):
  return json.loads(json.dumps(v, default=list))


def _leaf_fingerprint(x):
  bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
  return jnp.sum(jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32), dtype=jnp.uint32)


# One call per leaf: leaves may live on different device sets (optax counters sit on one
# device in some layouts), and each scalar result stays with its leaf.
_device_fingerprint = jax.jit(_leaf_fingerprint)


def fingerprint(tree) -> list[int]:
  """Per-leaf fingerprints (module docstring) of a tree of jax or numpy arrays."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return []
  if all(isinstance(x, np.ndarray) for x in leaves):
    out = []
    for x in leaves:
      u = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])
      out.append(int(u.sum(dtype=np.uint64) % 2**32))
    return out
  return [int(v) for v in jax.device_get([_device_fingerprint(x) for x in leaves])]


def base_mismatch(saved: dict, ours: list[int], source: str, *, where: str) -> str | None:
  """One line when a LoRA checkpoint's recorded base (`saved`: its lora_base record)
  is not the base at hand (fingerprint `ours`, read from `source`); None if it is."""
  if ours == saved["fingerprint"]:
    return None
  digest = lambda fp: f"{sum(fp) % 2**32:08x}"
  return (f"{where} holds LoRA adapters trained on the base from {saved['source']} "
          f"(fingerprint {digest(saved['fingerprint'])}), but the base from {source} has "
          f"fingerprint {digest(ours)}; resume with the checkpoint's base or use a new --workdir")


def _host_target(meta_tree):
  """ShapeDtypeStructs on this host's CPU for an orbax metadata tree."""
  cpu = jax.local_devices(backend="cpu")[0]
  return jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype,
                                     sharding=jax.sharding.SingleDeviceSharding(cpu)),
      meta_tree, is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))


def abstract(tree, dtype=None):
  """ShapeDtypeStructs (with shardings) describing `tree`, optionally with another dtype."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=x.sharding), tree)


@dataclasses.dataclass
class Restored:
  step: int
  params: Any
  opt_state: Any
  ref_params: Any  # None when the checkpoint holds none
  loop: dict
  config: dict
  skipped_steps: list  # newer steps that could not be restored, newest first


class Checkpointer:
  """Saves and restores run checkpoints in `<workdir>/checkpoints` (module docstring)."""

  def __init__(self, workdir: str, ckpt_cfg=None, *, read_only: bool = False):
    self.directory = directory(workdir)
    if read_only and not os.path.isdir(self.directory):
      raise RestoreError(f"{workdir} has no checkpoints (no {self.directory} directory)")
    if read_only:
      # orbax's own read_only mode only adds warnings; a manager that never saves or
      # cleans up changes nothing on disk either.
      options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
    else:
      policies = [ocp.checkpoint_managers.LatestN(n=int(ckpt_cfg.keep))]
      if ckpt_cfg.keep_best:
        policies.append(ocp.checkpoint_managers.BestN(
            get_metric_fn=lambda m: m["reward/heldout"], n=1,
            keep_checkpoints_without_metrics=False))
      options = ocp.CheckpointManagerOptions(
          enable_async_checkpointing=bool(ckpt_cfg.async_save), cleanup_tmp_directories=True,
          preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies))
    handlers = {name: ocp.StandardCheckpointHandler() for name in ARRAY_ITEMS}
    handlers.update(loop=ocp.JsonCheckpointHandler(), config=ocp.JsonCheckpointHandler())
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_handlers=handlers)
    # orbax removes an earlier run's unfinished writes (*.orbax-checkpoint-tmp-*) in a
    # background thread and only waits for it before its own saves; a write begun first
    # (the LoRA base's, made beside the steps) could be deleted under it. Wait here.
    await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:
      await_cleanup()
    _quiet_failed_saves()
    # Commit tracking (module docstring): the newest step known complete on disk, the step
    # whose background write may still be running, and steps a restore found unusable.
    steps = self.steps()
    self._committed: int | None = steps[-1] if steps else None
    self._pending: int | None = None
    self._unusable: set[int] = set()

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def where(self, step: int) -> str:
    return f"checkpoint {os.path.join(self.directory, str(step))}"

  def last_committed_step(self) -> int | None:
    """The newest step whose write has completed (not merely started); None if none."""
    if self._pending is not None and not self._saving():
      self._promote()
    return self._committed

  def _saving(self) -> bool:
    in_progress = getattr(self._manager, "is_saving_in_progress", None)
    return bool(in_progress()) if in_progress is not None else True

  def _promote(self) -> None:
    """Records the pending step as committed if it is on disk (its write has ended)."""
    # orbax renames a step's temporary directory to its number when the write is complete.
    if self._pending is not None and os.path.isdir(os.path.join(self.directory,
                                                                str(self._pending))):
      self._committed = self._pending if self._committed is None else max(
          self._committed, self._pending)
    self._pending = None

  def _failed(self, step: int, e: BaseException) -> SaveError:
    self._pending = None
    last = self._committed
    good = (f"the newest complete checkpoint is {self.where(last)}" if last is not None
            else "no checkpoint has been completed")
    return SaveError(f"writing checkpoint step {step} to {self.directory} failed "
                     f"({_reason(e)}); {good}")

  def _guarded(self, action: Callable[[], Any], step: int):
    """Runs a manager call that may surface a failed write: the pending step's (finished
    by the call) or else `step`'s, as one SaveError."""
    try:
      return action()
    except Exception as e:  # noqa: BLE001  (whatever the storage layer raises)
      raise self._failed(self._pending if self._pending is not None else step, e) from e

  def save(self, step: int, *, params, opt_state, ref_params, loop: dict, config: dict,
           heldout: float | None = None, wait: bool = False) -> bool:
    """Starts saving `step` (finished in the background unless `wait` or async_save is
    off); False if that step already exists and is not one a restore found unusable
    (that one is replaced). The arrays are copied off the device before this returns, so
    the caller may donate them right after. SaveError when this or the previous
    background write fails."""
    if self.saved(step):
      return False
    if step in self._manager.all_steps():  # one a restore found unusable
      self._manager.delete(step)
      self._unusable.discard(step)
    arrays = {"params": params, "opt_state": opt_state}
    if ref_params is not None:
      arrays["ref_params"] = ref_params
    # A JSON round trip copies the state now (the write may happen later, in the
    # background) and rejects anything JSON cannot hold here rather than there.
    loop = json.loads(json.dumps(dict(loop, fingerprint={
        k: fingerprint(v) for k, v in arrays.items()})))
    config = json.loads(json.dumps(config))
    config = dict(config, has_ref_params=ref_params is not None)
    items = {k: ocp.args.StandardSave(v) for k, v in arrays.items()}
    items["loop"] = ocp.args.JsonSave(loop)
    items["config"] = ocp.args.JsonSave(config)
    metrics = None if heldout is None else {"reward/heldout": float(heldout)}
    self._guarded(lambda: self._manager.save(step, args=ocp.args.Composite(**items),
                                             metrics=metrics, force=True), step)
    self._pending = step
    if wait or not self._saving():
      self._guarded(self._manager.wait_until_finished, step)
      self._promote()
    return True

  def saved(self, step: int) -> bool:
    """Whether `step` is saved and usable, once the write in flight has finished
    (SaveError when that write failed)."""
    self._guarded(self._manager.wait_until_finished, step)
    self._promote()
    return step in self._manager.all_steps() and step not in self._unusable

  def read_json(self, step: int, item: str) -> dict:
    """One JSON item (`loop` or `config`) of a step."""
    out = self._manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
    return out[item]

  def _candidates(self, step: int | None) -> list[int]:
    steps = self.steps()
    if step is not None:
      if step not in steps:
        raise RestoreError(f"{self.directory} has no step {step}; it has steps {steps}")
      return [step]
    if not steps:
      raise RestoreError(f"{self.directory} holds no complete checkpoint")
    return steps[::-1]

  def restore(self, *, abstract_params, abstract_opt_state, abstract_ref=None,
              step: int | None = None, check: Callable[[dict, str], None] | None = None,
              warn: Callable[[str], None] = print) -> Restored:
    """The newest step (or `step`) that reads back with matching fingerprints, onto the
    shapes, dtypes and shardings of the abstract trees. `check(config_item, where)` runs
    before a step's arrays are read and may raise RestoreError (no fallback then)."""
    failures = []
    for s in self._candidates(step):
      where = self.where(s)
      try:
        config = self.read_json(s, "config")
      except Exception as e:  # noqa: BLE001  (any read failure means: try the older step)
        failures.append((s, _reason(e)))
        continue
      if check is not None:
        check(config, where)
      targets = {"params": abstract_params, "opt_state": abstract_opt_state}
      if abstract_ref is not None:
        targets["ref_params"] = abstract_ref
      try:
        items = {k: ocp.args.StandardRestore(v) for k, v in targets.items()}
        out = self._manager.restore(s, args=ocp.args.Composite(
            loop=ocp.args.JsonRestore(), **items))
        loop = out["loop"]
        for name in targets:
          if fingerprint(out[name]) != loop["fingerprint"][name]:
            raise RestoreError(f"the {name} arrays do not match the fingerprint saved with them")
      except Exception as e:  # noqa: BLE001
        _quiet_failed_reads()
        failures.append((s, _reason(e)))
        continue
      for bad, reason in failures:
        warn(f"warning: {self.where(bad)} cannot be restored ({reason}); "
             f"using step {s} instead")
      self._unusable.update(b for b, _ in failures)  # replaced when saved again
      return Restored(step=s, params=out["params"], opt_state=out["opt_state"],
                      ref_params=out.get("ref_params"), loop=loop, config=config,
                      skipped_steps=[b for b, _ in failures])
    detail = "; ".join(f"step {s}: {r}" for s, r in failures)
    raise RestoreError(f"no checkpoint in {self.directory} can be restored ({detail})")

  def restore_params(self, step: int | None = None) -> tuple[int, Any, dict]:
    """(step, params as host numpy arrays, config item) of the newest readable step (or
    `step`), e.g. for export; needs no trainer mesh. A LoRA run's params are merged:
    W0 + (alpha / r) A B in W0's dtype (model.param_dtype)."""
    s, params, config = self._restore_host_params(step)
    if not config["model"].get("lora_rank"):
      return s, params, config
    s, model_cfg, base, adapters, config = self.restore_lora(s)
    from rl_jax.model import lora
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
      merged = lora.merge_params(model_cfg, base, adapters)
    return s, jax.tree.map(np.asarray, merged), config

  def restore_lora(self, step: int | None = None) -> tuple[int, Any, Any, Any, dict]:
    """(step, ModelConfig, base params, adapters, config item) of a LoRA run's newest
    readable step (or `step`) as host numpy arrays; the base from <checkpoints>/base or
    model.path (module docstring), checked against the step's recorded fingerprint."""
    s, adapters, config = self._restore_host_params(step)
    model_cfg = model_config_from_dict(config["model"])
    if not model_cfg.lora_rank:
      raise RestoreError(f"{self.where(s)} is not a LoRA run's (model.lora.rank = 0)")
    record = config["lora_base"]
    if record["made_by_run"]:
      base, source = self.restore_base(), self.base_path()
    else:
      from rl_jax.model import hf_io
      run = run_config_from_dict(config["run"])
      _, base = hf_io.from_run_config(run.model, weights=True,
                                      weights_dtype=model_cfg.param_dtype)
      source = f"model.path {run.model.path!r}"
    error = base_mismatch(record, fingerprint(base), source, where=self.where(s))
    if error:
      raise RestoreError(error)
    return s, model_cfg, base, adapters, config

  def base_path(self) -> str:
    return os.path.join(self.directory, BASE_DIR)

  def save_base(self, base_params) -> None:
    """Writes a LoRA run's base to <checkpoints>/base, replacing any there (a fresh
    run's; orbax renames it into place when complete; every process takes part, as in
    `save`). SaveError if the write fails."""
    try:
      with ocp.StandardCheckpointer() as c:
        c.save(self.base_path(), base_params, force=True)
        c.wait_until_finished()
    except Exception as e:  # noqa: BLE001  (whatever the storage layer raises)
      raise SaveError(f"writing the LoRA base to {self.base_path()} failed ({_reason(e)})") from e

  def restore_base(self, abstract_base=None):
    """<checkpoints>/base onto `abstract_base`'s shapes, dtypes and shardings (default:
    host numpy arrays); RestoreError when it is missing or unreadable."""
    try:
      with ocp.StandardCheckpointer() as c:
        if abstract_base is None:
          meta = c.metadata(self.base_path())
          tree = getattr(meta, "item_metadata", meta)
          return jax.tree.map(np.asarray, c.restore(
              self.base_path(), _host_target(getattr(tree, "tree", tree))))
        return c.restore(self.base_path(), abstract_base)
    except Exception as e:  # noqa: BLE001
      raise RestoreError(f"the LoRA base in {self.base_path()} cannot be read "
                         f"({_reason(e)})") from e

  def _restore_host_params(self, step: int | None) -> tuple[int, Any, dict]:
    """(step, the params item as host numpy arrays, config item): the newest readable
    step (or `step`)."""
    failures = []
    for s in self._candidates(step):
      try:
        config = self.read_json(s, "config")
        meta = self._manager.item_metadata(s)["params"]
        target = _host_target(getattr(meta, "tree", meta))
        out = self._manager.restore(s, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target), loop=ocp.args.JsonRestore()))
        params = jax.tree.map(np.asarray, out["params"])
        if fingerprint(params) != out["loop"]["fingerprint"]["params"]:
          raise RestoreError("the params arrays do not match the fingerprint saved with them")
      except Exception as e:  # noqa: BLE001
        _quiet_failed_reads()
        failures.append((s, _reason(e)))
        continue
      for bad, reason in failures:
        print(f"warning: {self.where(bad)} cannot be restored ({reason}); using step {s}",
              file=sys.stderr)
      return s, params, config
    detail = "; ".join(f"step {s}: {r}" for s, r in failures)
    raise RestoreError(f"no checkpoint in {self.directory} can be restored ({detail})")

  def wait(self) -> None:
    """Blocks until background saves are on disk; SaveError if one failed."""
    if self._pending is not None:
      self._guarded(self._manager.wait_until_finished, self._pending)
    self._promote()

  def close(self) -> None:
    """Finishes background saves (SaveError if one failed) and releases the manager."""
    try:
      self.wait()
    finally:
      try:
        self._manager.close()
      except Exception:  # noqa: BLE001  (the failed write was reported by wait)
        pass


def _quiet_failed_reads() -> None:
  """Silences the echoes of a failed read, which the caller reports in one line.

  When one tensorstore read fails, orbax abandons the step and closes its event loop;
  the sibling reads then finish into the closed loop, each raising "Event loop is
  closed" inside a tensorstore callback (printed as an unraisable exception), and
  asyncio logs every unretrieved future with a multi-kilobyte spec.
  """
  logging.getLogger("asyncio").setLevel(logging.CRITICAL)
  if getattr(sys.unraisablehook, "_rl_jax_filter", False):
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    e = unraisable.exc_value
    if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
      previous(unraisable)
  hook._rl_jax_filter = True  # installed once per process
  sys.unraisablehook = hook


class _DropSaveTracebacks(logging.Filter):
  """Drops orbax's own tracebacks of a failed write (hundreds of lines per failure);
  Checkpointer reports the failure as one SaveError line."""

  def filter(self, record):
    return not (record.exc_info and "orbax" in (record.pathname or ""))


def _quiet_failed_saves() -> None:
  for name in ("absl", "orbax"):
    logger = logging.getLogger(name)
    if not any(isinstance(f, _DropSaveTracebacks) for f in logger.filters):
      logger.addFilter(_DropSaveTracebacks())


def _reason(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}"[:300]

"""Checkpoints of a run, and how a run that stops early leaves its state.

A checkpoint (checkpoint.every > 0, rl_jax.checkpoint) holds the trainer state and the
loop state at a cut in the stream of groups: every group id below `next_group_id` is
settled (trained, discarded as stale, or lost). Sync mode cuts before the first group not
yet trained, so a resumed run admits those groups again with the same ids, prompts and
seeds and, batches being ordered by group id, repeats the uninterrupted run bit for bit.
(Groups dropped for verifier errors or filtered for zero reward variance in the window
are dropped or filtered again, and not counted twice.) Async mode cuts at the last
admission: the verified groups then queued are saved with the checkpoint (host-side
rollouts, their token versions kept) and queued again on resume, so their staleness is
counted and bounded as usual; only the groups still being generated or verified are lost
(counted in summary.json, never repeated).

LoRA: a checkpoint holds the adapters, their optimizer state and the base's fingerprint
(rl_jax/checkpoint.py); a base the run made is written once, with the first checkpoint,
to <workdir>/checkpoints/base and read back on resume, and a resume whose base differs
from the recorded one stops with one line naming both.

Faults: SIGTERM saves at the next step boundary and raises Preempted (past
checkpoint.grace_period_s the process exits with status 143 without waiting for the
save; with checkpointing off it stops at once, there being nothing to save); a failure
in any thread stops every thread, saves when the trainer state is consistent, and raises
RunError with one line (an unexpected exception's traceback goes to <workdir>/error.log).
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np

from rl_jax import cli
from rl_jax import config as config_lib
from rl_jax import metrics as metrics_lib
from rl_jax.errors import UserError
from rl_jax.orchestration.errors import Preempted, RunError
from rl_jax.types import Group, Rollout


def pack_groups(groups: list[Group], partial: dict[int, dict] | None = None) -> dict:
  """Groups as JSON: per-rollout fields (rewards where verified, "pending" where not),
  and the token arrays concatenated in one compressed npz (base64), so a checkpoint's
  loop item can carry them; with `partial` (group id -> {sample index: (tokens,
  logprobs, versions)}) also the samples decoded partway."""
  rows = [r for g in groups for r in g.rollouts]
  arrays = {}

  def put(name, dtype, parts):
    parts = [np.asarray(x, dtype) for x in parts]
    arrays[name] = np.concatenate(parts) if parts else np.zeros(0, dtype)
    arrays[name + "_len"] = np.asarray([len(x) for x in parts], np.int64)

  for name, dtype in _ROLLOUT_ARRAYS:
    # A single-turn rollout's model_mask (None) is stored as all True.
    put(name, dtype, [r.model_token_mask if name == "model_mask" else getattr(r, name)
                      for r in rows])
  put("group_prompt", np.int32, [g.prompt_tokens for g in groups])
  seqs = [(g.group_id, i, v) for g in groups
          for i, v in sorted((partial or {}).get(g.group_id, {}).items())]
  for k, (name, dtype) in enumerate(_PARTIAL_ARRAYS):
    put(name, dtype, [v[k] for _, _, v in seqs])
  buf = io.BytesIO()
  np.savez_compressed(buf, **arrays)
  meta = [{"group_id": g.group_id, "index": g.index, "admitted": g.admitted,
           "rollouts": [_rollout_fields(r) for r in g.rollouts],
           "partial": [i for gid, i, _ in seqs if gid == g.group_id]}
          for g in groups]
  return {"groups": meta, "arrays": base64.b64encode(buf.getvalue()).decode("ascii")}


def _rollout_fields(r: Rollout) -> dict:
  out = {f: getattr(r, f) for f in _ROLLOUT_FIELDS}
  out["multi_turn"] = r.model_mask is not None
  out["reward"] = float(r.reward)
  out["reward_info"] = {k: float(v) for k, v in r.reward_info.items()}
  return out


def unpack_groups(packed: dict | None, task) -> list[Group]:
  """pack_groups' groups again (rollouts in their saved order, examples from `task`)."""
  return unpack(packed, task)[0]


def unpack(packed: dict | None, task) -> tuple[list[Group], dict[int, dict]]:
  """pack_groups' groups and partial samples again."""
  if not packed or not packed["groups"]:
    return [], {}
  data = np.load(io.BytesIO(base64.b64decode(packed["arrays"])))

  def split(name):
    return np.split(data[name], np.cumsum(data[name + "_len"])[:-1])

  # Checkpoints written before multi-turn rollouts have no model_mask, before rollouts
  # in flight were kept no group prompts or partial samples.
  splits = {name: split(name) for name, _ in _ROLLOUT_ARRAYS if name in data}
  prompts = split("group_prompt") if "group_prompt" in data else None
  seqs = iter(zip(*(split(name) for name, _ in _PARTIAL_ARRAYS))) if (
      "partial_tokens" in data) else iter(())
  partial: dict[int, dict] = {}
  groups, row = [], 0
  for g in packed["groups"]:
    rollouts = []
    for fields in g["rollouts"]:
      fields = dict(fields)
      multi_turn = fields.pop("multi_turn", False)
      arrays = {name: split[row] for name, split in splits.items()}
      if not multi_turn:
        arrays["model_mask"] = None
      rollouts.append(Rollout(group_id=g["group_id"], **arrays, **fields))
      row += 1
    prompt = prompts[len(groups)] if prompts is not None else rollouts[0].prompt_tokens
    groups.append(Group(group_id=g["group_id"], example=task.example(g["index"]),
                        prompt_tokens=prompt, rollouts=rollouts,
                        admitted=g["admitted"], index=g["index"]))
    for i in g.get("partial", []):
      tokens, logprobs, versions = next(seqs)
      partial.setdefault(g["group_id"], {})[int(i)] = (tokens, logprobs, versions)
  return groups, partial


_ROLLOUT_ARRAYS = (("prompt_tokens", np.int32), ("completion_tokens", np.int32),
                   ("behavior_logprobs", np.float32), ("token_versions", np.int32),
                   ("model_mask", bool))
_PARTIAL_ARRAYS = (("partial_tokens", np.int32), ("partial_logprobs", np.float32),
                   ("partial_versions", np.int32))
_ROLLOUT_FIELDS = ("sample_index", "finish_reason", "reward", "verifier_status", "reward_info",
                   "completion_text", "admitted", "first_token", "finished", "verified",
                   "enqueued", "num_turns")


def _warn(text: str) -> None:
  print(text, file=sys.stderr, flush=True)


class RunCheckpoints:
  """Saves and restores a Pipeline (rl_jax/orchestration/loop.py) at the cut."""

  def __init__(self, pipeline):
    self.p = pipeline
    self.checkpointer = None
    self._base: dict | None = None  # a LoRA run's base record, once saved or restored
    if pipeline.cfg.checkpoint.every > 0:
      from rl_jax import checkpoint as checkpoint_lib
      self.checkpointer = checkpoint_lib.Checkpointer(pipeline.workdir, pipeline.cfg.checkpoint)

  def save(self, step: int, *, heldout: float | None = None, wait: bool = False) -> bool:
    """Checkpoints the state after `step` optimizer steps; False when checkpointing is
    off, RL has not started, or the step exists. Arrays are copied before it returns;
    the write finishes in the background unless `wait`."""
    p = self.p
    if self.checkpointer is None or p.curve is None:
      return False
    t0 = time.perf_counter()
    with p.schedule.event("save", step=step, heldout=heldout, wait=wait):
      # A step already saved (the exit path after this step's save) is not cut again.
      saved = not self.checkpointer.saved(step) and self._write(step, heldout, wait)
    p.acc.checkpoint_blocking_s += time.perf_counter() - t0
    return saved

  def _write(self, step: int, heldout: float | None, wait: bool) -> bool:
    """save()'s body: the config and loop items, the cut and the arrays."""
    p = self.p
    config = {"run": p.cfg.to_dict(), "model": dataclasses.asdict(p.model_cfg)}
    if p.trainer.lora:
      config["lora_base"] = self._base_record()
    # Async: the sampler thread waits between two steps while the cut is taken, so the
    # sequences being decoded are read at one moment (the call on the device included).
    # Not across processes: the followers' samplers replay the leader's steps (a paused
    # leader could wait on a step its followers have not run); no partial is read there.
    from rl_jax.orchestration import multihost
    pause = not p.policy.sync and not multihost.multi_process()
    with (p.worker.paused() if pause else contextlib.nullcontext()):
      loop = self.loop_state(step)
    return self.checkpointer.save(
        step, params=p.state.params, opt_state=p.state.opt_state,
        # () when there is none: kl_beta = 0, or LoRA (the reference is the base).
        ref_params=p.trainer.ref_params or None,
        loop=loop, heldout=heldout, wait=wait, config=config)

  def _base_record(self) -> dict:
    """The LoRA base's source and fingerprint (computed once); a base the run made
    (random init, supervised warm-up) is written to <checkpoints>/base first."""
    if self._base is None:
      from rl_jax import checkpoint as checkpoint_lib
      p = self.p
      made = bool(p.cfg.warmstart.steps > 0 or not p.cfg.model.path)
      if made:
        self.checkpointer.save_base(p.trainer.base_params)
      self._base = {
          "source": self.checkpointer.base_path() if made else f"model.path {p.cfg.model.path!r}",
          "made_by_run": made,
          "fingerprint": checkpoint_lib.fingerprint(p.trainer.base_params)}
    return self._base

  def _restore_base(self, record: dict, where: str) -> None:
    """Puts the base a LoRA checkpoint was trained on into the trainer (read from
    <checkpoints>/base when the run made it; model.path's is loaded already) and
    refuses another base (RunError, one line)."""
    from rl_jax import checkpoint as checkpoint_lib
    p, ck = self.p, self.checkpointer
    source = f"model.path {p.cfg.model.path!r}"
    try:
      if record["made_by_run"]:
        p.trainer.base_params = ck.restore_base(checkpoint_lib.abstract(p.trainer.base_params))
        source = ck.base_path()
    except checkpoint_lib.RestoreError as e:
      raise RunError(str(e)) from None
    error = checkpoint_lib.base_mismatch(
        record, checkpoint_lib.fingerprint(p.trainer.base_params), source, where=where)
    if error:
      raise RunError(error)
    self._base = record

  def last_step(self) -> int | None:
    """The newest checkpoint step whose write has committed; None without one."""
    return None if self.checkpointer is None else self.checkpointer.last_committed_step()

  def loop_state(self, step: int) -> dict:
    """The JSON half of a checkpoint: the cut (module docstring), the trainer-side
    counters and everything summary.json accumulates."""
    import jax
    from rl_jax.orchestration import multihost
    p = self.p
    keeps = self.keeps()
    # The samples decoded partway: kept with "all", counted as lost tokens otherwise
    # (a multi-process leader's sampler is not read out of turn: its followers replay it).
    partial = ({} if p.policy.sync or multihost.multi_process() else p.worker.take_partial())
    c = p.worker.cut_state()
    outstanding, counts, cut, prompts = c["outstanding"], c["counts"], c["next_gid"], c["prompts"]
    queued, generating, lost, lost_tokens = [], [], sorted(outstanding), 0
    if p.policy.sync:
      window = c["sync_window"]
      if window is not None and window[0] == step:
        # The next version's window has started; its groups were admitted in id order:
        # cut before the first, and they (dropped ones included) are generated again
        # after a resume.
        cut, prompts = window[1], window[2]
      dropped = {g: n for g, n in c["dropped"].items() if g >= cut}
      filtered = {g: n for g, n in c["filtered"].items() if g >= cut}
      counts["groups_admitted"] -= c["next_gid"] - cut
      counts["rollouts_generated"] -= (sum(v["rollouts"] for v in outstanding.values()) +
                                       sum(dropped.values()) + sum(filtered.values()))
      counts["groups_dropped_verifier_error"] -= len(dropped)
      counts["rollouts_dropped_verifier_error"] -= sum(dropped.values())
      counts["groups_filtered_zero_variance"] -= len(filtered)
      counts["rollouts_filtered_zero_variance"] -= sum(filtered.values())
      lost = []
    else:
      queued = [g for g in c["queued"] if g.group_id in outstanding]
      # (A group being queued at the cut is in both lists: it counts as queued.)
      generating = [g for g in c["generating"] if g.group_id in outstanding and
                    g.group_id not in {q.group_id for q in queued}]
      size = p.cfg.rl.group_size
      kept_q = queued if keeps != "off" else []
      kept_g = [g for g in generating if keeps == "all" or (
          keeps == "queued" and len(g.rollouts) == size)]
      carried = {g.group_id for g in kept_q + kept_g}
      lost = [g for g in lost if g not in carried]
      lost_tokens = sum(_tokens(g, partial) for g in queued + generating
                        if g.group_id not in carried)
      queued, generating = kept_q, kept_g
    train_step, skipped = jax.device_get((p.state.step, p.state.skipped))
    return {
        "step": step, "train_step": int(train_step), "skipped": int(skipped),
        "version": p.version, "wall_time_s": p.acc.clock.now(),
        "heldout_initial": p.heldout_initial, "heldout_curve": list(p.curve),
        "heldout_tool_call_rate_curve": list(p.tools.curve) if p.tools else [],
        "prompts": prompts, "next_group_id": cut,
        # Every group yields group_size verifier calls, so in sync mode this is the call
        # index the uninterrupted run reaches at the cut; in async mode it is unused yet.
        "verifier_calls": cut * p.cfg.rl.group_size,
        "lost_group_ids": lost, "lost_rollouts": sum(outstanding[g]["rollouts"] for g in lost),
        "lost_tokens": lost_tokens,
        "queued_groups": pack_groups(queued),
        # Being verified or generated (checkpoint.rollouts), with the partial samples.
        "inflight_groups": pack_groups(generating, partial if keeps == "all" else None),
        "rollout_source": self.rollout_source(),
        "control": p.control.state() if p.control is not None else None,
        **p.acc.state(counts),
    }

  def keeps(self) -> str:
    """What this run's checkpoints keep of the rollouts in flight: checkpoint.rollouts in
    async mode, except that a multi-process run keeps at most the queued groups (its
    followers replay the leader's sampling and cannot continue a restored sequence) and a
    task with an environment keeps no sequence in mid-episode; "off" in sync mode (its
    cut regenerates the window)."""
    from rl_jax.orchestration import multihost
    p = self.p
    mode = p.cfg.checkpoint.rollouts
    if p.policy.sync:
      return "off"
    if mode == "all" and (multihost.multi_process() or p.env is not None):
      return "queued"
    return mode

  def rollout_source(self) -> dict:
    """Fingerprints of what sampled the carried rollouts: the model's architecture, the
    tokenizer and the task (with its data and prompt settings)."""
    p = self.p
    model = {k: v for k, v in dataclasses.asdict(p.model_cfg).items()
             if k not in ("remat", "attention")}
    task = {"task": p.cfg.task.to_dict(), "data": p.cfg.data.to_dict(),
            "class": type(p.task).__name__}
    return {"model": _digest(model), "tokenizer": p.tokenizer.fingerprint(),
            "task": _digest(task)}

  def _check_source(self, saved: dict | None, groups: list[Group], where: str) -> None:
    """RunError (one line) when the carried rollouts were sampled with another model,
    tokenizer or task than this run's, checked by fingerprint and by encoding each
    carried group's prompt again."""
    from rl_jax.data import prompts as prompts_lib
    p = self.p
    hint = ("; resume with --config.checkpoint.rollouts=off to start without them "
            "(they are counted as lost)")
    ours = self.rollout_source()
    for key, what in (("model", "model architecture"), ("tokenizer", "tokenizer"),
                      ("task", "task or data settings")):
      if saved is not None and saved.get(key) != ours[key]:
        raise RunError(f"{where} holds rollouts sampled with another {what} ({key} "
                       f"fingerprint {saved.get(key)}, this run's {ours[key]}){hint}")
    for g in groups:
      tokens = prompts_lib.prompt_tokens(p.task, p.cfg.data, p.tokenizer, g.index)
      if not np.array_equal(np.asarray(tokens, np.int32), np.asarray(g.prompt_tokens)):
        raise RunError(f"{where} holds rollouts of group {g.group_id} whose prompt (task "
                       f"example {g.index}) this run's task and tokenizer encode "
                       f"differently: the task's data changed{hint}")

  def _carry(self, loop: dict, where: str) -> tuple[list[Group], list[Group], dict, dict]:
    """The groups a checkpoint carried that this run continues: (queued, in flight,
    their partial samples, the resume's record: what was lost, carried, discarded)."""
    p = self.p
    queued, _ = unpack(loop.get("queued_groups"), p.task)
    inflight, partial = unpack(loop.get("inflight_groups"), p.task)
    keeps = self.keeps()
    lost_q = queued if keeps == "off" else []
    lost_i = [g for g in inflight if keeps == "off" or (
        keeps == "queued" and len(g.rollouts) < p.cfg.rl.group_size)]
    gone = {g.group_id for g in lost_q + lost_i}
    queued = [g for g in queued if g.group_id not in gone]
    inflight = [g for g in inflight if g.group_id not in gone]
    if keeps != "all":
      partial = {}
    if queued or inflight:
      self._check_source(loop.get("rollout_source"), queued + inflight, where)
    # The staleness rule decides now for the groups in flight: their oldest token only
    # ages, so a group past the bound would be generated to be discarded.
    stale = []
    for g in inflight:
      oldest = _oldest_version(g, partial)
      if oldest is not None and not p.policy.accepts(p.version - oldest):
        stale.append((g, oldest))
    gone = {g.group_id for g, _ in stale}
    inflight = [g for g in inflight if g.group_id not in gone]
    record = {
        "groups_lost": len(loop["lost_group_ids"]) + len(lost_q) + len(lost_i),
        "rollouts_lost": loop["lost_rollouts"] + sum(len(g.rollouts) for g in lost_q + lost_i),
        "tokens_lost": loop.get("lost_tokens", 0) + sum(_tokens(g, partial if keeps == "all"
                                                                 else {}) for g in lost_q + lost_i),
        "groups_queued": len(queued), "groups_continued": len(inflight),
        "sequences_continued": sum(len(partial.get(g.group_id, {})) for g in inflight),
        "tokens_continued": sum(_tokens(g, partial) for g in inflight),
        "groups_discarded_stale": len(stale)}
    for g, oldest in stale:
      p.acc.discarded_at_resume(g, oldest)
    partial = {g.group_id: partial[g.group_id] for g in inflight if g.group_id in partial}
    return queued, inflight, partial, record

  def restore(self) -> dict | None:
    """Loads the newest usable checkpoint into the pipeline; its loop state, or None for
    a fresh start. metrics.jsonl keeps only the rows up to the restored step."""
    import jax
    from rl_jax import checkpoint as checkpoint_lib
    from rl_jax.trainer.train_step import TrainState
    p, ck = self.p, self.checkpointer
    if ck is None:
      return None
    if ck.latest_step() is None:
      self.truncate_metrics(0)
      return None
    changed: list[str] = []

    def check(saved, where):
      changed[:] = checkpoint_lib.check_compatible(saved, p.cfg, p.model_cfg, where=where)

    kl = p.cfg.trainer.kl_beta > 0 and not p.trainer.lora  # LoRA's reference: the base
    try:
      r = ck.restore(
          abstract_params=checkpoint_lib.abstract(p.state.params),
          abstract_opt_state=checkpoint_lib.abstract(p.state.opt_state),
          abstract_ref=(checkpoint_lib.abstract(p.state.params, p.trainer.compute_dtype)
                        if kl else None),
          check=check, warn=_warn)
    except checkpoint_lib.RestoreError as e:
      raise RunError(str(e)) from None
    loop = r.loop
    if p.trainer.lora:
      self._restore_base(r.config["lora_base"], ck.where(r.step))
    sh = p.trainer.state_shardings
    p.state = TrainState(
        params=r.params, opt_state=r.opt_state,
        step=jax.device_put(np.int32(loop["train_step"]), sh.step),
        skipped=jax.device_put(np.int32(loop["skipped"]), sh.skipped))
    if kl:
      p.trainer.ref_params = r.ref_params
    p.version = p.worker.trainer_version = int(loop["version"])
    if p.tools is not None:
      p.tools.restore(loop.get("heldout_tool_call_rate_curve", []))
    p.prompts.set_state(loop["prompts"])
    p.worker.next_group_id = int(loop["next_group_id"])
    # The pool draws each call's injected latency and failure from (seed, call index);
    # continuing the index keeps sync-mode rewards identical to an uninterrupted run.
    if p.pool is not None:
      p.pool.continue_from(int(loop["verifier_calls"]))
    queued, inflight, partial, record = self._carry(loop, ck.where(r.step))
    p.acc.load(loop, step=r.step, skipped_steps=r.skipped_steps, record=record)
    if p.control is not None and loop.get("control"):
      p.control.load(loop["control"])  # the live settings, not the config's, continue
    p.worker.restore_queued(queued)
    p.worker.restore_in_flight(inflight, partial)
    self.truncate_metrics(r.step)
    stale = record["groups_discarded_stale"]
    p.console.message(
        f"resumed from {ck.where(r.step)} (policy version {p.version}); "
        f"{len(queued)} verified groups queued there are trained now, "
        f"{len(inflight)} groups being generated or verified there continue "
        f"({record['sequences_continued']} sequences from the token they reached), "
        + (f"{stale} too stale to train are discarded, " if stale else "") +
        f"{record['groups_lost']} groups in flight there are lost on resume "
        f"({record['tokens_lost']} sampled tokens; checkpoint.rollouts={self.keeps()})")
    if changed:
      _warn("warning: config fields changed since the checkpoint: " + "; ".join(changed))
    return loop

  def truncate_metrics(self, step: int) -> None:
    """metrics.jsonl continues from `step`: metrics.truncate_after (process 0 writes)."""
    if self.p.writer.enabled:
      metrics_lib.truncate_after(os.path.join(self.p.workdir, "metrics.jsonl"), step)

  def close(self, failing: bool) -> None:
    """Waits for background saves; a failed write is a RunError unless the run is
    already failing with another error (then it is a warning line)."""
    if self.checkpointer is None:
      return
    try:
      self.checkpointer.close()
    except Exception as e:  # noqa: BLE001  (whatever the storage layer raises)
      text = str(e) if isinstance(e, UserError) else (
          f"writing a checkpoint to {self.checkpointer.directory} failed: "
          f"{type(e).__name__}: {e}")
      if not failing:
        raise RunError(text) from e
      _warn(f"warning: {text}")

  def abort(self, e: BaseException, step: int, consistent: bool) -> BaseException:
    """The exception run() raises after `e` stopped training at `step` optimizer steps;
    saves the state first when it is `consistent` (no train step was cut short) and the
    failure is not the storage's own. One sentence for the user."""
    from rl_jax.checkpoint import SaveError
    if isinstance(e, (KeyboardInterrupt, config_lib.ConfigError)):
      return e
    save_failure = e if isinstance(e, SaveError) else None  # a second save fails alike
    if consistent and save_failure is None:
      try:
        self.save(step, wait=True)
      except Exception as err:  # noqa: BLE001  (reported in the same line)
        save_failure = err
    where = self._where(step, save_failure)
    if isinstance(e, Preempted):
      return Preempted(f"preempted (SIGTERM) after {step} optimizer steps: {where}")
    if isinstance(e, SaveError):
      return RunError(where)
    if isinstance(e, UserError) or (isinstance(e, RunError) and
                                    not isinstance(e.__cause__, Exception)):
      return RunError(f"{e} ({where})" if self.checkpointer is not None else str(e))
    # An unexpected exception: one line for the user, the traceback in the workdir.
    log = os.path.join(self.p.workdir, "error.log")
    with open(log, "a") as f:
      f.write("".join(traceback.format_exception(e)))
    detail = str(e) if isinstance(e, RunError) else "the run failed: " + last_line(e)
    return RunError(f"{detail} (traceback in {log}; {where})")

  def _where(self, step: int, save_failure: BaseException | None) -> str:
    """Which checkpoint holds the run's state: the newest step whose write committed."""
    if self.checkpointer is None:
      return "checkpointing is off (checkpoint.every=0), so nothing was saved"
    latest = self.last_step()
    resume = "; rerun the same command to resume from it"
    if isinstance(save_failure, UserError):  # SaveError names the newest complete step
      return str(save_failure) + (resume if latest is not None else "")
    failed = "" if save_failure is None else (
        f"saving step {step} failed ({last_line(save_failure)}); ")
    if latest is None:
      return failed + "no checkpoint was saved yet"
    return (failed + f"{'saved' if latest == step else 'the newest is'} checkpoint step "
            f"{latest} in {self.checkpointer.directory}" + resume)


def _tokens(g: Group, partial: dict) -> int:
  """Sampled tokens a group holds: its finished rollouts' and its partial samples'."""
  return (sum(r.num_tokens for r in g.rollouts) +
          sum(len(v[0]) for v in partial.get(g.group_id, {}).values()))


def _oldest_version(g: Group, partial: dict) -> int | None:
  """The oldest policy version among a group's sampled tokens (None: none sampled)."""
  versions = [r.min_version for r in g.rollouts if r.num_tokens]
  versions += [int(np.min(v[2])) for v in partial.get(g.group_id, {}).values() if len(v[2])]
  return min(versions, default=None)


def _digest(value) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def last_line(e: BaseException) -> str:
  """The last line of the exception's own text (type: message)."""
  lines = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
  return lines[-1] if lines else type(e).__name__


def catch_sigterm(preempt: threading.Event, grace: float, *, saves: bool):
  """Routes SIGTERM to `preempt` (a stop at the next step boundary, where the checkpoint
  is saved); past `grace` seconds the process exits with cli.EXIT_PREEMPTED without
  waiting for the save. Without checkpointing (`saves` False) there is nothing to wait
  for: Preempted is raised at once in the main thread. Returns the function that puts
  the previous handler back and disarms that deadline."""
  if threading.current_thread() is not threading.main_thread():
    return lambda: None  # signal handlers can only be set from the main thread
  timers = []

  def give_up():
    sys.stderr.write(f"error: SIGTERM: the checkpoint could not be saved within "
                     f"checkpoint.grace_period_s={grace:g}s; exiting without it\n")
    sys.stderr.flush()
    os._exit(cli.EXIT_PREEMPTED)  # pylint: disable=protected-access

  def on_sigterm(signum, frame):
    del signum, frame
    if preempt.is_set():
      return
    preempt.set()
    if not saves:
      raise Preempted()
    timers.append(threading.Timer(grace, give_up))
    timers[0].daemon = True
    timers[0].start()

  previous = signal.signal(signal.SIGTERM, on_sigterm)

  def restore():
    signal.signal(signal.SIGTERM, previous)
    for timer in timers:
      timer.cancel()
  return restore

"""Metric names, writers (JSONL + TensorBoard) and the console progress line.

Names are flat and prefixed by area, following the seed's monitoring table:

  sampler/*      tokens_per_s, rollouts_per_s, active_slots, kv_pages_used, busy_frac;
                 tool use: parked (sequences waiting for a tool: pages held, no slot),
                 parked_pages, parked_mean (since the last row), model_tokens_per_s and
                 env_tokens_per_s (completion tokens by source: sampled / observation)
  lengths/*      p50, p90, p95, p99 completion length, truncation_rate; running totals
                 overlong_masked_total (truncated rollouts out of the loss, rl.overlong=
                 mask) and overlong_penalized_total (rollouts given the overlong penalty)
  latency/*      rollout_p50/p95/p99 (admission -> finished), verifier_p50/p95/p99,
                 tool_p50/p95/p99 (tool call submitted -> result, queueing included)
  queue/*        depth, enqueue_rate, dequeue_rate, oldest_age_s, inflight_groups
  staleness/*    mean, max, hist_<k> (accepted groups by staleness k), accepted,
                 discarded, discarded_v<version> (discards by behaviour version)
  weight_sync/*  transfer_s (train step done -> sampler copy landed; duration_s is the
                 same), wait_inflight_s (copy staged -> swapped in by the sampler between
                 decode calls), pause_s (sampler-thread time taking the weights), lag_s
                 (publish -> first sampler step on it), merge_s (LoRA: the sampler's
                 merge of the adapters into its decode weights), bytes (of the published
                 tree in the sampler dtype: the adapters' alone with LoRA), version
  policy/*       kl, ratio_p1/p50/p99, clip_frac_low/high, entropy, tis_weight_mean, ...,
                 logprob_mismatch_mean/max/tokens: |trainer - sampler log-prob| on the
                 tokens sampled with the params the step starts from (numerics only)
  optim/*        loss, pg_loss, grad_norm, update_norm, skipped_nonfinite, learning_rate
  train/*        padding_frac (share of the positions the step trained that hold no
                 token), padding_frac_unpacked (the same for padded rows: equal unless
                 trainer.packing packs), rows and positions (rows x row length) trained
  reward/*       train (mean over the trained batch), heldout (greedy, fixed held-out set)
  cost/*         sampler_device_s, trainer_device_s, reward_gain_per_device_hour
  verifier/*     error_rate (failed calls / results since the last row), timeouts_total,
                 errors_total
  data/*         groups_admitted, groups_lost_on_resume (in flight at a resumed cut),
                 groups_dropped_verifier_error (verifier.on_error="drop"), prompts_dropped
                 and prompts_truncated (data.on_long_prompt), prompts_skipped_lines (bad
                 lines of a task file), heldout_prompts_dropped, heldout_prompts_truncated,
                 groups_filtered_zero_variance and groups_uniform_capped
                 (rl.filter_groups: uniform groups filtered, and trained past the
                 rl.max_oversample budget); running totals, also in summary.json without
                 the prefix; filtered_share (filtered / completed groups) and
                 sampled_per_trained (groups admitted per group trained), since the last row
  checkpoint/*   last_step (newest committed checkpoint step, -1 before one), blocking_s
  control/*      live capacity control (rl.control, rl_jax/orchestration/control.py):
                 admission_bound (groups that may be admitted ahead of the trainer: in
                 flight + queued + held) and decode_slots (slots the sampler may use) in
                 force after the step, every row; on the row that applies a window's
                 computation (rl.control_every steps after the previous application,
                 plus apply_lag_steps: the steps the background computation took) the
                 next window's predicted_steps_per_hour, predicted_queue_depth,
                 predicted_staleness, predicted_discard_rate, the window's
                 measured_steps_per_hour, simulations run and seconds spent computing
                 (off the trainer thread), advice_computed (1, or 0 when the last restart
                 advice was reused), data_wait_share (the window's trainer wait on an
                 empty queue) and admission_floor (the least bound it allows next),
                 and the window-ahead check of the window's
                 prediction against its measurement:
                 steps_per_hour_error, queue_depth_error, staleness_error =
                 (predicted - measured) / measured (queue depth, staleness: / max(measured, 1))
  env/*          tool use (tasks with an environment): turns_mean, tool_calls_mean and
                 tool_call_rate (share with >= 1 call) of the rollouts finished since the
                 last row; tool_error_rate since the last row; running totals
                 tool_calls_total, tool_failures_total, tool_timeouts_total,
                 tool_results_dropped (late results of finished or restarted episodes),
                 episodes_ended_max_turns, tokens_model_total, tokens_env_total;
                 heldout_tool_call_rate (greedy held-out episodes with >= 1 call)

Staleness of a rollout at consumption = trainer_version - min(token_versions), in
published policy versions; a group's staleness is the max over its rollouts.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
from typing import Any, Callable, Mapping

import numpy as np

DESCRIPTIONS = {
    "staleness": "trainer_version - min(token_versions) at consumption, in published versions; "
                 "group staleness = max over its rollouts",
    "weight_sync/lag_s": "seconds from publication to the first sampler step using that version",
    "weight_sync/transfer_s": "seconds from the end of the train step to the sampler's copy "
                              "of the new weights having landed (the transfer alone)",
    "weight_sync/wait_inflight_s": "seconds the staged weights waited for the sampler's "
                                   "in-flight decode call (or drain) before the swap",
    "weight_sync/pause_s": "seconds the sampler thread spent taking the new weights",
    "weight_sync/merge_s": "LoRA: seconds of the one program that merges published adapters "
                           "into the sampler's decode weights, W = W0 + (alpha/r) A B, timed "
                           "alone (after the decode call in flight); 0 without LoRA",
    "weight_sync/bytes": "bytes one publication moves, in the sampler dtype (with LoRA the "
                         "adapters alone)",
    "queue/enqueue_rate": "verified groups put on the queue per second since the last row",
    "queue/dequeue_rate": "groups the trainer took from the queue per second since the last row",
    "reward/heldout": "mean correctness reward of greedy completions on the fixed held-out set",
    "env/heldout_tool_call_rate": "share of greedy held-out episodes that call the tool at "
                                  "least once",
    "sampler/parked": "sequences parked waiting for a tool: KV pages held, decode slot free",
    "trainer/data_wait_frac": "share of the run's wall time the trainer spent waiting on an "
                              "empty rollout queue for its batch (cumulative, like busy_frac)",
    "control/admission_bound": "groups the live controller lets be admitted ahead of the "
                               "trainer (in flight + queued + held), within the staleness rule",
    "control/decode_slots": "decode slots the live controller lets the sampler use",
    "control/steps_per_hour_error": "(predicted - measured) / measured optimizer steps per "
                                    "hour of a control window, predicted one window ahead",
    "control/advice_computed": "1 when a control window recomputed the restart advice, 0 "
                               "when its inputs stayed within 10% and the last was reused",
    "control/apply_lag_steps": "optimizer steps from a control window's end to the step "
                               "that applied its decision (its computation runs off the "
                               "trainer thread)",
}


def percentiles(values, qs=(50, 90, 95, 99)) -> dict[str, float]:
  if len(values) == 0:
    return {f"p{q}": 0.0 for q in qs}
  arr = np.asarray(values, np.float64)
  return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


def _clean(v: Any):
  if isinstance(v, (np.floating, np.integer)):
    v = v.item()
  if isinstance(v, float) and not math.isfinite(v):
    return None
  return v


class MetricWriter:
  """Writes one JSON line per step to `<workdir>/metrics.jsonl`, and TensorBoard scalars.

  Only the main process writes (process 0); other processes get a no-op writer.
  """

  def __init__(self, workdir: str, tensorboard: bool = True, enabled: bool = True):
    self.enabled = enabled
    self._tb = None
    self._f = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._f = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(workdir, "tb"))
      except ImportError:
        self._tb = None

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    row = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
    self._f.write(json.dumps(row) + "\n")
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
      self._f = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def read_jsonl(path: str) -> list[dict]:
  rows = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        rows.append(json.loads(line))
  return rows


def truncate_after(path: str, step: int) -> int:
  """Keeps the rows of `path` (metrics.jsonl) that a run resumed at `step` optimizer steps
  does not write again: rows of steps before `step`, and the training row of `step`
  itself. Rows of later steps (work a crash threw away), the final held-out row of a
  finished run (written again at its end) and a half-written last line go. Rewrites the
  file in place (a writer may hold it open for appending); returns the rows dropped."""
  if not os.path.exists(path):
    return 0

  def keep(line):
    try:
      row = json.loads(line)
    except json.JSONDecodeError:  # the half-written last line of a killed run
      return False
    return isinstance(row, dict) and isinstance(row.get("step"), int) and (
        row["step"] < step or (row["step"] == step and "optim/loss" in row))
  with open(path, "r+") as f:
    lines = [line for line in f if line.strip()]
    kept = [line for line in lines if keep(line)]
    f.seek(0)
    f.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
    f.truncate()
  return len(lines) - len(kept)


_COMPILED = {"programs": 0, "seconds": 0.0, "listening": False}  # this process's XLA compiles


def _count_compile(event: str, seconds: float, **_) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILED["programs"] += 1
    _COMPILED["seconds"] += seconds


class Console:
  """One progress line per logged step: step, versions, rewards, queue, staleness, rates;
  one-off messages; and heartbeat lines while something long runs silently."""

  def __init__(self, enabled: bool = True, stream=None):
    self.enabled = enabled
    self.stream = stream or sys.stdout
    self._t0 = time.time()
    self._last = self._t0  # when the last line was printed
    if enabled and not _COMPILED["listening"]:
      import jax
      _COMPILED["listening"] = True
      jax.monitoring.register_event_duration_secs_listener(_count_compile)

  @contextlib.contextmanager
  def heartbeat(self, describe: Callable[[], str], every_s: float = 15.0):
    """While the body runs, prints `describe()` and the programs XLA has compiled so far
    whenever `every_s` seconds pass without a line, so a tailed log shows that a long
    evaluation, compilation or wait is alive."""
    if not self.enabled:
      yield
      return
    stop = threading.Event()

    def beat():
      while not stop.wait(min(every_s, 1.0)):
        if time.time() - self._last >= every_s:
          self.message(f"{describe()} (XLA has compiled {_COMPILED['programs']} programs "
                       f"in {_COMPILED['seconds']:.0f}s)")

    thread = threading.Thread(target=beat, name="console-heartbeat", daemon=True)
    thread.start()
    try:
      yield
    finally:
      stop.set()
      thread.join()

  def line(self, m: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    def g(k, fmt="{:.3g}"):
      v = m.get(k)
      return "-" if v is None else fmt.format(v)
    text = (f"[{time.time() - self._t0:7.1f}s] step {g('step', '{:d}')} "
            f"v{g('weight_sync/version', '{:d}')} "
            f"loss {g('optim/loss')} reward {g('reward/train', '{:.3f}')} "
            f"heldout {g('reward/heldout', '{:.3f}')} "
            f"queue {g('queue/depth', '{:d}')} inflight {g('queue/inflight_groups', '{:d}')} "
            f"stale {g('staleness/mean', '{:.2f}')} (disc {g('staleness/discarded', '{:d}')}) "
            f"samp {g('sampler/tokens_per_s', '{:.0f}')} tok/s "
            f"train {g('trainer/tokens_per_s', '{:.0f}')} tok/s")
    if "control/admission_bound" in m:
      text += (f" ctl adm {g('control/admission_bound', '{:d}')} "
               f"slots {g('control/decode_slots', '{:d}')}")
      if "control/predicted_steps_per_hour" in m:
        text += f" pred {g('control/predicted_steps_per_hour', '{:.0f}')} steps/h"
    if "env/tool_call_rate" in m:
      text += (f" tool calls {g('env/tool_call_rate', '{:.2f}')} "
               f"(held-out {g('env/heldout_tool_call_rate', '{:.2f}')}) "
               f"parked {g('sampler/parked', '{:d}')}")
    print(text, file=self.stream, flush=True)
    self._last = time.time()

  def message(self, text: str) -> None:
    if self.enabled:
      print(f"[{time.time() - self._t0:7.1f}s] {text}", file=self.stream, flush=True)
      self._last = time.time()

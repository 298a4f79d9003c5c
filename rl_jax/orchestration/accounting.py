"""Run accounting: the pipeline clock, busy timers, counters, the metrics row, summary.json
and the counters' part of a checkpoint.

Every recorder is thread-safe (the sampler thread, verifier callbacks and the trainer all
record); the lock is never held across device work. Metric names are those of
rl_jax/metrics.py. Weight-sync timings (seconds, one value per publication):

  transfer_s       trainer step done -> the sampler copy has landed (duration_s is the same)
  wait_inflight_s  copy staged for the sampler -> the sampler swaps it in at a decode-call
                   boundary (its in-flight generate call, or without inflight weight
                   updates the drain of its running sequences)
  pause_s          sampler-thread seconds spent taking the new weights between two calls
  lag_s            publication launched -> the first sampler step on that version

Tool use (tasks with an environment, `has_env`): per finished rollout its model turns and
tool calls, its tokens by source (model / environment observation), every tool result's
status and latency (submitted -> result, queueing included), and the parked sequences
(waiting for a tool: pages held, no slot) sampled after every sampler step. Running
totals live in `counts` (so checkpoints carry them): env_episodes, env_turns,
env_tool_calls, env_episodes_with_call, tokens_model, tokens_env, tool_<status>,
tool_results_dropped, episodes_ended_<why>.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

import numpy as np

from rl_jax import metrics as metrics_lib

_POLICY_KEYS = ("kl", "entropy", "clip_frac_low", "clip_frac_high", "ratio_p1", "ratio_p50",
                "ratio_p99", "tis_weight_mean", "tis_truncated_frac", "behavior_prox_logp_gap",
                "logprob_mismatch_mean", "logprob_mismatch_max", "logprob_mismatch_tokens")
# Per-publication timings: metric weight_sync/<name>, summary weight_sync_<name>_mean
# (transfer_s also as weight_sync_s_mean); checkpoints carry [sum, count] of each.
# merge_s is 0 without LoRA (no merges).
_SYNC_KEYS = ("transfer_s", "wait_inflight_s", "pause_s", "lag_s", "merge_s")


class Clock:
  """Wall clock that can be paused (held-out evaluation is not pipeline time)."""

  def __init__(self, start_s: float = 0.0):
    self._start = time.perf_counter() - start_s  # a resumed run continues its clock
    self._paused_total = 0.0
    self._paused_at = None

  def pause(self):
    self._paused_at = time.perf_counter()

  def resume(self):
    self._paused_total += time.perf_counter() - self._paused_at
    self._paused_at = None

  def now(self) -> float:
    t = self._paused_at if self._paused_at is not None else time.perf_counter()
    return t - self._start - self._paused_total


class BusyTimer:
  """Accumulates busy seconds of one role (the fraction is busy / pipeline wall time) and
  its latest KEEP busy intervals; written by the role's thread, read by others."""

  KEEP = 20000

  def __init__(self):
    self.busy_s = 0.0
    self._intervals: collections.deque = collections.deque(maxlen=self.KEEP)
    self._lock = threading.Lock()

  def add(self, start: float, end: float):
    with self._lock:
      self.busy_s += end - start
      self._intervals.append((start, end))

  def recent(self, n: int, since: float = float("-inf")) -> list[tuple[float, float]]:
    """The last `n` intervals (start, end) that end at or after `since`, oldest first."""
    with self._lock:
      out = list(self._intervals)[-n:]
    return [iv for iv in out if iv[1] >= since]


class Reservoir:
  """A uniform sample of at most `cap` of the values seen (for the planner's fits)."""

  def __init__(self, cap: int = 20000, seed: int = 0):
    self.cap, self.seen, self.values = cap, 0, []
    self._rng = np.random.default_rng(seed)

  def extend(self, values) -> None:
    for v in values:
      self.seen += 1
      if len(self.values) < self.cap:
        self.values.append(v)
      else:
        j = int(self._rng.integers(0, self.seen))
        if j < self.cap:
          self.values[j] = v


def _gain_per_hour(heldout: tuple, device_hours: float) -> float:
  """Held-out reward gained since the start per device-hour (0 before any is known)."""
  h0, h1 = heldout
  if h0 is None or h1 is None or device_hours <= 0:
    return 0.0
  return (h1 - h0) / device_hours


def _pct_row(prefix: str, values, qs=(50, 95, 99)) -> dict[str, float]:
  return {f"{prefix}_{k}": v for k, v in metrics_lib.percentiles(values, qs).items()}


class RunAccounting:
  """What a run measured; `row` and `summary` read it, `state`/`load` checkpoint it."""

  def __init__(self, *, mode: str, sampler_devices: int, trainer_devices: int,
               total_devices: int):
    self.mode = mode
    self.devices = (sampler_devices, trainer_devices, total_devices)
    self.lock = threading.Lock()
    self.clock = Clock()
    self.sampler_busy = BusyTimer()
    self.trainer_busy = BusyTimer()
    self.data_wait_s = 0.0  # the trainer's time blocked on an empty queue for its batch
    self.counts: collections.Counter = collections.Counter()
    self.trained_log: list[tuple[int, int, int]] = []  # (trainer version, group id, staleness)
    self.staleness_hist: collections.Counter = collections.Counter()
    self.discarded_by_version: collections.Counter = collections.Counter()
    self.batch_staleness: list[int] = [0]
    self.finished: list = []  # rollouts since the last row
    self.verifier_latencies: list[float] = []  # submitted -> scored (includes waiting)
    self.verifier_service: list[float] = []  # started -> scored
    self.all_lengths = Reservoir(seed=1)  # completion lengths, for the planner
    self.all_service = Reservoir(seed=2)
    self.prompt_tokens_total = 0
    self.sampler_tokens = 0
    self.trainer_tokens = 0
    self.step_times: list[float] = []
    self.padded_tokens = 0
    self.sync: dict[str, list[float]] = {k: [] for k in _SYNC_KEYS}
    self.carried: dict[str, list[float]] = {k: [0.0, 0] for k in _SYNC_KEYS}
    self.resumes: list[dict] = []
    self.checkpoint_blocking_s = 0.0
    # Set by the pipeline: the newest checkpoint step whose write has committed
    # (Checkpointer.last_committed_step), and the prompt sources' counters (prompts_*,
    # heldout_prompts_*: dropped and truncated prompts, skipped file lines).
    self.committed_step: Callable[[], int | None] = lambda: None
    self.data_counters: Callable[[], dict[str, int]] = dict
    self._marks: collections.Counter = collections.Counter()  # counters at the last row
    self._last_row = (0.0, 0, 0, 0, 0)  # time, sampler tokens, trainer tokens, enq, deq
    self.has_env = False  # set by the pipeline for a task with an environment
    self.tool_latencies: list[float] = []  # since the last row
    self.episodes: list[tuple[int, int, int, int]] = []  # since the last row: turns, tool
    # calls, model tokens, observation tokens of each finished episode
    self.all_tool_latencies = Reservoir(seed=3)
    self.parked_samples = [0, 0, 0, 0]  # since the last row: n, sum; run: max, max pages
    self.heldout_tool_call_rate: float | None = None  # the latest held-out evaluation's

  # -- recorders -------------------------------------------------------------------

  def rollout_finished(self, r, tool_calls: int | None = None) -> None:
    """tool_calls: the calls its episode made (None: a single-turn task)."""
    with self.lock:
      self.finished.append(r)
      self.counts["rollouts_generated"] += 1
      self.sampler_tokens += r.num_tokens
      self.prompt_tokens_total += len(r.prompt_tokens)
      if tool_calls is not None:
        model = int(r.model_token_mask.sum())
        self.episodes.append((r.num_turns, int(tool_calls), model, r.num_tokens - model))
        self.counts.update(env_episodes=1, env_turns=r.num_turns, env_tool_calls=tool_calls,
                           env_episodes_with_call=int(tool_calls > 0), tokens_model=model,
                           tokens_env=r.num_tokens - model)

  def tool_result(self, result) -> None:
    """One tool call's final result (rl_jax.tasks.worker_pool.CallResult)."""
    with self.lock:
      self.counts[f"tool_{result.status}"] += 1
      self.tool_latencies.append(result.latency_s)

  def count(self, name: str, n: int = 1) -> None:
    with self.lock:
      self.counts[name] += n

  def parked(self, sequences: int, pages: int) -> None:
    """The generator's parked sequences and their pages after a sampler step."""
    with self.lock:
      p = self.parked_samples
      p[0] += 1
      p[1] += sequences
      p[2], p[3] = max(p[2], sequences), max(p[3], pages)

  def verified(self, result) -> None:
    with self.lock:
      self.verifier_latencies.append(result.latency_s)
      self.verifier_service.append(result.t_finished - result.t_started)
      self.counts[f"verifier_{result.status}"] += 1

  def weight_sync(self, name: str, seconds: float) -> None:
    with self.lock:
      self.sync[name].append(seconds)

  def accepted(self, version: int, gid: int, staleness: int) -> None:
    self.staleness_hist[staleness] += 1
    self.trained_log.append((version, gid, staleness))

  def discarded(self, group) -> None:
    self.counts["groups_discarded_stale"] += 1
    self.counts["rollouts_discarded_stale"] += len(group.rollouts)
    self.discarded_by_version[min(r.min_version for r in group.rollouts)] += 1

  def dropped(self, group) -> None:
    """A group not trained on because a verifier call failed (verifier.on_error=drop)."""
    with self.lock:
      self.counts["groups_dropped_verifier_error"] += 1
      self.counts["rollouts_dropped_verifier_error"] += len(group.rollouts)

  def filtered(self, group) -> None:
    """A group not queued because its rewards are all equal (rl.filter_groups)."""
    with self.lock:
      self.counts["groups_filtered_zero_variance"] += 1
      self.counts["rollouts_filtered_zero_variance"] += len(group.rollouts)

  def trained(self, groups, tm: dict, *, padded: int, step_s: float) -> None:
    self.step_times.append(step_s)
    self.padded_tokens += padded
    self.counts["rollouts_trained"] += sum(len(g.rollouts) for g in groups)
    self.trainer_tokens += int(tm.get("tokens", 0))

  def verifier_statuses(self) -> dict[str, int]:
    return {k[9:]: v for k, v in self.counts.items() if k.startswith("verifier_")}

  # -- the metrics row -------------------------------------------------------------

  def device_hours(self) -> float:
    ns, nt, _ = self.devices
    return (self.sampler_busy.busy_s * ns + self.trainer_busy.busy_s * nt) / 3600

  def row(self, *, step: int, version: int, groups, tm: dict, heldout: tuple, generator,
          queue: dict, sync_bytes: int) -> dict:
    """The metrics.jsonl row after optimizer step `step` (rates since the previous row);
    heldout = (initial, latest) held-out reward."""
    with self.lock:
      finished, self.finished = self.finished, []
      vlat, self.verifier_latencies = self.verifier_latencies, []
      vserv, self.verifier_service = self.verifier_service, []
      sync = {k: (v[-1] if v else 0.0) for k, v in self.sync.items()}
    lengths = [r.num_tokens for r in finished]
    self.all_lengths.extend(lengths)
    self.all_service.extend(vserv)
    step_times, self.step_times = self.step_times, []
    padded, self.padded_tokens = self.padded_tokens, 0
    now = self.clock.now()
    t0, samp0, train0, enq0, deq0 = self._last_row
    dt = max(now - t0, 1e-9)
    self._last_row = (now, self.sampler_tokens, self.trainer_tokens,
                      queue["enqueued_total"], queue["dequeued_total"])
    wall = max(now, 1e-9)
    row: dict[str, Any] = {
        "step": step, "time_s": now,
        "sampler/tokens_per_s": (self.sampler_tokens - samp0) / dt,
        "sampler/rollouts_per_s": len(finished) / dt,
        "sampler/active_slots": generator.num_active,
        "sampler/kv_pages_used": generator.kv_pages_used,
        "sampler/busy_frac": self.sampler_busy.busy_s / wall,
        "sampler/generate_calls": generator.generate_calls,
        "sampler/preemptions": generator.preemptions,
        "trainer/tokens_per_s": (self.trainer_tokens - train0) / dt,
        "trainer/busy_frac": self.trainer_busy.busy_s / wall,
        "trainer/data_wait_frac": self.data_wait_s / wall,
        "trainer/step_time_s": float(np.mean(step_times)) if step_times else 0.0,
        "trainer/padded_tokens": padded,
        "queue/depth": queue["depth"], "queue/inflight_groups": queue["inflight"],
        "queue/enqueued_total": queue["enqueued_total"],
        "queue/dequeued_total": queue["dequeued_total"],
        "queue/enqueue_rate": (queue["enqueued_total"] - enq0) / dt,
        "queue/dequeue_rate": (queue["dequeued_total"] - deq0) / dt,
        "queue/oldest_age_s": queue["oldest_age_s"],
        "weight_sync/version": version,
        "weight_sync/duration_s": sync["transfer_s"],
        "weight_sync/bytes": sync_bytes,
        **{f"weight_sync/{k}": v for k, v in sync.items()},
        "reward/train": float(np.mean([r.reward for g in groups for r in g.rollouts])),
        "reward/heldout": heldout[1],
        "staleness/accepted": sum(self.staleness_hist.values()),
        "staleness/discarded": self.counts["groups_discarded_stale"],
        "staleness/mean": float(np.mean(self.batch_staleness)),
        "staleness/max": int(np.max(self.batch_staleness)),
        "cost/sampler_device_s": self.sampler_busy.busy_s * self.devices[0],
        "cost/trainer_device_s": self.trainer_busy.busy_s * self.devices[1],
        "cost/reward_gain_per_device_hour": _gain_per_hour(heldout, self.device_hours()),
    }
    row.update({f"staleness/hist_{k}": v for k, v in sorted(self.staleness_hist.items())})
    row.update({f"staleness/discarded_v{v}": n
                for v, n in sorted(self.discarded_by_version.items())})
    row.update({f"lengths/{k}": v for k, v in metrics_lib.percentiles(lengths).items()})
    row["lengths/truncation_rate"] = (
        float(np.mean([r.finish_reason == "length" for r in finished])) if finished else 0.0)
    row["lengths/overlong_masked_total"] = self.counts["rollouts_overlong_masked"]
    row["lengths/overlong_penalized_total"] = self.counts["rollouts_overlong_penalized"]
    row["lengths/prompt_mean"] = (float(np.mean([len(r.prompt_tokens) for r in finished]))
                                  if finished else 0.0)
    row.update(_pct_row("latency/rollout", [r.finished - r.admitted for r in finished
                                            if r.admitted]))
    row.update(_pct_row("latency/verifier", vlat))
    row.update(_pct_row("latency/verifier_service", vserv))
    row["latency/verifier_mean"] = float(np.mean(vlat)) if vlat else 0.0
    for k, v in tm.items():
      row[k if "/" in k else ("policy/" if k in _POLICY_KEYS else "optim/") + k] = v
    row.update(self._fault_row())
    row.update(self._filter_row())
    if self.has_env:
      row.update(self._env_row(generator, dt))
    return row

  def _filter_row(self) -> dict:
    """Dynamic sampling (rl.filter_groups): the running total of filtered groups, the
    filtered share of the groups completed since the last row, and groups sampled
    (admitted) per group trained since the last row."""
    now = {"filtered": self.counts["groups_filtered_zero_variance"],
           "completed": self.counts["groups_completed"],
           "admitted": self.counts["groups_admitted"],
           "trained": sum(self.staleness_hist.values())}
    d = {k: v - self._marks[f"filter_{k}"] for k, v in now.items()}
    self._marks.update({f"filter_{k}": v for k, v in d.items()})  # (adds the deltas)
    return {
        "data/groups_filtered_zero_variance": now["filtered"],
        "data/filtered_share": d["filtered"] / d["completed"] if d["completed"] else 0.0,
        "data/sampled_per_trained": d["admitted"] / d["trained"] if d["trained"] else 0.0,
        "data/groups_uniform_capped": self.counts["groups_uniform_capped"],
    }

  def _env_row(self, generator, dt: float) -> dict:
    """Tool use since the last row (module docstring), and the running totals."""
    with self.lock:
      lat, self.tool_latencies = self.tool_latencies, []
      eps, self.episodes = self.episodes, []
      n, total = self.parked_samples[:2]
      self.parked_samples[:2] = [0, 0]
      c = collections.Counter(self.counts)
    self.all_tool_latencies.extend(lat)
    turns, calls, model, env = np.asarray(eps, np.float64).reshape(-1, 4).T
    results = {s: c[f"tool_{s}"] - self._marks[f"tool_{s}"] for s in ("ok", "timeout", "error")}
    self._marks.update({f"tool_{s}": v for s, v in results.items()})
    done = sum(results.values())
    row = {
        "sampler/parked": getattr(generator, "num_parked", 0),
        "sampler/parked_pages": getattr(generator, "parked_pages", 0),
        "sampler/parked_mean": total / n if n else 0.0,
        "sampler/model_tokens_per_s": float(model.sum()) / dt,
        "sampler/env_tokens_per_s": float(env.sum()) / dt,
        "env/turns_mean": float(turns.mean()) if eps else 0.0,
        "env/tool_calls_mean": float(calls.mean()) if eps else 0.0,
        "env/tool_call_rate": float((calls > 0).mean()) if eps else 0.0,
        "env/tool_error_rate": (results["timeout"] + results["error"]) / done if done else 0.0,
        "env/tool_calls_total": c["tool_ok"] + c["tool_timeout"] + c["tool_error"],
        "env/tool_failures_total": c["tool_error"],
        "env/tool_timeouts_total": c["tool_timeout"],
        "env/tool_results_dropped": c["tool_results_dropped"],
        "env/episodes_ended_max_turns": c["episodes_ended_max_turns"],
        "env/tokens_model_total": c["tokens_model"], "env/tokens_env_total": c["tokens_env"],
        "env/heldout_tool_call_rate": self.heldout_tool_call_rate,
    }
    row.update(_pct_row("latency/tool", lat))
    return row

  def env_summary(self) -> dict:
    """summary.json's tool-use entries (module docstring), over the run's lineage."""
    with self.lock:
      c = collections.Counter(self.counts)
      parked_max, parked_pages_max = self.parked_samples[2:]
    episodes = max(c["env_episodes"], 1)
    lat = metrics_lib.percentiles(self.all_tool_latencies.values, (50, 95, 99))
    return {
        "turns_per_rollout_mean": c["env_turns"] / episodes,
        "tool_calls_per_rollout_mean": c["env_tool_calls"] / episodes,
        "tool_call_rate": c["env_episodes_with_call"] / episodes,
        **{f"tool_latency_{k}_s": v for k, v in lat.items()},
        "tool_calls": c["tool_ok"] + c["tool_timeout"] + c["tool_error"],
        "tool_failures": c["tool_error"], "tool_timeouts": c["tool_timeout"],
        "tool_results_dropped": c["tool_results_dropped"],
        "episodes_ended_max_turns": c["episodes_ended_max_turns"],
        "tokens_model": c["tokens_model"], "tokens_env": c["tokens_env"],
        "parked_max": parked_max, "parked_pages_max": parked_pages_max,
        "tool_latency_s": self.all_tool_latencies.values,
    }

  def _fault_row(self) -> dict:
    """Verifier health and checkpoint/resume counters."""
    statuses = {s: self.counts[f"verifier_{s}"] for s in ("ok", "timeout", "error")}
    delta = {s: n - self._marks[s] for s, n in statuses.items()}
    self._marks.update(delta)
    results = sum(delta.values())
    blocking, self.checkpoint_blocking_s = self.checkpoint_blocking_s, 0.0
    committed = self.committed_step()
    return {
        **{f"data/{k}": v for k, v in self.data_counters().items()},
        "data/groups_dropped_verifier_error": self.counts["groups_dropped_verifier_error"],
        "verifier/error_rate": (delta["timeout"] + delta["error"]) / results if results else 0.0,
        "verifier/timeouts_total": statuses["timeout"],
        "verifier/errors_total": statuses["error"],
        "data/groups_admitted": self.counts["groups_admitted"],
        "data/groups_lost_on_resume": self.counts["groups_lost_on_resume"],
        "checkpoint/blocking_s": blocking,
        "checkpoint/last_step": -1 if committed is None else committed,
    }

  # -- summary.json ----------------------------------------------------------------

  def sync_means(self) -> dict[str, float]:
    """Means over the run's lineage (sums carried across resumes)."""
    with self.lock:
      out = {}
      for k, values in self.sync.items():
        total, n = self.carried[k]
        out[f"weight_sync_{k}_mean"] = (total + sum(values)) / max(n + len(values), 1)
    out["weight_sync_s_mean"] = out["weight_sync_transfer_s_mean"]
    return out

  def summary(self, *, wall: float, step: int, version: int, heldout: tuple[float, float],
              curve: list, max_queue_depth: int, groups_in_flight: int) -> dict:
    c, (h0, h1) = self.counts, heldout
    device_hours = self.device_hours()
    wall_ = max(wall, 1e-9)
    return {
        "mode": self.mode, "wall_time_s": wall, "optimizer_steps": step,
        "policy_version": version,
        "heldout_reward_initial": h0, "heldout_reward_final": h1, "heldout_curve": curve,
        "rollouts_generated": c["rollouts_generated"],
        "rollouts_trained": c["rollouts_trained"],
        "rollouts_discarded_stale": c["rollouts_discarded_stale"],
        "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_hist.items())},
        "discarded_by_version": {str(k): v for k, v in sorted(self.discarded_by_version.items())},
        "sampler_tokens_per_s": self.sampler_tokens / wall_,
        "trainer_tokens_per_s": self.trainer_tokens / wall_,
        "sampler_busy_frac": self.sampler_busy.busy_s / wall_,
        "trainer_busy_frac": self.trainer_busy.busy_s / wall_,
        "trainer_data_wait_frac": self.data_wait_s / wall_,
        "verifier_status": self.verifier_statuses(),
        "max_queue_depth": max_queue_depth,
        "device_hours": device_hours,
        "reward_gain_per_device_hour": _gain_per_hour(heldout, device_hours),
        "devices": self.devices[2],
        "timeline": {"sampler": self.sampler_busy.recent(5000),
                     "trainer": self.trainer_busy.recent(5000)},
        "staleness_definition": metrics_lib.DESCRIPTIONS["staleness"],
        "completion_lengths": self.all_lengths.values,
        "verifier_service_s": self.all_service.values,
        "prompt_tokens_mean": self.prompt_tokens_total / max(c["rollouts_generated"], 1),
        **self.sync_means(),
        # groups_admitted = trained + discarded_stale + dropped_verifier_error
        #                  + filtered_zero_variance + lost_on_resume + in_flight_at_end
        "groups_admitted": c["groups_admitted"],
        "groups_trained": sum(self.staleness_hist.values()),
        "groups_discarded_stale": c["groups_discarded_stale"],
        "groups_dropped_verifier_error": c["groups_dropped_verifier_error"],
        "rollouts_dropped_verifier_error": c["rollouts_dropped_verifier_error"],
        "groups_filtered_zero_variance": c["groups_filtered_zero_variance"],
        "rollouts_filtered_zero_variance": c["rollouts_filtered_zero_variance"],
        "groups_uniform_capped": c["groups_uniform_capped"],
        "groups_completed": c["groups_completed"],
        "filtered_share": (c["groups_filtered_zero_variance"] / c["groups_completed"]
                           if c["groups_completed"] else 0.0),
        "sampled_per_trained": (c["groups_admitted"] / sum(self.staleness_hist.values())
                                if self.staleness_hist else 0.0),
        "rollouts_overlong_masked": c["rollouts_overlong_masked"],
        "rollouts_overlong_penalized": c["rollouts_overlong_penalized"],
        "groups_lost_on_resume": c["groups_lost_on_resume"],
        "groups_in_flight_at_end": groups_in_flight,
        "rollouts_lost_on_resume": c["rollouts_lost_on_resume"],
        # Sampled tokens of the groups lost on resume: sampler work done again.
        "sampler_tokens_lost_on_resume": c["tokens_lost_on_resume"],
        "rollouts_in_flight_at_end": (c["rollouts_generated"] - c["rollouts_trained"] -
                                      c["rollouts_discarded_stale"] -
                                      c["rollouts_dropped_verifier_error"] -
                                      c["rollouts_filtered_zero_variance"] -
                                      c["rollouts_lost_on_resume"]),
        "resumes": self.resumes,
        "last_checkpoint_step": self.committed_step(),
        **self.data_counters(),
    }

  # -- checkpoint ------------------------------------------------------------------

  def state(self, counts: collections.Counter) -> dict:
    """The counters' part of a checkpoint's loop state; `counts` as of the cut."""
    with self.lock:
      sync = {f"weight_sync_{k}": [self.carried[k][0] + sum(v), self.carried[k][1] + len(v)]
              for k, v in self.sync.items()}
    sync["weight_sync_s"] = sync.pop("weight_sync_transfer_s")
    return {
        "counts": dict(counts),
        "staleness_hist": {str(k): v for k, v in self.staleness_hist.items()},
        "discarded_by_version": {str(k): v for k, v in self.discarded_by_version.items()},
        "sampler_tokens": self.sampler_tokens, "trainer_tokens": self.trainer_tokens,
        "prompt_tokens_total": self.prompt_tokens_total,
        "sampler_busy_s": self.sampler_busy.busy_s, "trainer_busy_s": self.trainer_busy.busy_s,
        "trainer_data_wait_s": self.data_wait_s,
        **sync,
        "resumes": self.resumes,
    }

  def discarded_at_resume(self, group, oldest_version: int) -> None:
    """A group a checkpoint carried in flight that the staleness rule rejects on resume
    (its finished rollouts were counted as generated before the checkpoint)."""
    self.counts["groups_discarded_stale"] += 1
    self.counts["rollouts_discarded_stale"] += len(group.rollouts)
    self.discarded_by_version[oldest_version] += 1

  def load(self, loop: dict, *, step: int, skipped_steps: int, record: dict) -> None:
    """Continues the counters of a checkpoint's loop state; `record` says what the resume
    lost, carried and discarded (RunCheckpoints._carry)."""
    self.counts.update(loop["counts"])
    self.staleness_hist.update({int(k): v for k, v in loop["staleness_hist"].items()})
    self.discarded_by_version.update(
        {int(k): v for k, v in loop["discarded_by_version"].items()})
    self.sampler_tokens, self.trainer_tokens = loop["sampler_tokens"], loop["trainer_tokens"]
    self.prompt_tokens_total = loop["prompt_tokens_total"]
    self.sampler_busy.busy_s = loop["sampler_busy_s"]
    self.trainer_busy.busy_s = loop["trainer_busy_s"]
    self.data_wait_s = loop.get("trainer_data_wait_s", 0.0)  # (older checkpoints lack it)
    for k in _SYNC_KEYS:  # checkpoints from before a timing existed lack its key
      key = "weight_sync_s" if k == "transfer_s" else f"weight_sync_{k}"
      self.carried[k] = list(loop.get(key, [0.0, 0]))
    self.counts["groups_lost_on_resume"] += record["groups_lost"]
    self.counts["rollouts_lost_on_resume"] += record["rollouts_lost"]
    self.counts["tokens_lost_on_resume"] += record["tokens_lost"]
    self.resumes = loop["resumes"] + [{"step": step, **record,
                                       "skipped_steps": skipped_steps}]

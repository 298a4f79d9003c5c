"""The sync/async pipeline end to end on a tiny workload: the DESIGN.md contracts."""
import concurrent.futures
import json
import os
import threading
import time
import types

import numpy as np
import pytest

from rl_jax import config as config_lib
from rl_jax.orchestration import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = [
    "--config.rl.total_steps=6", "--config.rl.groups_per_step=4", "--config.rl.group_size=4",
    "--config.rl.eval_every=3", "--config.task.heldout_size=8", "--config.warmstart.steps=0",
    "--config.sampler.max_concurrent_decodes=16", "--config.sampler.max_new_tokens=16",
    # One page per sequence (16 + 16 positions): one page-table width bucket, so fewer
    # generate programs to compile (paging itself is tested in test_generator*).
    "--config.sampler.page_size=32",
    "--config.trainer.length_buckets=(32,)", "--config.verifier.workers=4",
    "--config.verifier.latency=lognormal", "--config.verifier.latency_mean_s=0.01",
    "--config.metrics.console=false", "--config.metrics.tensorboard=false",
    # The accounting tests count every admitted group as trained, discarded or in flight:
    # no filtering (its own tests below turn it on) and a one-batch queue.
    "--config.rl.filter_groups=none", "--config.rl.queue_maxsize=64",
]


def make_cfg(*overrides):
  cfg, _ = config_lib.parse_args(["--config", os.path.join(ROOT, "configs/default.py"),
                                  *TINY, *overrides])
  return config_lib.validate(cfg)


def kv_bytes_per_device(pipe) -> int:
  """The most bytes of live K/V-pool-shaped arrays ([k, n, p, d] per layer, or stacked)
  that any sampler device holds."""
  import jax
  eng, cfg = pipe.engine, pipe.model_cfg
  tail = (cfg.num_kv_heads, eng.num_pages, eng.page_size, cfg.head_dim)
  per = {d: 0 for d in pipe.meshes.sampler.devices.flat}
  for x in jax.live_arrays():
    if tuple(x.shape[-4:]) == tail:
      for shard in x.addressable_shards:
        if shard.device in per:
          per[shard.device] += shard.data.nbytes
  return max(per.values())


def run_pipeline(cfg, workdir, on_evaluate=None, before_run=None):
  """Runs the pipeline, capturing every rollout; on_evaluate(pipe) runs after each
  held-out generation, still inside the evaluation; before_run(pipe) before the run."""
  pipe = loop.Pipeline(cfg, str(workdir))
  if before_run is not None:
    before_run(pipe)
  if on_evaluate is not None:
    generate = pipe.heldout.generate
    pipe.heldout.generate = lambda gen: (generate(gen), on_evaluate(pipe))[0]
  rollouts = []
  original = pipe.worker.on_rollout_finished

  def capture(r):
    rollouts.append(r)
    original(r)
  pipe.worker.on_rollout_finished = capture
  summary = pipe.run()
  return pipe, summary, rollouts


def check_common(pipe, summary, rollouts, workdir, max_staleness):
  cfg = pipe.cfg
  versions = [v for v, _, _ in pipe.acc.trained_log]
  assert versions == sorted(versions), "trainer versions must be monotone"
  assert summary["policy_version"] == cfg.rl.total_steps // cfg.rl.weight_sync_every
  assert all(s <= max_staleness for _, _, s in pipe.acc.trained_log)
  assert len(pipe.acc.trained_log) == cfg.rl.total_steps * cfg.rl.groups_per_step
  # every rollout is accounted for: trained, discarded as stale, or still in flight
  assert summary["rollouts_generated"] == len(rollouts)
  assert summary["rollouts_trained"] == cfg.rl.total_steps * cfg.rl.groups_per_step * cfg.rl.group_size
  assert (summary["rollouts_trained"] + summary["rollouts_discarded_stale"] +
          summary["rollouts_in_flight_at_end"] == summary["rollouts_generated"])
  assert summary["rollouts_in_flight_at_end"] >= 0
  assert summary["max_queue_depth"] <= cfg.rl.queue_maxsize
  # token versions are tags of published versions, non-decreasing along a completion
  for r in rollouts:
    assert r.token_versions.shape == r.completion_tokens.shape == r.behavior_logprobs.shape
    assert np.all(np.diff(r.token_versions) >= 0)
    assert 0 <= r.min_version and r.token_versions.max() <= summary["policy_version"]
    assert np.all(r.behavior_logprobs <= 0)
  with open(os.path.join(workdir, "summary.json")) as f:
    on_disk = json.load(f)
  for key in ("mode", "wall_time_s", "optimizer_steps", "policy_version", "heldout_reward_initial",
              "heldout_reward_final", "heldout_curve", "rollouts_generated", "rollouts_trained",
              "rollouts_discarded_stale", "staleness_histogram", "sampler_tokens_per_s",
              "trainer_tokens_per_s", "weight_sync_s_mean", "sampler_busy_frac",
              "trainer_busy_frac"):
    assert key in on_disk, key
  assert on_disk["optimizer_steps"] == cfg.rl.total_steps
  # sampler.compile=ahead (configs/default.py): the two covering programs compiled before
  # the clock, none during the run, and every sampler call ran on one of them.
  assert (on_disk["sampler_programs_compiled_ahead"], on_disk["sampler_programs_compiled_inline"],
          on_disk["sampler_programs_compiled_background"]) == (2, 0, 0)
  assert on_disk["sampler_calls_covered"] > 0
  # The attention kernel that ran (auto on CPU: xla, no fallback), in summary and metrics.
  assert (on_disk["attention_kernel"], on_disk["attention_requested"],
          on_disk["attention_fallback"]) == ("xla", "auto", "")
  assert 0 < on_disk["sampler_busy_frac"] <= 1 and 0 < on_disk["trainer_busy_frac"] <= 1
  # The trainer's wait on an empty queue is outside its busy time (the first batch at
  # least is waited for).
  assert 0 < on_disk["trainer_data_wait_frac"]
  assert on_disk["trainer_busy_frac"] + on_disk["trainer_data_wait_frac"] <= 1 + 1e-9
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  keys = set().union(*rows)
  for prefix in ("sampler/", "lengths/", "latency/", "queue/", "staleness/", "weight_sync/",
                 "policy/", "optim/", "reward/", "cost/"):
    assert any(k.startswith(prefix) for k in keys), prefix
  assert [r["step"] for r in rows if "optim/loss" in r] == list(range(1, cfg.rl.total_steps + 1))
  assert {(r["trainer/attention_kernel"], r["trainer/attention_fallback"])
          for r in rows if "optim/loss" in r} == {("xla", 0.0)}
  # Packing (trainer.packing=auto, xla attention on CPU) never trains more padding.
  assert all(r["train/padding_frac"] <= r["train/padding_frac_unpacked"] and
             r["trainer/padded_tokens"] == r["train/positions"] for r in rows if "optim/loss" in r)


def test_async_bounded_staleness_and_inflight_updates(tmp_path, monkeypatch):
  # A window holding a slow step (an XLA compile on a loaded machine) keeps its settings
  # (tests/test_control.py covers that); here every window decides, whatever the load.
  from rl_jax.orchestration import control
  monkeypatch.setattr(control, "stalled", lambda rows: 0.0)
  cfg = make_cfg("--config.rl.mode=async", "--config.rl.max_staleness=1",
                 "--config.rl.inflight_weight_updates=true", "--config.rl.control=admission",
                 "--config.rl.control_every=3", "--config.rl.queue_order=oldest_version",
                 # A sampler split over 4 devices decodes slowly enough on CPU that some
                 # completions span a publication (checked below); on one device the
                 # sampler finishes its admitted groups before the trainer publishes.
                 "--config.mesh.sampler.data=4")
  kv_bytes, calls, pools, taken = [], [], [], []

  def awaited(pipe):
    # rl.queue_order=oldest_version: every group the trainer takes is the first of the
    # oldest policy version queued at that moment (check_common: accounting still holds).
    get = pipe.queue.get

    def oldest_first(timeout=None):
      with pipe.queue._cv:  # reentrant: get's wait releases it; no put in between
        group = get(timeout)
        queued = pipe.queue.groups()
      if group is not None:
        taken.append(group.min_version == min(g.min_version for g in [group, *queued]))
      return group
    pipe.queue.get = oldest_first
    # The loop's executor is a process of its own (control.make_executor; it decides as
    # this process does: tests/test_control.py). Here each window's computation runs at
    # submit, in this process (where `stalled` is patched): applied at its window's end
    # whatever the load (tests/test_control.py covers a late application).
    pools.append(pipe.control.executor)

    def submit(fn, *args):
      calls.append(fn)
      future = concurrent.futures.Future()
      future.set_result(fn(*args))
      return future
    pipe.control.executor = types.SimpleNamespace(submit=submit)

  pipe, summary, rollouts = run_pipeline(
      cfg, tmp_path, on_evaluate=lambda p: kv_bytes.append(kv_bytes_per_device(p)),
      before_run=awaited)
  check_common(pipe, summary, rollouts, tmp_path, max_staleness=1)
  assert len(taken) >= cfg.rl.total_steps * cfg.rl.groups_per_step and all(taken)
  # Issue 29: the held-out evaluator borrows the sampler's pool (no second pool), so the
  # sampler devices hold at most sampler.kv_cache_bytes of KV while it evaluates.
  assert len(kv_bytes) == 3 and 0 < max(kv_bytes) <= cfg.sampler.kv_cache_bytes, kv_bytes
  # admission control: in-flight + queued + being trained never exceeds (S + 1) * B
  assert pipe.queue.policy.max_inflight == 2 * cfg.rl.groups_per_step
  # Live control (rl.control=admission) decided after step 4 (a window of 3 steps
  # after the first), within the staleness rule's range; its settings are on every row.
  lo, hi = pipe.policy.admission_range()
  decisions = summary["control_decisions"]
  assert [(d["step"], d["applied_step"]) for d in decisions] == [(4, 4)]
  assert calls == [control.compute]
  assert isinstance(pools[0], concurrent.futures.ProcessPoolExecutor)
  with pytest.raises(RuntimeError):  # run() shut the loop's control executor down
    pools[0].submit(int)
  assert all(lo <= d["admission_bound"] <= hi for d in decisions)
  assert pipe.queue.limit == decisions[-1]["admission_bound"]
  assert pipe.worker.generator.slot_limit == decisions[-1]["decode_slots"]
  rows = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
  assert all("control/admission_bound" in r for r in rows if "optim/loss" in r)
  assert [r["control/apply_lag_steps"] for r in rows if "control/apply_lag_steps" in r] == [0]
  assert summary["mode"] == "async"
  # in-flight weight updates: some completions span a publication, and every segment's
  # version was published before the completion finished
  mixed = [r for r in rollouts if r.mixed_versions]
  assert mixed, "expected rollouts generated across a weight update"
  for r in mixed:
    for v in np.unique(r.token_versions):
      assert pipe.worker.published_at[int(v)] <= r.finished


@pytest.mark.parametrize("sync_every", [1, 2])
def test_sync_trains_only_on_policy(tmp_path, sync_every):
  # rl.control=admission asks nothing of a sync run: no controller, so the run takes the
  # code path of the bit-for-bit reproducible sync run (test_resume) with control off.
  cfg = make_cfg("--config.rl.mode=sync", f"--config.rl.weight_sync_every={sync_every}",
                 "--config.rl.control=admission", "--config.rl.control_every=3")
  pipe, summary, rollouts = run_pipeline(cfg, tmp_path)
  check_common(pipe, summary, rollouts, tmp_path, max_staleness=0)
  assert pipe.control is None and pipe.queue.limit is None
  assert pipe.worker.generator.slot_limit == cfg.sampler.max_concurrent_decodes
  assert "control_decisions" not in summary
  rows = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
  assert not any(k.startswith("control/") for r in rows for k in r)
  assert set(summary["staleness_histogram"]) == {"0"}
  assert summary["rollouts_discarded_stale"] == 0
  # the barrier: nothing is generated beyond the trained batches
  assert summary["rollouts_generated"] == summary["rollouts_trained"]
  assert not any(r.mixed_versions for r in rollouts)
  # each version's groups were trained at exactly that version
  by_version = {}
  for v, gid, s in pipe.acc.trained_log:
    by_version.setdefault(v, []).append(gid)
  assert sorted(by_version) == list(range(cfg.rl.total_steps // sync_every))
  assert all(len(g) == sync_every * cfg.rl.groups_per_step for g in by_version.values())


@pytest.mark.parametrize("fault, statuses", [
    # every call hangs (no result ever comes back) / every call fails at once
    (["--config.verifier.latency=fixed", "--config.verifier.latency_mean_s=600",
      "--config.verifier.timeout_s=600"], r"results so far \{\}"),
    (["--config.verifier.failure_prob=1.0"], r"results so far \{'error': \d+\}"),
])
def test_verifier_outage_is_a_clear_error_not_a_hang(tmp_path, fault, statuses):
  # The patience clock runs only while the pipeline waits on the verifier, so neither
  # compilation nor load before the first verification counts against it.
  cfg = make_cfg("--config.rl.mode=async", "--config.verifier.retries=0",
                 "--config.rl.verifier_patience_s=2.0", "--config.rl.eval_every=0", *fault)
  with pytest.raises(loop.RunError, match=r"the verifier returned no ok result in 2s of "
                     r"waiting on it \(rl.verifier_patience_s\): \d+ calls outstanding, "
                     + statuses):
    loop.Pipeline(cfg, str(tmp_path)).run()
  assert not [t for t in threading.enumerate() if t.name == "sampler" and t.is_alive()]


def test_slow_trainer_with_a_full_queue_is_not_a_verifier_outage(tmp_path, monkeypatch):
  """The false alarm of #17: every train step outlasts the patience while the queue is
  full and admission paused; no verification is outstanding, so the run completes."""
  from rl_jax.trainer.train_step import Trainer
  original = Trainer.dispatch_step
  slow = {"n": 0}

  def slow_step(self, state, batch, **kw):
    slow["n"] += 1
    time.sleep(4.0)  # twice the patience
    return original(self, state, batch, **kw)
  monkeypatch.setattr(Trainer, "dispatch_step", slow_step)
  cfg = make_cfg("--config.rl.mode=async", "--config.rl.total_steps=2", "--config.rl.eval_every=0",
                 "--config.verifier.latency=none", "--config.rl.verifier_patience_s=2.0",
                 "--config.rl.queue_maxsize=4")
  pipe, summary, _ = run_pipeline(cfg, tmp_path)
  assert summary["optimizer_steps"] == 2 and slow["n"] == 2
  assert summary["max_queue_depth"] <= 4


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_verifier_errors_drop_the_group_and_count_it(tmp_path, mode):
  """verifier.on_error=drop (the default): groups with a failed call are not trained
  on, counted, and their admission credit returns (the run cannot stall). Long prompts
  are truncated and counted in metrics and summary.json."""
  cfg = make_cfg(f"--config.rl.mode={mode}", "--config.verifier.failure_prob=0.25",
                 "--config.verifier.retries=0", "--config.rl.total_steps=4",
                 "--config.data.max_prompt_length=6", "--config.rl.eval_every=0")
  assert cfg.verifier.on_error == "drop"
  pipe = loop.Pipeline(cfg, str(tmp_path))
  trained_statuses = []
  original = pipe.train_step

  def train_step(groups, **kw):
    trained_statuses.extend(r.verifier_status for g in groups for r in g.rollouts)
    return original(groups, **kw)
  pipe.train_step = train_step
  summary = pipe.run()
  assert summary["optimizer_steps"] == 4
  assert set(trained_statuses) == {"ok"}
  dropped = summary["groups_dropped_verifier_error"]
  assert dropped > 0 and summary["rollouts_dropped_verifier_error"] == 4 * dropped
  assert summary["groups_admitted"] == (summary["groups_trained"] + dropped +
                                        summary["groups_discarded_stale"] +
                                        summary["groups_in_flight_at_end"])
  assert summary["rollouts_in_flight_at_end"] >= 0
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  # The last step's row counts the drops up to that step; in async mode a group can still
  # be dropped between that row and the workers' stop, which only the summary counts.
  assert 0 < rows[-2]["data/groups_dropped_verifier_error"] <= dropped
  # The held-out set and the prompt stream report their truncated prompts.
  assert summary["prompts_truncated"] > 0 and summary["heldout_prompts_truncated"] > 0
  assert summary["prompts_dropped"] == summary["heldout_prompts_dropped"] == 0
  assert rows[-2]["data/prompts_truncated"] > 0


def test_verifier_errors_reward_zero_when_asked(tmp_path):
  cfg = make_cfg("--config.rl.mode=async", "--config.verifier.failure_prob=0.25",
                 "--config.verifier.retries=0", "--config.rl.total_steps=2",
                 "--config.verifier.on_error=zero", "--config.rl.eval_every=0")
  pipe, summary, rollouts = run_pipeline(cfg, tmp_path)
  assert summary["groups_dropped_verifier_error"] == 0
  assert any(r.verifier_status == "error" and r.reward == 0 for r in rollouts)


def test_worker_thread_error_stops_the_run(tmp_path, monkeypatch):
  from rl_jax.sampler import generator
  calls = {"n": 0}
  original = generator.Generator.step

  def failing_step(self):
    calls["n"] += 1
    if calls["n"] > 5:
      raise RuntimeError("decode exploded")
    return original(self)
  monkeypatch.setattr(generator.Generator, "step", failing_step)
  cfg = make_cfg("--config.rl.mode=async", "--config.rl.eval_every=0")
  with pytest.raises(loop.RunError, match="^a worker thread failed: RuntimeError: decode exploded"):
    loop.Pipeline(cfg, str(tmp_path)).run()
  assert not [t for t in threading.enumerate() if t.name == "sampler" and t.is_alive()]


def test_calculator_tool_episodes_end_to_end(tmp_path):
  """configs/calculator.py in miniature: episodes park at tool calls and resume with the
  tool's answer. Every observation in every rollout is the calculator's answer to the
  call before it (recomputed here), carries no log-prob or version, and the trainer's
  token count is the trained rollouts' model tokens only. Episodes are filtered like
  single-turn rollouts (rl.filter_groups=zero_variance): a trained group with equal
  rewards was trained only because the step's filter budget ran out."""
  from rl_jax.model.tokenizer import CharTokenizer
  from rl_jax.tasks.calculator import evaluate_call, observation
  cfg, _ = config_lib.parse_args([
      "--config", os.path.join(ROOT, "configs/calculator.py"), "--config.rl.total_steps=2",
      "--config.rl.groups_per_step=2", "--config.rl.group_size=4", "--config.rl.eval_every=0",
      "--config.task.heldout_size=4", "--config.task.tool_demo_fraction=1.0",
      "--config.warmstart.steps=40", "--config.warmstart.batch_size=16",
      "--config.sampler.max_concurrent_decodes=4", "--config.sampler.page_size=64",
      "--config.trainer.length_buckets=(64,)",
      "--config.env.tool.latency=fixed", "--config.env.tool.latency_mean_s=0.01",
      "--config.rl.filter_groups=zero_variance", "--config.rl.max_oversample=2",
      "--config.metrics.console=false", "--config.metrics.tensorboard=false"])
  pipe, summary, rollouts = run_pipeline(config_lib.validate(cfg), tmp_path)
  rewards = {}
  for r in rollouts:
    rewards.setdefault(r.group_id, set()).add(r.reward)
  trained_uniform = sum(len(rewards[gid]) == 1 for _, gid, _ in pipe.acc.trained_log)
  assert summary["groups_uniform_capped"] == trained_uniform
  assert summary["groups_admitted"] == (
      summary["groups_trained"] + summary["groups_discarded_stale"] +
      summary["groups_filtered_zero_variance"] + summary["groups_in_flight_at_end"])
  tok = CharTokenizer()
  observations = 0
  for r in rollouts:
    model = r.model_token_mask
    assert r.model_mask is not None and r.num_turns >= 1
    assert np.all(r.token_versions[~model] == -1) and np.all(r.behavior_logprobs[~model] == 0)
    assert np.all(r.token_versions[model] >= 0) and np.all(r.behavior_logprobs[model] <= 0)
    edges = np.flatnonzero(np.diff(np.concatenate([[1], model.astype(int), [1]])))
    for begin, end in zip(edges[::2], edges[1::2]):  # each observation: [begin, end)
      call = tok.decode(r.completion_tokens[:begin]).rpartition("</calc>")
      assert call[1] and not call[2], "an observation follows a closing tag"
      try:
        want = observation(evaluate_call(call[0].rpartition("<calc>")[2]))
      except ValueError:
        want = observation(None)
      got = tok.decode(r.completion_tokens[begin:end])
      assert got == want or (r.finish_reason == "length" and end == r.num_tokens and
                             want.startswith(got))
      observations += 1
  assert observations > 0
  errors = sum(r.completion_text.count(observation(None)) for r in rollouts)
  assert summary["tool_calls"] >= observations and summary["tool_failures"] >= errors
  assert summary["heldout_tool_call_rate_initial"] > 0
  assert len(summary["heldout_tool_call_rate_curve"]) == 2
  trained = {gid for _, gid, _ in pipe.acc.trained_log}
  model_tokens = sum(int(r.model_token_mask.sum()) for r in rollouts if r.group_id in trained)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert sum(r["optim/tokens"] for r in rows if "optim/tokens" in r) == model_tokens
  assert all("env/tool_calls_mean" in r and "latency/tool_p99" in r
             for r in rows if "optim/loss" in r)


def _patch_rewards(pipe, reward):
  """Every verifier result's reward becomes reward(group_id, sample_index)."""
  import dataclasses
  from rl_jax.tasks.base import make_reward
  submit = pipe.pool.submit

  def patched(key, example, text, callback=None):
    def rescore(k, result):
      value = reward(*k)
      callback(k, dataclasses.replace(
          result, value=make_reward(correct=value, format_ok=0.0, format_reward=0.0)))
    submit(key, example, text, callback=rescore)
  pipe.pool.submit = patched


@pytest.mark.parametrize("mode,oversample", [("sync", 2), ("async", 4)])
def test_zero_variance_groups_are_filtered_and_replaced(tmp_path, mode, oversample):
  """rl.filter_groups=zero_variance: groups whose rewards are all equal (here every group
  whose id is not a multiple of 3) are not trained unless the step's filter budget,
  (max_oversample - 1) x groups_per_step, ran out; each is counted and its credit returned
  (the async run finishes: no stall); the budget's overflow is counted and warned once.
  Sync also masks truncated completions out of the loss (rl.overlong=mask), counted."""
  cfg = make_cfg(f"--config.rl.mode={mode}", "--config.rl.total_steps=3",
                 "--config.rl.eval_every=0", "--config.rl.filter_groups=zero_variance",
                 f"--config.rl.max_oversample={oversample}",
                 f"--config.rl.overlong={'mask' if mode == 'sync' else 'none'}")
  pipe = loop.Pipeline(cfg, str(tmp_path))
  _patch_rewards(pipe, lambda gid, i: float(i % 2) if gid % 3 == 0 else 0.5)
  trained, warnings, truncated = [], [], []
  original = pipe.train_step

  def train_step(groups, **kw):
    trained.append([g.group_id for g in groups])
    truncated.extend(r.finish_reason == "length" for g in groups for r in g.rollouts)
    for g in groups:
      assert len({r.reward for r in g.rollouts}) == (2 if g.group_id % 3 == 0 else 1)
    return original(groups, **kw)
  pipe.train_step = train_step
  pipe.console.message = warnings.append
  summary = pipe.run()
  assert summary["optimizer_steps"] == 3 and all(len(b) == 4 for b in trained)
  uniform_trained = sum(gid % 3 != 0 for b in trained for gid in b)
  # (async: the sampler keeps going until the run stops; capped groups then wait queued)
  left = sum(g.group_id % 3 != 0 for g in pipe.queue.groups())
  assert summary["groups_uniform_capped"] == uniform_trained + left
  filtered = summary["groups_filtered_zero_variance"]
  assert filtered > 0 and summary["rollouts_filtered_zero_variance"] == 4 * filtered
  assert summary["groups_admitted"] == (summary["groups_trained"] + filtered +
                                        summary["groups_discarded_stale"] +
                                        summary["groups_in_flight_at_end"])
  assert summary["rollouts_in_flight_at_end"] >= 0
  assert sum("rl.max_oversample" in w for w in warnings) == min(uniform_trained, 1)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert rows[-2]["data/groups_filtered_zero_variance"] <= filtered
  assert uniform_trained <= rows[-2]["data/groups_uniform_capped"] <= uniform_trained + left
  accepted = [0] + [r["staleness/accepted"] for r in rows[:-1]]
  assert sum(r["data/sampled_per_trained"] * (b - a) for r, a, b in zip(
      rows, accepted, accepted[1:])) == pytest.approx(rows[-2]["data/groups_admitted"])
  if mode == "sync":
    # Per step: ids 3k..: the window filters uniform groups in id order until the budget
    # (4) is spent, admitting replacements at the same version; the rest are trained.
    assert trained == [[0, 3, 6, 7], [9, 12, 14, 15], [18, 21, 22, 23]]
    assert filtered == rows[-2]["data/groups_filtered_zero_variance"] == 12
    assert summary["groups_admitted"] == 24 and left == 0
    assert summary["rollouts_overlong_masked"] == sum(truncated) > 0
    assert rows[-2]["lengths/overlong_masked_total"] == sum(truncated)
  else:
    assert summary["rollouts_overlong_masked"] == 0

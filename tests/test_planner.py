"""Tests of rl_jax.planner: queueing against closed forms, the sync barrier, the seed's
eight-GPU exercise, memory arithmetic of the real presets, profile fitting, the CLI."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from rl_jax import config as config_lib
from rl_jax import planner
from rl_jax.planner import capacity, memory, profile as profile_lib
from rl_jax.planner.models import (DEVICES, LengthModel, SamplerModel, TrainerModel, TurnModel,
                                   VerifierModel)
from rl_jax.tasks.latency import Latency

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Every field the planner reads, pinned to one small workload: configs/default.py is tuned
# for CPU runs and may change, and no expectation here should move with it. Tests set
# what they depend on again explicitly; later overrides win.
PINNED = (
    "--config.seed=0", "--config.model.preset=tiny_char", "--config.model.path=",
    "--config.model.dtype=float32", "--config.mesh.colocated=false",
    "--config.mesh.sampler.data=4", "--config.mesh.sampler.tensor=1",
    "--config.mesh.trainer.data=4", "--config.mesh.trainer.fsdp=1",
    "--config.mesh.trainer.tensor=1", "--config.sampler.max_concurrent_decodes=64",
    "--config.sampler.page_size=16", "--config.sampler.num_pages=0",
    "--config.sampler.kv_cache_bytes=67108864", "--config.sampler.max_prefill_length=64",
    "--config.sampler.max_new_tokens=32", "--config.sampler.dtype=float32",
    "--config.sampler.steps_per_call=1", "--config.data.max_prompt_length=64",
    "--config.trainer.length_buckets=(64, 128, 256, 512, 1024, 2048, 4096)",
    "--config.trainer.micro_batch_size=0", "--config.trainer.num_minibatches=1",
    "--config.trainer.kl_beta=0.0", "--config.rl.mode=async", "--config.rl.total_steps=100",
    "--config.rl.groups_per_step=16", "--config.rl.group_size=8",
    "--config.rl.max_staleness=2", "--config.rl.max_inflight_groups=-1",
    "--config.rl.queue_maxsize=64", "--config.rl.weight_sync_every=1",
    "--config.rl.inflight_weight_updates=true", "--config.verifier.workers=8",
    "--config.verifier.timeout_s=5.0", "--config.verifier.retries=1",
    "--config.verifier.failure_prob=0.0", "--config.verifier.latency=lognormal",
    "--config.verifier.latency_mean_s=0.05", "--config.verifier.latency_sigma=1.5")


def _cfg(*overrides):
  cfg, rest = config_lib.parse_args(["--config", os.path.join(ROOT, "configs/default.py"),
                                     *PINNED, *overrides])
  assert rest == []
  return cfg


def _scenario(**kw):
  base = dict(
      mode="async", groups_per_step=8, group_size=8, max_staleness=2, max_inflight_groups=24,
      queue_maxsize=64, weight_sync_every=1, inflight_weight_updates=True, num_steps=60,
      prompt_tokens=16, length_buckets=(64, 128, 256, 512, 1024), batch_multiple=1,
      lengths=LengthModel(kind="lognormal", max_tokens=512, median=100, sigma=0.5),
      verifier=VerifierModel(latency=Latency(kind="none"), workers=8),
      sampler=SamplerModel(base_s=0.01, per_seq_s=0.0, per_ctx_token_s=0.0),
      sampler_replicas=1, decode_slots=64,
      trainer=TrainerModel(fixed_s=0.1, tokens_per_s_per_device=1e5), trainer_devices=1,
      weight_sync_s=0.01)
  base.update(kw)
  return planner.Scenario(**base)


def test_length_draws_of_a_very_wide_refit_do_not_overflow():
  """A refit sigma can be very large; the lognormal draw must not overflow exp, and
  draws follow the NumPy formula exp(ln m + sigma z) (1 + d)^k clipped to [1, max]."""
  for sigma, drift, step in ((400.0, 0.0, 0), (0.7, 0.01, 30), (0.7, -0.02, 10)):
    lm = LengthModel(kind="lognormal", max_tokens=24, median=6, sigma=sigma,
                     drift_per_step=drift)
    with np.errstate(over="raise"):
      got = lm.sample(np.random.default_rng(5), 4000, step=step)
    z = np.random.default_rng(5).standard_normal(4000)
    with np.errstate(over="ignore"):
      ref = np.exp(np.log(6) + sigma * z) * (1 + drift) ** step
    np.testing.assert_array_equal(got, np.clip(np.rint(ref), 1, 24))
    assert got.min() >= 1 and got.max() <= 24


@pytest.mark.parametrize("servers", [1, 3])
def test_server_pool_matches_mmc_wait(servers):
  """Poisson arrivals (rate lam), exponential service (rate mu), c servers, FIFO: the
  mean wait in line is Erlang C's, Wq = C(c, a) / (c mu - lam), a = lam / mu,
  C = (a^c / c!) (c / (c - a)) / (sum_{k<c} a^k / k! + (a^c / c!) (c / (c - a)))."""
  lam, mu, n = 0.5 * servers, 1.0, 60000
  rng = np.random.default_rng(0)
  arrivals = np.cumsum(rng.exponential(1 / lam, n))
  pool = planner.ServerPool(servers)
  service = rng.exponential(1 / mu, n)
  finish = [pool.arrive(t, s) for t, s in zip(arrivals, service)]
  a, c = lam / mu, servers
  top = a**c / math.factorial(c) * c / (c - a)
  erlang_c = top / (sum(a**k / math.factorial(k) for k in range(c)) + top)
  expected = erlang_c / (c * mu - lam)
  assert pool.started == n
  assert pool.mean_wait_s == pytest.approx(expected, rel=0.06)
  # Each finish is its start (arrival, or a server freeing) plus its own service.
  waits = np.asarray(finish) - arrivals - service
  assert waits.min() >= -1e-9 and np.mean(waits) == pytest.approx(pool.mean_wait_s)
  with pytest.raises(ValueError, match=">= 1 server"):
    planner.ServerPool(0)


@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_sync_barrier_time_is_expected_max_length(steps_per_call):
  """One decode step = 1 s, every sequence has a slot, instant verify/train/sync: a sync
  step lasts the longest of groups_per_step * G completion lengths, rounded up to a
  whole generate call of steps_per_call steps."""
  lengths = LengthModel(kind="lognormal", max_tokens=10_000, median=20, sigma=0.5)
  sc = _scenario(
      mode="sync", groups_per_step=4, group_size=8, num_steps=400, lengths=lengths,
      decode_slots=32, prompt_tokens=1, length_buckets=(100_000,),
      sampler=SamplerModel(base_s=1.0, per_seq_s=0.0, per_ctx_token_s=0.0),
      trainer=TrainerModel(fixed_s=0.0, tokens_per_s_per_device=1e15), weight_sync_s=0.0,
      steps_per_call=steps_per_call)
  pred = planner.simulate(sc)
  rng = np.random.default_rng(123)
  maxima = np.array([lengths.sample(rng, 32).max() for _ in range(20000)])
  expected = np.mean(-(-maxima // steps_per_call) * steps_per_call)
  assert pred.wall_s / pred.optimizer_steps == pytest.approx(expected, rel=0.04)
  assert pred.sampler_tokens_per_s * pred.wall_s == pytest.approx(
      sum(r["sampler/tokens_per_s"] * (r["time_s"] - p["time_s"])
          for p, r in zip([{"time_s": 0.0}] + pred.rows[:-1], pred.rows)))
  assert pred.staleness_histogram == {0: 400 * 4}
  assert pred.discard_rate == 0.0


def _exercise_profile():
  """A workload where one sampler replica makes about 10 rollouts/s and the trainer
  consumes 256-rollout batches at about 170 rollouts/s on five devices, 40 on one."""
  return planner.Profile(
      sampler=SamplerModel(base_s=0.02, per_seq_s=0.0, per_ctx_token_s=0.0),
      trainer=TrainerModel(fixed_s=0.1, tokens_per_s_per_device=2e4),
      lengths=LengthModel(kind="lognormal", max_tokens=512, median=150, sigma=0.4),
      verifier_latency=Latency(kind="none"), weight_sync_s=0.05, prompt_tokens=50,
      sampler_tensor=1, notes=[])


def test_eight_gpu_exercise_starved_and_overproducing_splits():
  # Every field capacity.scenario reads is set here, so the embedded default's tuning
  # (which may change) does not move the expectations.
  cfg = _cfg("--config.model.preset=tiny_char", "--config.seed=0",
             "--config.mesh.colocated=false", "--config.mesh.sampler.data=1",
             "--config.mesh.sampler.tensor=1", "--config.mesh.trainer.data=1",
             "--config.mesh.trainer.fsdp=1", "--config.mesh.trainer.tensor=1",
             "--config.sampler.max_concurrent_decodes=32", "--config.sampler.max_new_tokens=512",
             "--config.sampler.kv_cache_bytes=1073741824", "--config.sampler.num_pages=0",
             "--config.sampler.dtype=float32", "--config.sampler.steps_per_call=1",
             "--config.trainer.length_buckets=(64, 128, 256, 512, 1024, 2048, 4096)",
             "--config.trainer.micro_batch_size=0", "--config.trainer.num_minibatches=1",
             "--config.rl.mode=async", "--config.rl.groups_per_step=32",
             "--config.rl.group_size=8", "--config.rl.max_staleness=2",
             "--config.rl.max_inflight_groups=160", "--config.rl.queue_maxsize=160",
             "--config.rl.weight_sync_every=1", "--config.rl.inflight_weight_updates=true",
             "--config.rl.total_steps=40", "--config.verifier.workers=8",
             "--config.verifier.timeout_s=5.0", "--config.verifier.retries=1",
             "--config.verifier.failure_prob=0.0")
  model_cfg, params = capacity.model_shape(cfg)
  prof = _exercise_profile()

  def run(s, t):
    sc = capacity.scenario(cfg, layout=capacity.Layout(s, t), profile=prof, model_cfg=model_cfg,
                           params=params, device=DEVICES["h200"], num_steps=40)
    return sc, planner.simulate(sc)

  sc, starved = run(3, 5)
  assert planner.diagnose(starved, sc) == "trainer-starved"
  assert starved.queue_depth_mean < 32 / 4 and starved.trainer_busy_frac < 0.5
  assert starved.sampler_busy_frac > 0.9 and starved.discard_rate == 0.0
  assert starved.staleness_mean < 1.0
  sc, over = run(7, 1)
  assert planner.diagnose(over, sc) == "overproducing"
  assert over.queue_depth_mean > 32 and over.trainer_busy_frac > 0.9
  assert over.discard_rate > 0.1 and over.staleness_mean > starved.staleness_mean


def test_memory_arithmetic_of_real_presets():
  from rl_jax.model import presets
  qwen = presets.get_preset("qwen2_0_5b")
  assert presets.num_params(qwen) == 494_032_768
  assert memory.kv_bytes_per_token(num_layers=24, num_kv_heads=2, head_dim=64,
                                   dtype="bfloat16") == 2 * 24 * 2 * 64 * 2 == 12_288
  llama = presets.get_preset("llama3_8b")
  assert memory.kv_bytes_per_token(num_layers=llama.num_layers, num_kv_heads=llama.num_kv_heads,
                                   head_dim=llama.head_dim, dtype="bfloat16") == 131_072
  # Every field memory.estimate reads is set here (not left to the default's tuning).
  cfg = _cfg("--config.model.preset=qwen2_0_5b", "--config.sampler.dtype=bfloat16",
             "--config.model.dtype=bfloat16", "--config.sampler.kv_cache_bytes=1073741824",
             "--config.sampler.num_pages=0", "--config.data.max_prompt_length=64",
             "--config.sampler.max_new_tokens=64",
             "--config.trainer.length_buckets=(64, 128, 256, 512, 1024, 2048, 4096)",
             "--config.trainer.micro_batch_size=4", "--config.trainer.kl_beta=0.0",
             "--config.rl.groups_per_step=16", "--config.rl.group_size=8")
  est = memory.estimate(cfg=cfg, model_cfg=qwen, params=494_032_768, sampler_tensor=1,
                        trainer_devices=4, trainer_tensor=1, memory_gib=139)
  weights = 494_032_768 * 2
  assert est.weight_bytes_sampler == weights == 988_065_536
  assert est.sampler_bytes == 2 * weights + 2**30  # one KV pool: the evaluator borrows it
  assert est.kv_tokens_per_replica == 2**30 // 12_288
  # Activations: rows = 4 / 4 shards = 1, length bucket 128, bf16 (b = 2):
  # layer (4*896 + 2*14*64 + 2*2*64 + 4*4864) * 2 + 14*128*(4 + 2) = 60_928,
  # logits 151_936 * (2 + 4) = 911_616; per token 24 * 60_928 + 911_616 = 2_373_888.
  assert est.activation_bytes == 128 * 2_373_888
  state = 494_032_768 * (4 + 4 + 8 + 2)  # fp32 params, grads, AdamW mu + nu, bf16 staging
  assert est.trainer_bytes == state // 4 + 128 * 2_373_888
  assert est.fits


def test_memory_arithmetic_with_lora():
  from rl_jax.model import presets
  n = 494_032_768
  cfg = _cfg("--config.model.preset=qwen2_0_5b", "--config.sampler.dtype=bfloat16",
             "--config.model.dtype=bfloat16", "--config.model.param_dtype=bfloat16",
             "--config.sampler.kv_cache_bytes=1073741824", "--config.sampler.num_pages=0",
             "--config.data.max_prompt_length=64", "--config.sampler.max_new_tokens=64",
             "--config.trainer.length_buckets=(64, 128, 256, 512, 1024, 2048, 4096)",
             "--config.trainer.micro_batch_size=4", "--config.trainer.kl_beta=0.001",
             "--config.rl.groups_per_step=16", "--config.rl.group_size=8",
             "--config.model.lora.rank=8")
  model_cfg, params = capacity.model_shape(cfg)
  assert params == n and model_cfg.lora_rank == 8 and len(model_cfg.lora_targets) == 7
  # Qwen2-0.5B: d 896, q/o 896 x 896, k/v 896 x 128, gate/up/down 896 x 4864, 24 layers.
  # Adapters r (in + out): 8 * (2 * 1792 + 2 * 1024 + 3 * 5760) = 183_296 per layer.
  # Targets in * out: 2 * 802_816 + 2 * 114_688 + 3 * 4_358_144 = 14_909_440 per layer.
  adapters, targets = 24 * 183_296, 24 * 14_909_440
  assert memory.lora_sizes(model_cfg) == (adapters, targets) == (4_399_104, 357_826_560)
  est = memory.estimate(cfg=cfg, model_cfg=model_cfg, params=n, sampler_tensor=1,
                        trainer_devices=4, trainer_tensor=1, memory_gib=139)
  # Sampler: the bf16 base once, merged targets + adapters for generator and evaluator.
  assert est.sampler_bytes == n * 2 + 2 * (targets + adapters) * 2 + 2**30
  # Activations: test_memory_arithmetic_of_real_presets' 60_928 per layer plus x A of
  # 7 targets, 7 * 8 * 2 = 112: per token 24 * 61_040 + 911_616 = 2_376_576.
  assert est.activation_bytes == 128 * 2_376_576
  # Trainer: the frozen bf16 base (also the KL reference: no copy), fp32 adapter master,
  # grads, AdamW mu + nu, bf16 staging: about 1/8 of full fine-tuning's state.
  assert est.trainer_bytes == (n * 2 + adapters * (4 + 4 + 8 + 2)) // 4 + 128 * 2_376_576
  assert (est.sampler_weights_bytes, est.kv_pool_bytes, est.trainer_state_bytes) == (
      n * 2 + 2 * (targets + adapters) * 2, 2**30, (n * 2 + adapters * 18) // 4)
  full = memory.estimate(cfg=cfg, model_cfg=presets.get_preset("qwen2_0_5b"), params=n,
                         sampler_tensor=1, trainer_devices=4, trainer_tensor=1, memory_gib=139)
  assert full.trainer_bytes == n * (4 + 4 + 8 + 2 + 2) // 4 + 128 * 2_373_888


def test_lora_lets_a_plan_fit_and_shrinks_its_weight_sync():
  args = ("--config.model.preset=llama3_8b", "--config.sampler.dtype=bfloat16",
          "--config.model.dtype=bfloat16", "--config.mesh.trainer.fsdp=1",
          "--config.mesh.trainer.tensor=1", "--config.rl.groups_per_step=2",
          "--config.rl.group_size=2", "--config.sampler.max_concurrent_decodes=4",
          "--config.mesh.sampler.data=1")
  cfg = _cfg(*args, "--config.model.param_dtype=bfloat16", "--config.model.lora.rank=16")
  model_cfg, params = capacity.model_shape(cfg)
  mem, reason = capacity.check_layout(cfg, layout=capacity.Layout(1, 1), model_cfg=model_cfg,
                                      params=params, memory_gib=80)
  # 8.03e9 params: 16 GB of bf16 base instead of 145 GB of fp32 state.
  assert reason == "" and mem.trainer_bytes < 20 * 2**30
  full_cfg, _ = capacity.model_shape(_cfg(*args))
  sync = {}
  for name, c, mc in (("lora", cfg, model_cfg), ("full", _cfg(*args), full_cfg)):
    sc = capacity.scenario(c, layout=capacity.Layout(1, 1), profile=None, model_cfg=mc,
                           params=params, device=planner.DEVICES["h200"], num_steps=5)
    sync[name] = sc.weight_sync_s
  adapters, targets = memory.lora_sizes(model_cfg)
  h200 = planner.DEVICES["h200"]
  assert sync["lora"] == pytest.approx(0.01 + adapters * 2 / h200.link_bytes_per_s
                                       + 2 * targets * 2 / h200.hbm_bytes_per_s)
  assert sync["full"] == pytest.approx(0.01 + params * 2 / h200.link_bytes_per_s)


def test_plan_rejects_layouts_that_do_not_fit_memory():
  cfg = _cfg("--config.model.preset=llama3_8b", "--config.sampler.dtype=bfloat16",
             "--config.model.dtype=bfloat16", "--config.mesh.trainer.fsdp=1",
             "--config.mesh.trainer.tensor=1", "--config.rl.total_steps=5",
             "--config.rl.groups_per_step=2", "--config.rl.group_size=2",
             "--config.sampler.max_concurrent_decodes=4", "--config.mesh.sampler.data=1")
  result = planner.plan(cfg, devices=2, memory_gib=80)
  one_trainer = next(c for c in result.candidates if c.layout == capacity.Layout(1, 1))
  # 8.03e9 params * 18 bytes = 145 GB of trainer state on one 80 GiB device.
  assert one_trainer.rejected.startswith("trainer needs")
  assert result.recommended is None


def _write_workdir(path, cfg, rows, summary):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
    f.write(json.dumps({"step": rows[-1]["step"], "reward/heldout": 0.5}) + "\n")
  with open(os.path.join(path, "summary.json"), "w") as f:
    json.dump(summary, f)
  with open(os.path.join(path, "config.json"), "w") as f:
    f.write(cfg.to_json())


def test_profile_fit_recovers_known_models(tmp_path):
  """Rows written from known models: step time 0.01 + 1e-4 * active (one replica),
  train step 0.2 s + padded tokens / 40k, lognormal lengths (median 40, sigma 0.5)
  and verifier latencies (median 0.1 s, sigma 1.0). `active` counts the slots held,
  which is the sequences emitting tokens times (mean length + 1) / mean length (one
  call of one step held after the last token), mean length 40 e^(0.5^2 / 2)."""
  # One sampler replica and one trainer device, and every other field fit_profile reads,
  # set here rather than inherited from the default's tuning.
  cfg = _cfg("--config.mesh.sampler.data=1", "--config.mesh.sampler.tensor=1",
             "--config.mesh.trainer.data=1", "--config.mesh.trainer.fsdp=1",
             "--config.mesh.trainer.tensor=1", "--config.sampler.max_new_tokens=512",
             "--config.sampler.steps_per_call=1", "--config.rl.weight_sync_every=1",
             "--config.rl.groups_per_step=16", "--config.rl.group_size=8",
             "--config.verifier.latency=lognormal", "--config.verifier.latency_mean_s=0.05",
             "--config.verifier.latency_sigma=1.5")
  z90, z95, z99 = 1.2816, 1.6449, 2.3263
  occupancy = profile_lib.slot_occupancy(40 * math.exp(0.5 ** 2 / 2), 1)
  assert occupancy == pytest.approx(46.33 / 45.33, rel=1e-3)
  rows, t, s_busy, t_busy = [], 0.0, 0.0, 0.0
  for step in range(1, 31):
    active = 16 + 8 * (step % 4)
    decode_steps = 50  # one decode step per generate call (sampler.steps_per_call = 1)
    padded = 128 * (64 if step % 2 else 128)
    train = 0.2 + padded / 4e4
    sample = decode_steps * (0.01 + 1e-4 * active)
    dt = train + 0.05 + 0.3
    t += dt
    s_busy += sample
    t_busy += train + 0.05
    rows.append({
        "step": step, "time_s": t, "sampler/busy_frac": s_busy / t,
        "trainer/busy_frac": t_busy / t,
        "sampler/tokens_per_s": active / occupancy * decode_steps / dt,
        "sampler/generate_calls": decode_steps * step, "sampler/mean_context": 60.0,
        "trainer/padded_tokens": padded, "weight_sync/duration_s": 0.05,
        "queue/depth": 1, "staleness/mean": 1.0,
        "lengths/p50": 40.0, "lengths/p90": 40 * math.exp(0.5 * z90),
        "latency/verifier_service_p50": 0.1,
        "latency/verifier_service_p95": 0.1 * math.exp(z95),
        "latency/verifier_service_p99": 0.1 * math.exp(z99),
        "latency/verifier_p50": 0.3})  # with pool queueing: not the service time
  _write_workdir(str(tmp_path), cfg, rows, {"weight_sync_s_mean": 0.05, "prompt_tokens_mean": 20})
  pilot = profile_lib.load_pilot(str(tmp_path))
  prof = profile_lib.fit_profile(pilot, scaling_efficiency=0.9)
  assert not prof.needs_calibration
  assert prof.sampler.base_s == pytest.approx(0.01, rel=1e-6)
  # The fit's mean length is that of 4096 draws: within 1% of the formula's, so the
  # occupancy (and per_seq_s) within 2e-4.
  assert prof.sampler.per_seq_s == pytest.approx(1e-4, rel=1e-3)
  assert prof.sampler.per_ctx_token_s == pytest.approx(0.0, abs=1e-9)
  assert prof.trainer.fixed_s == pytest.approx(0.2, rel=1e-6)
  assert prof.trainer.tokens_per_s_per_device == pytest.approx(4e4, rel=1e-6)  # one device
  assert prof.lengths.median == pytest.approx(40.0)
  assert prof.lengths.sigma == pytest.approx(0.5, rel=1e-3)
  assert prof.lengths.drift_per_step == 0.0
  assert prof.verifier_latency.sigma == pytest.approx(1.0, rel=1e-3)
  assert prof.verifier_latency.mean_s == pytest.approx(0.1 * math.exp(0.5), rel=1e-3)
  assert prof.prompt_tokens == 20 and prof.weight_sync_s == 0.05
  # Without service-time percentiles the pilot's injected latency is the service time.
  for r in pilot.rows:
    for q in (50, 95, 99):
      del r[f"latency/verifier_service_p{q}"]
  configured = profile_lib.fit_verifier(pilot, [])
  assert (configured.kind, configured.mean_s, configured.sigma) == ("lognormal", 0.05, 1.5)


@pytest.mark.parametrize("mode,drop", [
    ("async", ()),
    ("sync", ("sampler/generate_calls", "trainer/step_time_s", "trainer/padded_tokens",
              "latency/verifier_service_p50", "latency/verifier_service_p95",
              "latency/verifier_service_p99")),
])
def test_validate_round_trip_on_simulated_pilot(tmp_path, mode, drop):
  """A pilot simulated from known models, written as a workdir (without the optional
  metrics in `drop`), is fitted and re-predicted within 20% on every compared metric."""
  # Without service-time percentiles (sync) the fit takes the configured latency: the
  # same distribution as the truth's.
  cfg = _cfg(f"--config.rl.mode={mode}", "--config.rl.total_steps=60",
             "--config.verifier.latency=lognormal", "--config.verifier.latency_mean_s=0.05",
             "--config.verifier.latency_sigma=1.5")
  truth = planner.Profile(
      sampler=SamplerModel(base_s=4e-3, per_seq_s=2e-5, per_ctx_token_s=1e-7),
      trainer=TrainerModel(fixed_s=0.05, tokens_per_s_per_device=5e4),
      lengths=LengthModel(kind="lognormal", max_tokens=32, median=6, sigma=0.4),
      verifier_latency=Latency(kind="lognormal", mean_s=0.05, sigma=1.5), weight_sync_s=0.02,
      prompt_tokens=8, sampler_tensor=1, notes=[])
  model_cfg, params = capacity.model_shape(cfg)
  sc = capacity.scenario(cfg, layout=capacity.pilot_layout(cfg), profile=truth,
                         model_cfg=model_cfg, params=params, device=DEVICES["h200"], num_steps=60)
  rows = [{k: v for k, v in r.items() if k not in drop} for r in planner.simulate(sc).rows]
  _write_workdir(str(tmp_path), cfg, rows, {"weight_sync_s_mean": 0.02, "prompt_tokens_mean": 8})
  pilot, prof = planner.load_profile(str(tmp_path), flag="--validate")
  assert prof.needs_calibration is False
  table = planner.validate(pilot, prof)
  assert [r["metric"] for r in table][:5] == ["steps_per_hour", "queue_depth_mean",
                                             "staleness_mean", "sampler_busy_frac",
                                             "trainer_busy_frac"]
  for r in table:
    if r["rel_err"] is None:
      assert r["predicted"] == pytest.approx(r["observed"], abs=0.05), r
    else:
      assert abs(r["rel_err"]) < 0.2, r
  text = planner.format_validation(table)
  assert "steps_per_hour" in text and "%" in text


@pytest.mark.parametrize("timeout_s", [math.inf, 0.15])
def test_service_times_follow_the_retry_model(timeout_s):
  """A call of base b + fixed latency m fails with probability p (or at the timeout T,
  taking T) and is retried r times: E[service] = min(b + m, T) (1 + q + ... + q^r), q
  the probability an attempt fails (p, or 1 when b + m >= T). The vectorised draws and
  the one-at-a-time ones follow it."""
  b, m, p, r = 0.1, 0.1, 0.3, 2
  model = VerifierModel(latency=Latency(kind="fixed", mean_s=m), workers=1, base_s=b,
                        timeout_s=timeout_s, failure_prob=p, retries=r)
  attempt, q = min(b + m, timeout_s), (1.0 if b + m >= timeout_s else p)
  expected = attempt * sum(q**k for k in range(r + 1))
  many = model.service_times(np.random.default_rng(0), 40000)
  rng = np.random.default_rng(1)
  one = [model.service_s(rng) for _ in range(20000)]
  assert many.mean() == pytest.approx(expected, rel=0.02)
  assert np.mean(one) == pytest.approx(expected, rel=0.02)
  # Every draw is a whole number of attempts, at most r + 1.
  attempts = many / attempt
  np.testing.assert_allclose(attempts, np.rint(attempts), atol=1e-9)
  assert set(np.rint(attempts).astype(int)) <= set(range(1, r + 2))


def test_inflight_limit_trades_discards_for_freshness():
  """With the default limit (S + 1) * B a fast sampler admits groups that are consumed
  up to S + 1 versions later; a limit of B keeps staleness lower and discards fewer."""
  verifier = VerifierModel(latency=Latency(kind="lognormal", mean_s=0.05, sigma=1.5), workers=8)
  wide = planner.simulate(_scenario(verifier=verifier, max_inflight_groups=24))
  narrow = planner.simulate(_scenario(verifier=verifier, max_inflight_groups=8))
  assert wide.discard_rate > narrow.discard_rate
  assert wide.staleness_mean > narrow.staleness_mean
  assert max(wide.staleness_histogram) <= 2 and max(narrow.staleness_histogram) <= 2


def test_admission_counts_groups_held_by_the_trainer():
  """loop.py's RolloutQueue counts dequeued groups (held) against max_inflight_groups
  until their step is trained and published: with a slow trainer and a limit of one
  batch, the sampler waits for each publication, so nothing queues behind the batch
  being trained and the sampler idles while the trainer works."""
  slow = TrainerModel(fixed_s=10.0, tokens_per_s_per_device=1e9)
  pred = planner.simulate(_scenario(trainer=slow, max_inflight_groups=8, num_steps=20))
  # The queue never holds a second batch while one trains, and nothing is stale.
  assert pred.queue_depth_max <= 8
  assert pred.staleness_mean == 0 and pred.discard_rate == 0
  assert pred.sampler_busy_frac < 0.5 and pred.trainer_busy_frac > 0.6


def test_fit_leaves_out_compile_steps_and_weights_sampler_rows(tmp_path):
  """A synthetic pilot whose train step is 0.1 s + tokens / 1e5 except the first step at
  a new batch shape, which also compiles for 5 s; decode steps of 0.02 s, with rows of
  very different decode-step counts. The fit recovers the step models, compile_s, and
  the same total sampler busy time."""
  cfg = _cfg("--config.mesh.sampler.data=1", "--config.mesh.sampler.tensor=1",
             "--config.mesh.trainer.data=1", "--config.mesh.trainer.fsdp=1",
             "--config.mesh.trainer.tensor=1", "--config.sampler.steps_per_call=1",
             "--config.rl.weight_sync_every=1")
  rows, t, s_busy, t_busy, calls = [], 0.0, 0.0, 0.0, 0
  for step in range(1, 41):
    padded = 2048 if step not in (25, 33) else 4096
    train = 0.1 + padded / 1e5 + (5.0 if step in (1, 25) else 0.0)
    decode_steps = 2 if step % 3 else 30
    sample = decode_steps * 0.02 + (0.3 if step % 3 else 0.0)  # few-step rows: overhead
    dt = train + 0.01 + 0.5
    t, s_busy, t_busy, calls = t + dt, s_busy + sample, t_busy + train + 0.01, calls + decode_steps
    rows.append({
        "step": step, "time_s": t, "sampler/busy_frac": s_busy / t,
        "trainer/busy_frac": t_busy / t, "sampler/tokens_per_s": 16 * decode_steps / dt,
        "sampler/generate_calls": calls, "trainer/padded_tokens": padded,
        "trainer/step_time_s": train, "weight_sync/duration_s": 0.01,
        "queue/depth": 0, "staleness/mean": 0.0, "lengths/p50": 4.0, "lengths/p90": 5.0})
  _write_workdir(str(tmp_path), cfg, rows, {"weight_sync_s_mean": 0.01, "prompt_tokens_mean": 8})
  pilot = profile_lib.load_pilot(str(tmp_path))
  prof = profile_lib.fit_profile(pilot, scaling_efficiency=0.9)
  model = prof.trainer
  for tokens in (2048, 4096):
    assert model.step_s(tokens=tokens, devices=1) == pytest.approx(0.1 + tokens / 1e5, rel=1e-6)
  assert model.compile_s == pytest.approx(5.0, rel=1e-6)  # step 25 (step 1 is before the window)
  base, win = profile_lib.window(rows)
  busy = win[-1]["sampler/busy_frac"] * win[-1]["time_s"] - base["sampler/busy_frac"] * base["time_s"]
  steps = win[-1]["sampler/generate_calls"] - base["sampler/generate_calls"]
  assert prof.sampler.per_seq_s == 0 and prof.sampler.per_ctx_token_s == 0
  assert prof.sampler.base_s * steps == pytest.approx(busy, rel=1e-6)
  # The simulation charges the compilation once per new shape.
  once = planner.simulate(_scenario(trainer=TrainerModel(fixed_s=0.1, tokens_per_s_per_device=1e5,
                                                         compile_s=5.0), num_steps=10))
  none = planner.simulate(_scenario(trainer=TrainerModel(fixed_s=0.1, tokens_per_s_per_device=1e5),
                                    num_steps=10))
  shapes = len({r["trainer/padded_tokens"] for r in none.rows})
  assert once.wall_s - none.wall_s == pytest.approx(5.0 * shapes, rel=0.2)


def test_colocated_and_non_inflight_updates_run():
  colo = planner.simulate(_scenario(colocated=True))
  split = planner.simulate(_scenario())
  # Sharing devices serialises sampling and training, so a step can only take longer.
  assert colo.wall_s > split.wall_s
  assert colo.sampler_busy_frac + colo.trainer_busy_frac <= 1.0 + 1e-9
  drain = planner.simulate(_scenario(inflight_weight_updates=False))
  assert drain.optimizer_steps == 60 and drain.wall_s >= split.wall_s * 0.99


def test_simulation_is_deterministic_and_counts_like_loop():
  a, b = planner.simulate(_scenario()), planner.simulate(_scenario())
  assert a.wall_s == b.wall_s and a.staleness_histogram == b.staleness_histogram
  # As in loop.py, groups the trainer has dequeued (held) still count against the limit
  # until released, so a limit below groups_per_step can never fill a batch (the config
  # check rejects it, by the StalenessPolicy rule the simulation applies too); one batch
  # in flight runs, more slowly.
  with pytest.raises(ValueError, match="can never publish"):
    planner.simulate(_scenario(max_inflight_groups=4))
  small = planner.simulate(_scenario(max_inflight_groups=8))
  assert small.optimizer_steps == 60 and small.wall_s > a.wall_s


def _plan_cli(*args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "launch", "plan.py"), *args],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_bad_filter_rate_or_missing_profile_dir_is_one_clear_error(tmp_path):
  proc = _plan_cli("--config", "configs/default.py", "--devices", "8", "--filter-rate", "1.5")
  assert proc.returncode != 0
  assert proc.stderr.strip() == "error: --filter-rate must be in [0, 1), got 1.5"
  missing = str(tmp_path / "no_such_run")
  proc = _plan_cli("--config", "configs/default.py", "--devices", "8", "--profile", missing)
  assert proc.returncode != 0
  assert proc.stderr.strip() == f"error: --profile: directory {missing!r} does not exist"


def test_cli_plans_and_writes_png(tmp_path):
  proc = _plan_cli("--config", "configs/default.py", "--devices", "4", *PINNED,
                   "--config.rl.total_steps=12", "--sweep-inflight", "auto,16",
                   "--turns-per-episode", "2", "--config.env.tool.latency=fixed",
                   "--config.env.tool.latency_mean_s=0.5", "--filter-rate", "0.3",
                   "--config.rl.filter_groups=zero_variance", "--out", str(tmp_path))
  assert proc.returncode == 0, proc.stderr
  out = proc.stdout
  assert "recommended:" in out and "2x longer responses" in out
  assert "tool use: 2 turns per episode" in out
  assert "dynamic sampling: 30% of groups uniform" in out
  assert "2x slower verification" in out and "--config.mesh.sampler.data=" in out
  assert os.path.getsize(tmp_path / "plan.png") > 1000


@pytest.mark.parametrize("tool_workers, finish_s", [(2, 1.15), (1, 2.10)])
def test_tool_waits_free_the_slot_for_other_work(tool_workers, finish_s):
  """One slot, two sequences of 10 model tokens in 2 turns (5 + 5), decode step 0.01 s,
  tool call 1 s. Hand timeline: A decodes 0..0.05 and parks; B takes the slot 0.05..0.10
  and parks; with 2 tool workers A resumes at 1.05 (done 1.10) and B at 1.10 (done 1.15);
  with 1 worker B's call waits for A's (1.05..2.05), so B is done at 2.10. Then verify
  (0 s), train (0.5 s) and publish (0.1 s)."""
  turns = TurnModel(kind="fixed", mean_turns=2, observation_tokens=3,
                    tool=VerifierModel(latency=Latency(kind="fixed", mean_s=1.0),
                                       workers=tool_workers))
  sc = _scenario(mode="sync", groups_per_step=1, group_size=2, num_steps=1, decode_slots=1,
                 lengths=LengthModel(kind="empirical", values=(10,), max_tokens=32),
                 trainer=TrainerModel(fixed_s=0.5, tokens_per_s_per_device=1e15),
                 weight_sync_s=0.1, turns=turns, max_live_sequences=2)
  pred = planner.simulate(sc)
  assert pred.wall_s == pytest.approx(finish_s + 0.6, abs=1e-9)
  assert pred.sampler_busy_frac * pred.wall_s == pytest.approx(4 * 5 * 0.01, abs=1e-9)
  # completion = 10 model + 3 observation tokens; both rollouts trained, none parked now
  assert pred.rows[-1]["lengths/p50"] == 13 and pred.rows[-1]["sampler/parked"] == 0
  assert pred.rollouts_trained == 2
  # A is parked 0.05..1.05 and B 0.10..(1.10 or 2.05): the time-averaged parked count
  parked_s = 1.0 + (1.0 if tool_workers == 2 else 1.95)
  assert pred.parked_mean * pred.wall_s == pytest.approx(parked_s, abs=1e-9)


def test_turn_model_draws_and_budget():
  tool = VerifierModel(latency=Latency(kind="none"), workers=1)
  geo = TurnModel(kind="geometric", mean_turns=2.5, tool=tool, max_turns=50)
  k = geo.sample(np.random.default_rng(0), 20000)
  assert k.min() == 1 and k.mean() == pytest.approx(2.5, rel=0.03)
  assert TurnModel(kind="empirical", mean_turns=0, values=(1, 3), tool=tool).sample(
      np.random.default_rng(0), 1000).mean() == pytest.approx(2, rel=0.1)
  cut = TurnModel(kind="fixed", mean_turns=3, tool=tool, observation_tokens=10)
  assert cut.segments(9, 3, max_tokens=100) == [3, 3, 3]
  assert cut.segments(10, 3, max_tokens=100) == [4, 3, 3]
  # the budget holds model and observation tokens: 2 turns + 10 fit in 15, 3 + 20 do not
  assert cut.segments(9, 3, max_tokens=15) == [3, 2]
  cfg = _cfg("--config.env.tool.latency=fixed", "--config.env.tool.latency_mean_s=0.5",
             "--config.env.tool.workers=3", "--config.env.max_turns=4")
  model = capacity.turn_model(cfg, turns_per_episode=[1, 2, 6])
  assert (model.kind, model.mean_turns, model.max_turns, model.tool.workers) == (
      "empirical", 3.0, 4, 3)
  assert model.tool.latency.mean_s == 0.5
  with pytest.raises(capacity.PlanError, match="--turns-per-episode"):
    capacity.turn_model(cfg, turns_per_episode=0.5)


def _contended_timeline(work_s, busy_windows, share, start=0.0, gap=0.0, count=400):
  """Back-to-back intervals of `work_s` alone seconds each (then `gap` idle), running
  at `share` of alone speed inside `busy_windows` (the other role's busy time): the
  exact timeline the contention model describes, stepped in small time slices."""
  out, t, dt = [], start, 1e-4
  inside = lambda x: any(a <= x < b for a, b in busy_windows)
  for _ in range(count):
    t0, done = t, 0.0
    while done < work_s - 1e-12:
      rate = share if inside(t) else 1.0
      step = min(dt, (work_s - done) / rate)
      done += step * rate
      t += step
    out.append([t0, t])
    t += gap
  return np.asarray(out)


def test_contention_fit_recovers_known_shares():
  """Sampler calls of 0.02 s (alone) slowed to 0.25x while train steps run in
  [k, k + 0.3); train steps of 0.3 s slowed to 0.6x while the sampler is busy in
  [k + 0.1, k + 0.2) for even k only. Both shares come back (work conservation is
  exact here, up to the 0.1 ms time slices); a role that never overlaps keeps 1."""
  from rl_jax.planner import contention
  trainer_busy = [(k, k + 0.3) for k in range(10)]
  sampler = _contended_timeline(0.02, trainer_busy, 0.25, count=300)
  assert contention.fit_share(sampler, np.asarray(trainer_busy)) == pytest.approx(0.25, abs=0.01)
  sampler_busy = [(k + 0.1, k + 0.2) for k in range(0, 40, 2)]
  trainer = np.concatenate([_contended_timeline(0.3, sampler_busy, 0.6, start=k, count=1)
                            for k in range(40)])
  assert contention.fit_share(trainer, np.asarray(sampler_busy)) == pytest.approx(0.6, abs=0.01)
  # Sync: the roles take turns, so nothing overlaps and nothing is fitted.
  turns = np.asarray([[k + 0.5, k + 0.9] for k in range(40)])
  assert contention.fit_share(turns, np.asarray(trainer_busy)) is None
  notes = []
  fitted = contention.fit_contention(
      {"timeline": {"sampler": sampler.tolist(), "trainer": trainer_busy}}, 0.0, notes)
  assert fitted.sampler_share == pytest.approx(0.25, abs=0.01) and fitted.trainer_share == 1.0
  # Overlap arithmetic: [0, 1] and [2, 4] against [0.5, 2.5] overlap 0.5 and 0.5 s.
  assert contention.overlap_s(np.asarray([[0, 1], [2, 4]]), np.asarray([[0.5, 2.5]])).tolist() == [0.5, 0.5]
  # Alone seconds: 10 s busy with 4 s of it overlapped at share 0.25 -> 6 + 1 = 7.
  fitted.sampler, fitted.trainer = np.asarray([[0.0, 10.0]]), np.asarray([[0.0, 4.0]])
  fitted.sampler_share = 0.25
  assert fitted.alone_busy_s("sampler", 10.0, 0.0, 10.0) == pytest.approx(7.0)


def test_simulated_contention_serialises_a_stalled_sampler():
  """One batch of 8 groups x 4 samples of exactly 20 tokens fills the 32 slots; decode
  steps take 0.01 s (a batch 0.2 s) and train steps 0.5 s, verification instant. On
  independent devices async overlaps them: a step every max(0.5, 0.2) s. A sampler
  stalled while the trainer runs (share 0.01) serialises them: every 0.5 + 0.2 s."""
  lengths = LengthModel(kind="empirical", max_tokens=32, values=(20.0,))
  common = dict(groups_per_step=8, group_size=4, max_inflight_groups=16, decode_slots=32,
                lengths=lengths, prompt_tokens=4, num_steps=80, weight_sync_s=0.0,
                length_buckets=(64,),
                trainer=TrainerModel(fixed_s=0.5, tokens_per_s_per_device=1e12),
                sampler=SamplerModel(base_s=0.01, per_seq_s=0.0, per_ctx_token_s=0.0))
  free = profile_lib.steady_state(planner.simulate(_scenario(**common)).rows)
  stalled = profile_lib.steady_state(
      planner.simulate(_scenario(**common, sampler_share=0.01)).rows)
  assert free["steps_per_hour"] == pytest.approx(3600 / 0.5, rel=0.03)
  assert stalled["steps_per_hour"] == pytest.approx(3600 / 0.7, rel=0.03)
  assert stalled["trainer_busy_frac"] == pytest.approx(0.5 / 0.7, rel=0.03)
  # A trainer at half speed while the (then always busy) sampler decodes: slower still.
  slowed = profile_lib.steady_state(
      planner.simulate(_scenario(**common, trainer_share=0.5)).rows)
  assert slowed["steps_per_hour"] < free["steps_per_hour"] * 0.9


def test_loop_time_between_steps_delays_the_next_batch():
  """The trainer-bound case of the test above: a step every 0.5 s. With
  TrainerModel.loop_s = 0.1 the next batch is taken 0.1 s after each step (already
  queued): a step every 0.6 s, trainer busy 0.5 / 0.6 of the time."""
  lengths = LengthModel(kind="empirical", max_tokens=32, values=(20.0,))
  common = dict(groups_per_step=8, group_size=4, max_inflight_groups=16, decode_slots=32,
                lengths=lengths, prompt_tokens=4, num_steps=80, weight_sync_s=0.0,
                length_buckets=(64,),
                sampler=SamplerModel(base_s=0.01, per_seq_s=0.0, per_ctx_token_s=0.0))
  looped = profile_lib.steady_state(planner.simulate(_scenario(
      **common, trainer=TrainerModel(fixed_s=0.5, tokens_per_s_per_device=1e12,
                                     loop_s=0.1))).rows)
  assert looped["steps_per_hour"] == pytest.approx(3600 / 0.6, rel=0.01)
  assert looped["trainer_busy_frac"] == pytest.approx(0.5 / 0.6, rel=0.01)


@pytest.mark.parametrize("lag", [0, 4])
def test_pipeline_lag_holds_each_slot_one_call_longer(lag):
  """Groups of 4 samples of exactly 20 tokens, 4 slots (one group at a time), decode step
  0.01 s, 4 steps per call, instant verifier, trainer and sync: the sampler sets the
  pace. A group holds the slots for 20 + lag steps (the generator reads a call after
  dispatching the next one), so an optimizer step of one group takes (20 + lag) x 0.01 s,
  while the tokens counted stay 20 per sample."""
  sc = _scenario(groups_per_step=1, group_size=4, max_inflight_groups=3, decode_slots=4,
                 lengths=LengthModel(kind="empirical", max_tokens=32, values=(20.0,)),
                 prompt_tokens=4, num_steps=60, weight_sync_s=0.0, length_buckets=(64,),
                 steps_per_call=4, pipeline_lag_steps=lag,
                 trainer=TrainerModel(fixed_s=0.0, tokens_per_s_per_device=1e15))
  pred = planner.simulate(sc)
  steady = profile_lib.steady_state(pred.rows)
  assert steady["steps_per_hour"] == pytest.approx(3600 / ((20 + lag) * 0.01), rel=1e-6)
  # The lag steps emit no tokens: 20 per finished sample (the run ends between groups).
  assert pred.sampler_tokens_per_s * pred.wall_s == pytest.approx(20 * pred.rollouts_generated)
  assert {r["lengths/p50"] for r in pred.rows} == {20.0}


def test_loop_time_fit_uses_steps_whose_batch_was_queued():
  """Train steps of 0.4 s; a row whose row before shows a whole batch queued (depth >=
  groups_per_step = 16) starts 0.1 s after the step before it ends (the loop's time); the
  others wait 0.5 s more for data. The fit takes 0.1 s from the first kind only; a run
  that never had a batch queued fits 0."""
  cfg = _cfg("--config.rl.groups_per_step=16", "--config.mesh.trainer.data=1",
             "--config.mesh.trainer.fsdp=1", "--config.mesh.trainer.tensor=1")
  def rows_of(depth_of):
    rows, t, busy, prev_depth = [], 0.0, 0.0, 0
    for step in range(1, 41):
      t += (0.1 if prev_depth >= 16 else 0.6) + 0.4
      busy += 0.4
      prev_depth = depth_of(step)
      rows.append({"step": step, "time_s": t, "trainer/busy_frac": busy / t,
                   "trainer/padded_tokens": 16 * 4 * 64, "queue/depth": prev_depth})
    return rows
  notes = []
  ready = profile_lib.Pilot(workdir="w", cfg=cfg, summary={},
                            rows=rows_of(lambda k: 16 if k % 3 else 5))
  fitted = profile_lib.fit_trainer(ready, prompt_tokens=8, trainer_devices=1,
                                   scaling_efficiency=0.9, notes=notes)
  assert fitted.loop_s == pytest.approx(0.1, abs=1e-9)
  assert fitted.step_s(tokens=16 * 4 * 64, devices=1) == pytest.approx(0.4, rel=1e-6)
  assert any("between steps" in n for n in notes)
  starved = profile_lib.Pilot(workdir="w", cfg=cfg, summary={}, rows=rows_of(lambda k: 0))
  assert profile_lib.fit_trainer(starved, prompt_tokens=8, trainer_devices=1,
                                 scaling_efficiency=0.9, notes=[]).loop_s == 0.0


@pytest.mark.parametrize("lane, finish_s", [(0, 0.10), (8, 0.13), (3, 0.10)])
def test_prefill_lane_paces_new_prompts(lane, finish_s):
  """8 single-sample groups of 10 tokens, prompts of 5 (4 cached), 32 slots, decode
  step 0.01 s. No lane limit: all start at once, done at 0.10 s. A lane of 8 tokens
  takes two prompts per pass, so the pairs start at steps 0-3 and the last is done at
  step 13. A prompt longer than the whole lane (3) is prefilled by a call of its own
  and does not wait. Then train (0.5 s) and publish (0.1 s)."""
  sc = _scenario(mode="sync", groups_per_step=8, group_size=1, num_steps=1, decode_slots=32,
                 prompt_tokens=5, prefill_lane_tokens=lane,
                 lengths=LengthModel(kind="empirical", values=(10,), max_tokens=32),
                 trainer=TrainerModel(fixed_s=0.5, tokens_per_s_per_device=1e15),
                 weight_sync_s=0.1)
  pred = planner.simulate(sc)
  assert pred.wall_s == pytest.approx(finish_s + 0.6, abs=1e-9)
  assert pred.sampler_busy_frac * pred.wall_s == pytest.approx(finish_s, abs=1e-9)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_simulated_filtering_samples_more_groups_per_trained_group(mode):
  """Scenario.uniform_rate u with rl.filter_groups=zero_variance: the run's policy
  filters uniform groups, so about 1 / (1 - u) groups are sampled per group trained (the
  budget, 3 x the batch, rarely binds at u = 0.5) and every step still trains a full
  batch; at u = 0.9 with max_oversample=2 the budget caps sampling at 2 x the batch.
  Filtering off ignores the rate (same prediction as u = 0)."""
  base = dict(mode=mode, num_steps=30, max_inflight_groups=8 if mode == "sync" else 24)
  plain = planner.simulate(_scenario(**base))
  off = planner.simulate(_scenario(**base, uniform_rate=0.5))
  assert off.wall_s == plain.wall_s and off.groups_filtered == 0
  on = planner.simulate(_scenario(**base, uniform_rate=0.5, filter_groups="zero_variance"))
  assert on.optimizer_steps == 30 and on.rollouts_trained == plain.rollouts_trained
  assert on.groups_filtered > 0 and on.wall_s > plain.wall_s
  assert on.sampled_per_trained == pytest.approx(2.0, rel=0.2)
  assert on.rows[-1]["data/groups_filtered_zero_variance"] == on.groups_filtered
  capped = planner.simulate(_scenario(**base, uniform_rate=0.9, filter_groups="zero_variance",
                                      max_oversample=2))
  assert capped.sampled_per_trained <= 2.0 + 24 / (30 * 8)  # + what is in flight at the end
  assert capped.groups_filtered <= 30 * 8


def test_oldest_version_first_halves_the_discards_of_a_deep_queue():
  """Trainer-bound, so the queue holds more than a batch: under fifo a group whose slowest
  verification ran long waits behind the next version's groups and ages past the bound;
  rl.queue_order=oldest_version trains it first. Same throughput; every admitted group is
  trained, discarded, queued, being verified or decoding at the end (counted once)."""
  from rl_jax.planner.simulate import _Sim
  kw = dict(verifier=VerifierModel(latency=Latency(kind="lognormal", mean_s=0.3, sigma=1.0),
                                   workers=256),
            trainer=TrainerModel(fixed_s=2.0, tokens_per_s_per_device=1e7), num_steps=100,
            lengths=LengthModel(kind="lognormal", max_tokens=64, median=16, sigma=0.3))
  runs = {}
  for order in ("fifo", "oldest_version"):
    sim = _Sim(_scenario(queue_order=order, **kw))  # pylint: disable=protected-access
    pred = sim.run()
    runs[order] = pred
    assert pred.queue_depth_mean > 8  # deeper than one batch: the order matters
    assert (sim.accepted_groups + sim.discarded_groups + len(sim.queue) + sim.inflight
            == sim.next_gid)
    assert sim.accepted_groups == 100 * 8 + len(sim.batch)
  fifo, oldest = runs["fifo"], runs["oldest_version"]
  assert 0 < oldest.discard_rate <= 0.5 * fifo.discard_rate, (fifo.discard_rate,
                                                              oldest.discard_rate)
  assert oldest.steps_per_hour == pytest.approx(fifo.steps_per_hour, rel=0.01)
  assert max(oldest.staleness_histogram) <= 2

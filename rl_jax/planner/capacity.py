"""Sweep sampler / trainer splits of a cluster, reject bad layouts, rank the rest.

A layout gives S devices to sampling and T = N - S to training (or, colocated, all N
to both). The sampler keeps the config's tensor-parallel size t_s = mesh.sampler.tensor
and its slots per replica (sampler.max_concurrent_decodes / mesh.sampler.data), so

  replicas R = S / t_s,   decode slots = R * min(slots per replica, KV tokens per replica
                                                 / (prompt + max_new_tokens))

(a replica cannot run more full-length sequences than its KV pool holds). The trainer
keeps t_t = mesh.trainer.tensor and shards the rest over fsdp, so its data-parallel
size is T / t_t, which must divide the batch (groups_per_step * group_size).

A layout is rejected when it does not fit memory (rl_jax.planner.memory), when the
batch does not split over its trainer, or when its predicted discard rate exceeds
`max_discard_rate` (completed work the staleness bound throws away). The rest are ranked
by predicted useful trained rollouts per hour (discarded rollouts excluded). When the
configured in-flight limit fails everywhere and no in-flight sweep was asked for, one
batch in flight (max_inflight_groups = groups_per_step) is tried as well.

Without a pilot profile every model is a roofline prior (rl_jax.planner.models) for the
config's model preset on `device`, with completion lengths lognormal around
max_new_tokens / 2 (sigma 0.6), prompts of data.max_prompt_length tokens and verifier
calls of 1 ms plus the configured injected latency. With LoRA (model.lora.rank > 0) the
trainer prior has no base weight gradients, the weight-sync prior moves the adapters and
adds the sampler's merge, and memory counts a frozen base (rl_jax.planner.memory).

Tool use: `turns` (a TurnModel: turns per episode, the tool pool of the env.tool config
section, observation tokens; `turn_model` builds it) makes every rollout an episode of
decode segments and tool waits; without it a pilot profile's fitted turns are used. A
parked sequence holds its KV, so the KV pool then also bounds the live sequences:
max_live_sequences = R * KV tokens per replica / (prompt + max_new_tokens).
"""
from __future__ import annotations

import dataclasses

from rl_jax.orchestration.policy import StalenessPolicy, admission_bound
from rl_jax.errors import UserError
from rl_jax.planner import memory as memory_lib
from rl_jax.planner import profile as profile_lib
from rl_jax.planner.models import (DEVICES, DeviceSpec, LengthModel, TurnModel, VerifierModel,
                                   prior_sampler, prior_trainer, prior_weight_sync_s,
                                   train_flops_per_token)
from rl_jax.planner.simulate import Prediction, Scenario, diagnose, simulate


class PlanError(UserError, ValueError):
  """A planning request that cannot be met: one sentence naming the flag or field."""


@dataclasses.dataclass(frozen=True)
class Layout:
  sampler_devices: int
  trainer_devices: int
  colocated: bool = False

  @property
  def label(self) -> str:
    if self.colocated:
      return f"colo{self.sampler_devices}"
    return f"{self.sampler_devices}s/{self.trainer_devices}t"


@dataclasses.dataclass
class Candidate:
  """One evaluated (layout, max_staleness, max_inflight_groups)."""
  layout: Layout
  max_staleness: int
  max_inflight_groups: int
  memory: memory_lib.MemoryEstimate | None
  scenario: Scenario | None = None
  prediction: Prediction | None = None
  diagnosis: str = ""
  rejected: str = ""

  @property
  def useful_per_hour(self) -> float:
    return self.prediction.trained_rollouts_per_hour if self.prediction else 0.0


@dataclasses.dataclass
class Plan:
  devices: int
  mode: str
  candidates: list[Candidate]  # accepted ones ranked first, best first
  recommended: Candidate | None
  sensitivity: list[dict]
  notes: list[str]


def model_shape(cfg):
  """(ModelConfig with the run's LoRA fields, parameter count of the base model),
  imported lazily."""
  from rl_jax.model import hf_io, presets
  if cfg.model.path:
    import json
    import os
    path = os.path.join(cfg.model.path, "config.json")
    if not os.path.isfile(path):
      raise PlanError(f"config field 'model.path': {path} does not exist")
    with open(path) as f:
      model_cfg = hf_io.config_from_hf(json.load(f), where=path)
  else:
    try:
      model_cfg = presets.get_preset(cfg.model.preset)
    except ValueError as e:
      raise PlanError(f"config field 'model.preset': {e}") from None
  return model_cfg.replace(**hf_io.lora_fields(cfg.model)), presets.num_params(model_cfg)


def layouts(*, devices: int, sampler_tensor: int, trainer_tensor: int) -> list[Layout]:
  """Every split with whole sampler replicas and whole trainer tensor groups, then
  the colocated layout when both tensor sizes divide the cluster."""
  out = [Layout(s, devices - s) for s in range(sampler_tensor, devices, sampler_tensor)
         if (devices - s) >= trainer_tensor and (devices - s) % trainer_tensor == 0]
  if devices % sampler_tensor == 0 and devices % trainer_tensor == 0:
    out.append(Layout(devices, devices, colocated=True))
  return out


def _tensor(sub) -> int:
  return int(sub.get("tensor", 1))


def turn_model(cfg, *, turns_per_episode, kind: str = "geometric",
               observation_tokens: int = 16) -> TurnModel:
  """Episodes of `turns_per_episode` model turns on average (a list: empirical values),
  `kind` fixed | geometric, calling the tool pool of cfg.env.tool (latency, workers,
  timeout, retries, failures as configured) and capped at env.max_turns."""
  from rl_jax.tasks import base as task_base
  from rl_jax.tasks.latency import make_latency
  tool = cfg.env.tool
  try:
    latency = make_latency(tool, section="env.tool")
  except task_base.TaskError as e:
    raise PlanError(str(e)) from None
  values = tuple(float(v) for v in turns_per_episode) if isinstance(
      turns_per_episode, (list, tuple)) else ()
  try:
    return TurnModel(kind="empirical" if values else kind,
                     mean_turns=float(sum(values) / len(values) if values else turns_per_episode),
                     values=values, observation_tokens=int(observation_tokens),
                     max_turns=int(cfg.env.max_turns),
                     tool=VerifierModel(latency=latency, workers=int(tool.workers), base_s=1e-4,
                                        timeout_s=float(tool.timeout_s),
                                        failure_prob=float(tool.failure_prob),
                                        retries=int(tool.retries)))
  except ValueError as e:
    raise PlanError(f"--turns-per-episode: {e}") from None


def _models(cfg, *, profile: profile_lib.Profile | None, model_cfg, params: int,
            device: DeviceSpec, t_s: int, kv_tok: int):
  """(prompt tokens, LengthModel, VerifierModel, sampler model, trainer model, weight-sync
  seconds) of `cfg` with sampler replicas of tensor size `t_s`: the profile's fits, decode
  time scaled by profile tensor / t_s, or without a profile the priors (module docstring)."""
  s = cfg.sampler
  weight_bytes = params * memory_lib.DTYPE_BYTES[s.dtype]
  adapter_params, target_params = memory_lib.lora_sizes(model_cfg)
  if profile is not None:
    prompt = profile.prompt_tokens
    lengths = profile.lengths
    latency, base_s = profile.verifier_latency, 0.0
    ratio = profile.sampler_tensor / t_s  # decode time scales as 1 / tensor
    sampler = dataclasses.replace(
        profile.sampler, base_s=profile.sampler.base_s * ratio,
        per_seq_s=profile.sampler.per_seq_s * ratio,
        per_ctx_token_s=profile.sampler.per_ctx_token_s * ratio,
        prefill_per_token_s=profile.sampler.prefill_per_token_s * ratio)
    trainer = profile.trainer
    sync_s = profile.weight_sync_s
  else:
    from rl_jax.tasks import base as task_base
    from rl_jax.tasks.latency import make_latency
    prompt = int(cfg.data.max_prompt_length)
    lengths = LengthModel(kind="lognormal", max_tokens=int(s.max_new_tokens),
                          median=s.max_new_tokens / 2, sigma=0.6)
    try:
      latency = make_latency(cfg.verifier)
    except task_base.TaskError as e:
      raise PlanError(str(e)) from None
    base_s = 1e-3
    sampler = prior_sampler(params=params, weight_bytes=weight_bytes, kv_bytes_per_token=kv_tok,
                            tensor=t_s, device=device)
    flops = train_flops_per_token(params=params, kl=cfg.trainer.kl_beta > 0,
                                  extra_forward=cfg.trainer.num_minibatches > 1,
                                  lora_params=adapter_params)
    trainer = prior_trainer(flops_per_token=flops, device=device)
    # With LoRA only the adapters move, and the sampler merges them into its weights.
    b_s = memory_lib.DTYPE_BYTES[s.dtype]
    sync_s = prior_weight_sync_s(
        weight_bytes=adapter_params * b_s if adapter_params else weight_bytes, tensor=t_s,
        device=device, merge_bytes=2 * target_params * b_s)
  verifier = VerifierModel(latency=latency, workers=int(cfg.verifier.workers), base_s=base_s,
                           timeout_s=float(cfg.verifier.timeout_s),
                           failure_prob=float(cfg.verifier.failure_prob),
                           retries=int(cfg.verifier.retries))
  return prompt, lengths, verifier, sampler, trainer, sync_s


def scenario(cfg, *, layout: Layout, profile: profile_lib.Profile | None, model_cfg, params: int,
             device: DeviceSpec, num_steps: int, max_staleness: int | None = None,
             max_inflight_groups: int | None = None, length_scale: float = 1.0,
             verifier_scale: float = 1.0, turns: TurnModel | None = None,
             uniform_rate: float | None = None) -> Scenario:
  """The simulation input for `cfg` on `layout`; see the module docstring for priors.
  uniform_rate: share of groups whose rewards are all equal (None: the profile's, else 0);
  filtered when rl.filter_groups="zero_variance"."""
  rl, s = cfg.rl, cfg.sampler
  t_s, t_t = _tensor(cfg.mesh.sampler), _tensor(cfg.mesh.trainer)
  staleness = rl.max_staleness if max_staleness is None else max_staleness
  inflight = admission_bound(
      max_staleness=staleness, groups_per_step=rl.groups_per_step,
      max_inflight_groups=rl.max_inflight_groups if max_inflight_groups is None
      else max_inflight_groups)
  kv_tok = memory_lib.kv_bytes_per_token(num_layers=model_cfg.num_layers,
                                         num_kv_heads=model_cfg.num_kv_heads,
                                         head_dim=model_cfg.head_dim, dtype=s.dtype)
  prompt, lengths, verifier, sampler, trainer, sync_s = _models(
      cfg, profile=profile, model_cfg=model_cfg, params=params, device=device, t_s=t_s,
      kv_tok=kv_tok)
  replicas = layout.sampler_devices // t_s
  slots = s.max_concurrent_decodes // int(cfg.mesh.sampler.get("data", 1))
  kv_tokens = memory_lib.kv_pool_bytes(sampler_cfg=s, kv_per_token=kv_tok)
  live = kv_tokens // (prompt + int(s.max_new_tokens))
  slots = min(slots, live)
  trainer_dp = max(layout.trainer_devices // t_t, 1)
  if turns is None and profile is not None:
    turns = profile.turns
  if uniform_rate is None:
    uniform_rate = profile.uniform_rate if profile is not None else 0.0
  from rl_jax.sampler.engine import resolve_steps_per_call
  spc = resolve_steps_per_call(s.steps_per_call)
  return Scenario(
      mode=rl.mode, groups_per_step=int(rl.groups_per_step), group_size=int(rl.group_size),
      max_staleness=int(staleness), max_inflight_groups=int(inflight),
      queue_maxsize=int(rl.queue_maxsize), weight_sync_every=int(rl.weight_sync_every),
      inflight_weight_updates=bool(rl.inflight_weight_updates), num_steps=int(num_steps),
      prompt_tokens=prompt, length_buckets=tuple(cfg.trainer.length_buckets),
      batch_multiple=int(cfg.trainer.num_minibatches) * int(cfg.trainer.micro_batch_size or trainer_dp),
      lengths=lengths.scaled(length_scale) if length_scale != 1.0 else lengths,
      verifier=verifier.scaled(verifier_scale) if verifier_scale != 1.0 else verifier,
      sampler=sampler, sampler_replicas=replicas, decode_slots=replicas * slots,
      trainer=trainer, trainer_devices=layout.trainer_devices, weight_sync_s=float(sync_s),
      colocated=layout.colocated, steps_per_call=spc, pipeline_lag_steps=spc,
      seed=int(cfg.seed),
      turns=turns, max_live_sequences=replicas * live if turns is not None else 0,
      sampler_share=profile.sampler_share if profile is not None else 1.0,
      trainer_share=profile.trainer_share if profile is not None else 1.0,
      filter_groups=str(getattr(rl, "filter_groups", "none")),
      max_oversample=int(getattr(rl, "max_oversample", 4)), uniform_rate=float(uniform_rate),
      queue_order=str(getattr(rl, "queue_order", "fifo")))


def pilot_layout(cfg) -> Layout:
  """The layout a config's mesh describes."""
  from rl_jax import sharding
  s, t, _ = sharding.mesh_devices(cfg.mesh)
  return Layout(s, t, colocated=bool(cfg.mesh.colocated))


def load_profile(workdir: str, *, cfg=None, flag: str = "--profile",
                 device: DeviceSpec = DEVICES["h200"]):
  """(Pilot, Profile) from a pilot workdir: load_pilot, then refit."""
  pilot = profile_lib.load_pilot(workdir, flag=flag, cfg=cfg)
  return pilot, refit(pilot, device=device)


def refit(pilot: profile_lib.Pilot, *, device: DeviceSpec = DEVICES["h200"]):
  """The planner's models fitted from a pilot's rows and summary: the one fit that
  plan.py --profile/--validate/--from-run and the live controller (rl.control) all use.

  When the pilot logged no sampler/generate_calls, the constant decode step time is
  calibrated: simulate the pilot's own configuration and rescale the step time by
  observed / simulated sampler busy seconds per optimizer step, until within 2%.
  """
  profile = profile_lib.fit_profile(pilot)
  if profile.needs_calibration:
    model_cfg, params = model_shape(pilot.cfg)
    target = profile_lib.sampler_busy_per_step(pilot.rows)
    for _ in range(6):
      sc = scenario(pilot.cfg, layout=pilot_layout(pilot.cfg), profile=profile,
                    model_cfg=model_cfg, params=params, device=device,
                    num_steps=pilot.rows[-1]["step"] - pilot.rows[0]["step"] + 1)
      pred = simulate(sc)
      ratio = target / max(profile_lib.sampler_busy_per_step(pred.rows), 1e-12)
      profile.sampler = dataclasses.replace(profile.sampler,
                                            base_s=profile.sampler.base_s * ratio)
      if abs(ratio - 1) < 0.02:
        break
    profile.needs_calibration = False
    profile.notes.append(
        f"sampler: no sampler/generate_calls in metrics.jsonl; constant decode step "
        f"{profile.sampler.base_s:.3g}s calibrated to the pilot's sampler busy time")
  return profile


def check_layout(cfg, *, layout: Layout, model_cfg, params: int,
                 memory_gib: float) -> tuple[memory_lib.MemoryEstimate, str]:
  """(memory estimate, rejection reason or "") of a layout, before any simulation."""
  rl = cfg.rl
  t_s, t_t = _tensor(cfg.mesh.sampler), _tensor(cfg.mesh.trainer)
  mem = memory_lib.estimate(cfg=cfg, model_cfg=model_cfg, params=params, sampler_tensor=t_s,
                            trainer_devices=layout.trainer_devices, trainer_tensor=t_t,
                            memory_gib=memory_gib, colocated=layout.colocated)
  batch = rl.groups_per_step * rl.group_size
  dp = layout.trainer_devices // t_t
  gib = 2**30
  if batch % dp:
    return mem, f"batch {batch} does not split over {dp} trainer data shards"
  if not mem.sampler_fits:
    return mem, f"sampler needs {mem.sampler_bytes / gib:.1f} GiB > {mem.limit_bytes / gib:.1f}"
  if not mem.trainer_fits:
    return mem, f"trainer needs {mem.trainer_bytes / gib:.1f} GiB > {mem.limit_bytes / gib:.1f}"
  return mem, ""


def evaluate(cfg, *, layout: Layout, max_staleness: int, max_inflight_groups: int,
             profile, model_cfg, params: int, device: DeviceSpec, memory_gib: float,
             num_steps: int, max_discard_rate: float, length_scale: float = 1.0,
             verifier_scale: float = 1.0, turns: TurnModel | None = None,
             uniform_rate: float | None = None) -> Candidate:
  """Checks one candidate and, when it can run, simulates it."""
  mem, reason = check_layout(cfg, layout=layout, model_cfg=model_cfg, params=params,
                             memory_gib=memory_gib)
  cand = Candidate(layout=layout, max_staleness=max_staleness,
                   max_inflight_groups=max_inflight_groups, memory=mem, rejected=reason)
  stall = StalenessPolicy.make(
      mode=cfg.rl.mode, groups_per_step=cfg.rl.groups_per_step, max_staleness=max_staleness,
      max_inflight_groups=max_inflight_groups, queue_maxsize=cfg.rl.queue_maxsize,
      weight_sync_every=cfg.rl.weight_sync_every).stall_reason()
  if stall and not cand.rejected:
    cand.rejected = f"in-flight limit {max_inflight_groups} can never publish: {stall}"
  if cand.rejected:
    return cand
  cand.scenario = scenario(cfg, layout=layout, profile=profile, model_cfg=model_cfg,
                           params=params, device=device, num_steps=num_steps,
                           max_staleness=max_staleness, max_inflight_groups=max_inflight_groups,
                           length_scale=length_scale, verifier_scale=verifier_scale,
                           turns=turns, uniform_rate=uniform_rate)
  if cand.scenario.decode_slots < 1:
    cand.rejected = "the KV pool cannot hold one full-length sequence"
    return cand
  cand.prediction = simulate(cand.scenario)
  cand.diagnosis = diagnose(cand.prediction, cand.scenario)
  if cand.prediction.discard_rate > max_discard_rate:
    cand.rejected = (f"discards {100 * cand.prediction.discard_rate:.0f}% of groups "
                     f"> {100 * max_discard_rate:.0f}%")
  return cand


def recommend(cands: list[Candidate], *, tolerance: float = 0.02) -> Candidate | None:
  """The accepted candidate with the most useful rollouts per hour; among those within
  `tolerance` of it (simulation noise), the one with the tightest staleness bound, then
  the freshest data (lowest mean staleness), since stale data costs learning stability."""
  ok = [c for c in cands if not c.rejected]
  if not ok:
    return None
  top = max(c.useful_per_hour for c in ok)
  near = [c for c in ok if c.useful_per_hour >= (1 - tolerance) * top]
  return min(near, key=lambda c: (c.max_staleness, c.prediction.staleness_mean,
                                  -c.useful_per_hour))


def plan(cfg, *, devices: int, profile=None, device: DeviceSpec = DEVICES["h200"],
         memory_gib: float | None = None, staleness_values=None, inflight_values=None,
         max_discard_rate: float = 0.05, max_steps: int = 200,
         turns: TurnModel | None = None, uniform_rate: float | None = None) -> Plan:
  """Evaluates every layout x max_staleness x max_inflight_groups, ranks, and tests the
  recommended candidate against 2x longer responses and 2x slower verification.

  inflight_values holds max_inflight_groups settings, -1 meaning (max_staleness + 1) *
  groups_per_step. Layouts that fail memory or batch checks appear once. Simulated runs
  last min(rl.total_steps, max_steps) optimizer steps. `turns`: tool-using episodes
  (turn_model), else single-turn rollouts (or the profile's fitted turns).
  `uniform_rate`: share of verified groups whose rewards are all equal (None: the
  profile's measured share, else 0); with rl.filter_groups="zero_variance" the simulated
  sampler samples that many more groups per step and trains on the informative ones.
  """
  rl = cfg.rl
  if devices < 1:
    raise PlanError(f"--devices must be >= 1, got {devices}")
  t_s, t_t = _tensor(cfg.mesh.sampler), _tensor(cfg.mesh.trainer)
  options = layouts(devices=devices, sampler_tensor=t_s, trainer_tensor=t_t)
  if not options:
    raise PlanError(f"--devices {devices} cannot hold a sampler replica of mesh.sampler.tensor="
                    f"{t_s} devices plus a trainer of mesh.trainer.tensor={t_t}")
  notes = list(profile.notes) if profile is not None else [
      "no --profile: roofline priors for the model preset on " + device.name]
  swept_inflight = bool(inflight_values)
  staleness_values = list(staleness_values or [rl.max_staleness])
  inflight_values = list(inflight_values or [rl.max_inflight_groups])
  if rl.mode == "sync":
    if len(staleness_values) > 1 or len(inflight_values) > 1:
      notes.append("sync mode: staleness bound 0 and one batch in flight; sweeps ignored")
    staleness_values, inflight_values = [0], [rl.groups_per_step]
  settings = sorted({(st, admission_bound(max_staleness=st, groups_per_step=rl.groups_per_step,
                                          max_inflight_groups=inf))
                     for st in staleness_values for inf in inflight_values})
  model_cfg, params = model_shape(cfg)
  memory_gib = memory_gib or device.memory_gib
  common = dict(profile=profile, model_cfg=model_cfg, params=params, device=device,
                memory_gib=memory_gib, num_steps=min(int(rl.total_steps), max_steps),
                max_discard_rate=max_discard_rate, turns=turns, uniform_rate=uniform_rate)
  checked = [(lay, *check_layout(cfg, layout=lay, model_cfg=model_cfg, params=params,
                                 memory_gib=memory_gib)) for lay in options]
  cands = [Candidate(layout=lay, max_staleness=settings[0][0],
                     max_inflight_groups=settings[0][1], memory=mem, rejected=reason)
           for lay, mem, reason in checked if reason]

  def sweep(settings):
    return [evaluate(cfg, layout=lay, max_staleness=st, max_inflight_groups=inf, **common)
            for lay, _, reason in checked if not reason for st, inf in settings]

  cands += sweep(settings)
  if (recommend(cands) is None and not swept_inflight and rl.mode == "async" and
      any(c.prediction is not None for c in cands)):
    # The configured in-flight limit discards too much everywhere; one batch in flight
    # is the freshest async setting, so try it before giving up.
    extra = sorted({(st, rl.groups_per_step) for st, _ in settings} - set(settings))
    notes.append(f"every layout failed with the configured in-flight limit; also tried "
                 f"max_inflight_groups = groups_per_step = {rl.groups_per_step}")
    cands += sweep(extra)
  cands.sort(key=lambda c: (bool(c.rejected), -c.useful_per_hour))
  best = recommend(cands)
  sensitivity = []
  if best is not None:
    for name, kw in (("2x longer responses", dict(length_scale=2.0)),
                     ("2x slower verification", dict(verifier_scale=2.0))):
      alt = [evaluate(cfg, layout=lay, max_staleness=best.max_staleness,
                      max_inflight_groups=best.max_inflight_groups, **common, **kw)
             for lay in options]
      same = next(c for c in alt if c.layout == best.layout)
      top = recommend(alt)
      sensitivity.append({
          "case": name, "candidate": same,
          "change": same.useful_per_hour / best.useful_per_hour - 1,
          "best_layout": top.layout.label if top else "none",
      })
  return Plan(devices=devices, mode=rl.mode, candidates=cands, recommended=best,
              sensitivity=sensitivity, notes=notes)


def validate(pilot, profile, *, device: DeviceSpec = DEVICES["h200"]) -> list[dict]:
  """Predicted vs observed steady state of the pilot's own configuration.

  Each entry: metric, predicted, observed, rel_err = (predicted - observed) / observed
  (None when observed is 0).
  """
  model_cfg, params = model_shape(pilot.cfg)
  sc = scenario(pilot.cfg, layout=pilot_layout(pilot.cfg), profile=profile, model_cfg=model_cfg,
                params=params, device=device, num_steps=pilot.rows[-1]["step"])
  predicted = profile_lib.steady_state(simulate(sc).rows)
  observed = profile_lib.steady_state(pilot.rows)
  out = []
  for key in ("steps_per_hour", "queue_depth_mean", "staleness_mean", "sampler_busy_frac",
              "trainer_busy_frac", "discard_rate"):
    p, o = predicted[key], observed[key]
    out.append({"metric": key, "predicted": p, "observed": o,
                "rel_err": (p - o) / o if o else None})
  return out


def overrides(cfg, cand: Candidate) -> list[str]:
  """The --config flags that run `cand` with launch/train.py."""
  t_s, t_t = _tensor(cfg.mesh.sampler), _tensor(cfg.mesh.trainer)
  lay = cand.layout
  replicas = lay.sampler_devices // t_s
  slots = cfg.sampler.max_concurrent_decodes // int(cfg.mesh.sampler.get("data", 1))
  flags = [f"--config.mesh.colocated={str(lay.colocated).lower()}",
           f"--config.mesh.sampler.data={replicas}", f"--config.mesh.sampler.tensor={t_s}",
           "--config.mesh.trainer.data=1", f"--config.mesh.trainer.fsdp={lay.trainer_devices // t_t}",
           f"--config.mesh.trainer.tensor={t_t}",
           f"--config.sampler.max_concurrent_decodes={replicas * slots}"]
  if cfg.rl.mode == "async":
    flags += [f"--config.rl.max_staleness={cand.max_staleness}",
              f"--config.rl.max_inflight_groups={cand.max_inflight_groups}"]
  return flags

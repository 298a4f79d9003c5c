"""Throughput, length and latency models that the planner's simulation runs on.

Every model is a small frozen dataclass with the formula in its docstring. Models come
either from a roofline prior (`prior_*`: the config's model preset on a `DeviceSpec`)
or from a pilot run (rl_jax.planner.profile fits the same fields).

Sampler (one continuous-batching engine of R data-parallel replicas that step in
lockstep, as the single-controller generator does):

  step_s(n, ctx) = base_s + per_seq_s * n / R + per_ctx_token_s * ctx / R

  n   = active sequences over all replicas (spread evenly, so n / R per replica),
  ctx = sum of their context lengths (prompt + tokens so far).
  base_s is the weight read plus host round trip, per_seq_s the per-token matmul work,
  per_ctx_token_s the KV read of attention. Starting a sequence adds
  prefill_per_token_s * prompt tokens / R to the step that starts it.

Trainer (time of one optimizer step on D trainer devices):

  step_s(tokens, D) = fixed_s + tokens / (tokens_per_s_per_device * D_eff)
  D_eff = 1 + scaling_efficiency * (D - 1)

  tokens = padded tokens of the batch (rows x length bucket), because the train step
  computes over the padded batch. Between two steps the trainer spends loop_s of host
  time not training (the loop's metrics row, the publication's wait for the sampler's
  call boundary, taking the next batch) even when the batch is waiting in the queue.

Tool use (`TurnModel`): an episode alternates K decode segments (model turns) and K - 1
tool waits; while it waits, a sequence holds its KV pages but no decode slot.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from rl_jax.tasks.latency import Latency


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """One accelerator. Bandwidths in bytes/s, flops in FLOP/s, memory in GiB.

  `mfu` is the fraction of peak matmul throughput a step reaches; `host_overhead_s` the
  fixed cost of one decode call (dispatch and host round trip).
  """
  name: str
  memory_gib: float
  hbm_bytes_per_s: float
  peak_flops: float
  link_bytes_per_s: float
  mfu: float = 0.4
  host_overhead_s: float = 1e-3


# H200: 4.3 TB/s device copy and 790 TFLOP/s bf16 matmul were measured (DESIGN.md);
# 139 GiB is what the device reports; the NVLink figure is a conservative per-device
# share of its 900 GB/s.
DEVICES = {
    "h200": DeviceSpec(name="h200", memory_gib=139.0, hbm_bytes_per_s=4.3e12,
                       peak_flops=790e12, link_bytes_per_s=200e9),
}


@dataclasses.dataclass(frozen=True)
class SamplerModel:
  """Decode step time of the whole sampler engine; formula in the module docstring."""
  base_s: float
  per_seq_s: float
  per_ctx_token_s: float
  prefill_per_token_s: float = 0.0

  def step_s(self, *, active: float, context_tokens: float, replicas: int) -> float:
    return (self.base_s + self.per_seq_s * active / replicas +
            self.per_ctx_token_s * context_tokens / replicas)


@dataclasses.dataclass(frozen=True)
class TrainerModel:
  """Optimizer-step time; formula in the module docstring."""
  fixed_s: float
  tokens_per_s_per_device: float
  scaling_efficiency: float = 0.9
  # XLA compiles the train step once per new batch shape (length bucket): the first
  # step at a shape takes this much longer (fitted from a pilot; 0 for priors).
  compile_s: float = 0.0
  # Host time between two steps with the next batch already queued (not trainer busy).
  loop_s: float = 0.0

  def effective_devices(self, devices: int) -> float:
    return 1.0 + self.scaling_efficiency * (devices - 1)

  def step_s(self, *, tokens: float, devices: int) -> float:
    return self.fixed_s + tokens / (self.tokens_per_s_per_device * self.effective_devices(devices))


@dataclasses.dataclass(frozen=True)
class LengthModel:
  """Completion length in tokens at optimizer step k.

    lognormal:  L = exp(ln(median) + sigma * N(0, 1)) * (1 + drift_per_step)**k
    empirical:  L = (a uniform draw from `values`) * (1 + drift_per_step)**k
  then rounded and clipped to [1, max_tokens]; L = max_tokens is a truncation
  (finish_reason "length"), as the sampler's max_new_tokens cap makes it.
  """
  kind: str
  max_tokens: int
  median: float = 0.0
  sigma: float = 0.0
  values: tuple[float, ...] = ()
  drift_per_step: float = 0.0

  def __post_init__(self):
    if self.kind not in ("lognormal", "empirical"):
      raise ValueError(f"length model kind must be lognormal or empirical, got {self.kind!r}")
    if self.kind == "lognormal" and not self.median > 0:
      raise ValueError(f"lognormal length model needs median > 0, got {self.median}")
    if self.kind == "empirical" and not self.values:
      raise ValueError("empirical length model needs at least one value")

  def sample(self, rng: np.random.Generator, size: int, step: int = 0) -> np.ndarray:
    if self.kind == "lognormal":
      # In log space, capped just above the max_tokens clip: a refit with a very large
      # sigma would overflow exp, and every capped draw is clipped to max_tokens anyway.
      log_raw = math.log(self.median) + self.sigma * rng.standard_normal(size)
      log_raw = log_raw + step * math.log1p(self.drift_per_step)
      raw = np.exp(np.minimum(log_raw, math.log(self.max_tokens) + 1.0))
    else:
      raw = np.asarray(self.values, np.float64)[rng.integers(len(self.values), size=size)]
      raw = raw * (1.0 + self.drift_per_step) ** step
    return np.clip(np.rint(raw), 1, self.max_tokens).astype(np.int64)

  def scaled(self, factor: float) -> LengthModel:
    """Responses `factor` times longer; the max_tokens cap stays (truncation grows)."""
    return dataclasses.replace(self, median=self.median * factor,
                               values=tuple(v * factor for v in self.values))


@dataclasses.dataclass(frozen=True)
class VerifierModel:
  """The verifier pool: `workers` parallel servers with a FIFO waiting line.

  One attempt takes min(base_s + L, timeout_s), L drawn from `latency` (the same
  parametrisation as rl_jax.tasks.latency injects); it fails with probability
  `failure_prob` (or when it hits the timeout) and is retried up to `retries` times,
  so a rollout's service time is the sum of its attempts.
  """
  latency: Latency
  workers: int
  base_s: float = 0.0
  timeout_s: float = math.inf
  failure_prob: float = 0.0
  retries: int = 0

  def service_s(self, rng: np.random.Generator) -> float:
    """One service time (a tool call)."""
    return float(self.service_times(rng, 1)[0])

  def service_times(self, rng: np.random.Generator, n: int) -> np.ndarray:
    """n service times (service_s's model) drawn together, attempt by attempt."""
    total = np.zeros(n)
    going = np.ones(n, bool)  # still attempting
    for _ in range(self.retries + 1):
      k = int(going.sum())
      if not k:
        break
      draw = self.base_s + (self.latency.sample(rng, k) if self.latency.kind != "none"
                            else np.zeros(k))
      total[going] += np.minimum(draw, self.timeout_s)
      failed = draw >= self.timeout_s
      if self.failure_prob > 0:
        failed |= rng.random(k) < self.failure_prob
      going[going] = failed
    return total

  def scaled(self, factor: float) -> VerifierModel:
    """Every call `factor` times slower (base and injected latency alike)."""
    lat = dataclasses.replace(self.latency, mean_s=self.latency.mean_s * factor,
                              values=tuple(v * factor for v in self.latency.values))
    return dataclasses.replace(self, latency=lat, base_s=self.base_s * factor)


TURN_KINDS = ("fixed", "geometric", "empirical")


@dataclasses.dataclass(frozen=True)
class TurnModel:
  """Model turns K per episode and the tool call between two turns.

    fixed:      K = round(mean_turns)
    geometric:  P(K = k) = p (1 - p)**(k - 1), k >= 1, p = 1 / mean_turns (E[K] = mean_turns)
    empirical:  K drawn uniformly from `values`
  then clipped to [1, max_turns]. A rollout's L model tokens split into min(K, L) decode
  segments as equal as possible (`segments`); after every segment but the last the
  sequence waits for one call of `tool` (a VerifierModel: the tool pool has the verifier
  pool's workers, FIFO line, latency, timeout and retries), then observation_tokens are
  prefilled into its context and it waits for a free decode slot (ahead of new samples).
  """
  kind: str
  mean_turns: float
  tool: VerifierModel
  observation_tokens: int = 0
  values: tuple[float, ...] = ()
  max_turns: int = 1000

  def __post_init__(self):
    if self.kind not in TURN_KINDS:
      raise ValueError(f"turn model kind must be one of {TURN_KINDS}, got {self.kind!r}")
    if self.kind != "empirical" and not self.mean_turns >= 1:
      raise ValueError(f"turns per episode must be >= 1, got {self.mean_turns}")
    if self.kind == "empirical" and not self.values:
      raise ValueError("empirical turn model needs at least one value")

  def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
    if self.kind == "fixed":
      k = np.full(size, round(self.mean_turns))
    elif self.kind == "geometric":
      k = rng.geometric(1.0 / self.mean_turns, size=size)
    else:
      k = np.rint(np.asarray(self.values, np.float64)[rng.integers(len(self.values), size=size)])
    return np.clip(k, 1, self.max_turns).astype(np.int64)

  def segments(self, length: int, turns: int, max_tokens: int) -> list[int]:
    """Decode segments of an episode: `length` model tokens in min(turns, length) parts as
    equal as possible, longest first. The episode budget `max_tokens` holds model and
    observation tokens (as env.max_total_tokens does): turns and then model tokens are
    cut to fit it."""
    obs = self.observation_tokens
    k = max(1, min(int(turns), int(length)))
    while k > 1 and k + obs * (k - 1) > max_tokens:
      k -= 1
    length = max(min(int(length), max_tokens - obs * (k - 1)), k)
    base, extra = divmod(length, k)
    return [base + (i < extra) for i in range(k)]


def train_flops_per_token(*, params: int, kl: bool, extra_forward: bool,
                          lora_params: int = 0) -> float:
  """6N for forward + backward, plus 2N per extra forward (reference model, pi_prox).
  With LoRA (P = lora_params > 0) the frozen N need no weight gradients: 4N (forward,
  activation gradients) + 6P for the adapters, plus the extra forwards."""
  if lora_params:
    return params * (4.0 + 2.0 * kl + 2.0 * extra_forward) + 6.0 * lora_params
  return params * (6.0 + 2.0 * kl + 2.0 * extra_forward)


def prior_sampler(*, params: int, weight_bytes: int, kv_bytes_per_token: int, tensor: int,
                  device: DeviceSpec) -> SamplerModel:
  """Roofline prior for one replica of `tensor` devices:

    base_s              = host_overhead_s + weight_bytes / (tensor * hbm_bw)
    per_seq_s           = 2 * params / (tensor * peak_flops * mfu)
    per_ctx_token_s     = kv_bytes_per_token / (tensor * hbm_bw)
    prefill_per_token_s = 2 * params / (tensor * peak_flops * mfu)
  """
  flops = tensor * device.peak_flops * device.mfu
  bw = tensor * device.hbm_bytes_per_s
  return SamplerModel(base_s=device.host_overhead_s + weight_bytes / bw,
                      per_seq_s=2.0 * params / flops,
                      per_ctx_token_s=kv_bytes_per_token / bw,
                      prefill_per_token_s=2.0 * params / flops)


def prior_trainer(*, flops_per_token: float, device: DeviceSpec,
                  fixed_s: float = 0.05, scaling_efficiency: float = 0.9) -> TrainerModel:
  """Roofline prior: tokens_per_s_per_device = peak_flops * mfu / flops_per_token."""
  return TrainerModel(fixed_s=fixed_s,
                      tokens_per_s_per_device=device.peak_flops * device.mfu / flops_per_token,
                      scaling_efficiency=scaling_efficiency)


def prior_weight_sync_s(*, weight_bytes: int, tensor: int, device: DeviceSpec,
                        merge_bytes: int = 0) -> float:
  """Each sampler device receives its 1/tensor shard over its link: 10 ms + bytes / bw;
  with LoRA (weight_bytes = the adapters') plus the merge, memory-bound:
  merge_bytes / (tensor * hbm_bw), merge_bytes = 2 * targeted weight bytes (read W0,
  write W)."""
  return (0.01 + weight_bytes / (tensor * device.link_bytes_per_s)
          + merge_bytes / (tensor * device.hbm_bytes_per_s))

"""Injected verifier and tool latency and failures, to study long-tailed verifiers and tools.

The fields live in the verifier section and in env.tool (tool calls of environments);
<section>.latency selects the distribution of the extra delay L (seconds) of one call;
the parametric ones are scaled so that E[L] = <section>.latency_mean_s = m:

  none       L = 0
  fixed      L = m
  lognormal  L = exp(mu + sigma * N(0, 1)),  mu = ln(m) - sigma**2 / 2,
             sigma = <section>.latency_sigma; median exp(mu) = m * exp(-sigma**2 / 2)
  pareto     L = x_m * (1 + Lomax(alpha)) (Pareto type I, minimum x_m),
             x_m = m * (alpha - 1) / alpha, alpha = <section>.latency_alpha > 1;
             median x_m * 2**(1 / alpha); variance is infinite for alpha <= 2
  empirical  L drawn uniformly from the values in <section>.latency_file (one number of
             seconds per line; blank lines and lines starting with "#" are ignored);
             E[L] is the file's mean and latency_mean_s is unused

and with probability <section>.failure_prob the call raises InjectedFailure after its
delay. Draws for call c, attempt a come from numpy Generator(seed, c, a), so a run's
delays and failures do not depend on thread scheduling.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from rl_jax.tasks.base import TaskError

LATENCY_KINDS = ("none", "fixed", "lognormal", "pareto", "empirical")


class InjectedFailure(RuntimeError):
  """A failure injected by <section>.failure_prob."""


@dataclasses.dataclass(frozen=True)
class Latency:
  """A latency distribution; `sample(rng, size)` draws seconds (float or array)."""
  kind: str
  mean_s: float = 0.0
  sigma: float = 1.0
  alpha: float = 1.5
  values: tuple[float, ...] = ()

  def sample(self, rng: np.random.Generator, size: int | None = None):
    n = 1 if size is None else size
    if self.kind == "none":
      draws = np.zeros(n)
    elif self.kind == "fixed":
      draws = np.full(n, self.mean_s)
    elif self.kind == "lognormal":
      mu = math.log(self.mean_s) - self.sigma**2 / 2
      draws = rng.lognormal(mu, self.sigma, size=n)
    elif self.kind == "pareto":
      x_m = self.mean_s * (self.alpha - 1) / self.alpha
      # numpy's pareto is Lomax (Pareto II); 1 + Lomax is Pareto I with minimum 1.
      draws = x_m * (1.0 + rng.pareto(self.alpha, size=n))
    else:
      draws = np.asarray(self.values)[rng.integers(len(self.values), size=n)]
    return draws if size is not None else float(draws[0])


def read_latency_file(path: str, field: str = "verifier.latency_file") -> tuple[float, ...]:
  """Latencies in seconds from `path`, one per line; raises TaskError naming file:line."""
  section = field.rpartition(".")[0]
  if not path:
    raise TaskError(f"{section}.latency='empirical' needs {field}.")
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.readlines()
  except OSError as e:
    raise TaskError(f"{field} {path!r} cannot be read ({e.strerror}).") from None
  values = []
  for line_no, line in enumerate(lines, start=1):
    text = line.strip()
    if not text or text.startswith("#"):
      continue
    try:
      value = float(text)
    except ValueError:
      value = math.nan
    if not math.isfinite(value) or value < 0:
      raise TaskError(f"{path}:{line_no}: expected a latency in seconds >= 0, "
                      f"got {text[:40]!r}.")
    values.append(value)
  if not values:
    raise TaskError(f"{field} {path!r} holds no latencies.")
  return tuple(values)


def make_latency(cfg, section: str = "verifier") -> Latency:
  """The Latency named by <section>.latency (the verifier section, or env.tool), validated."""
  kind = cfg.latency
  mean_s = float(cfg.latency_mean_s)
  if kind not in LATENCY_KINDS:
    raise TaskError(f"{section}.latency must be one of {LATENCY_KINDS}, got {kind!r}.")
  if kind in ("fixed", "lognormal", "pareto") and not mean_s > 0:
    raise TaskError(f"{section}.latency={kind!r} needs {section}.latency_mean_s > 0, "
                    f"got {mean_s}.")
  if kind == "lognormal" and not float(cfg.latency_sigma) > 0:
    raise TaskError(f"{section}.latency_sigma must be > 0, got {cfg.latency_sigma}.")
  if kind == "pareto" and not float(cfg.latency_alpha) > 1:
    raise TaskError(f"{section}.latency_alpha must be > 1 for a finite mean, got "
                    f"{cfg.latency_alpha}.")
  if not 0.0 <= float(cfg.failure_prob) <= 1.0:
    raise TaskError(f"{section}.failure_prob must be in [0, 1], got {cfg.failure_prob}.")
  values = (read_latency_file(cfg.latency_file, field=f"{section}.latency_file")
            if kind == "empirical" else ())
  return Latency(kind=kind, mean_s=mean_s, sigma=float(cfg.latency_sigma),
                 alpha=float(cfg.latency_alpha), values=values)


def call_rng(*, seed: int, call_index: int, attempt: int) -> np.random.Generator:
  """The Generator for attempt `attempt` of call `call_index`."""
  # SeedSequence entropy must be non-negative; fold any int seed into 32 bits.
  return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(call_index), int(attempt)])


def draw_call(*, latency: Latency, failure_prob: float, seed: int, call_index: int,
              attempt: int) -> tuple[float, bool]:
  """(delay seconds, fails) of one verifier or tool attempt, deterministic in its arguments."""
  rng = call_rng(seed=seed, call_index=call_index, attempt=attempt)
  delay = latency.sample(rng) if latency.kind != "none" else 0.0
  return delay, bool(failure_prob > 0 and rng.random() < failure_prob)

"""What a simulated run predicts (`Prediction`), and the bottleneck it names (`diagnose`)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Prediction:
  """What a simulated run measured; rates are over the whole run [0, wall_s]."""
  wall_s: float
  optimizer_steps: int
  steps_per_hour: float
  rollouts_generated: int
  rollouts_trained: int
  rollouts_discarded: int
  trained_rollouts_per_hour: float  # useful: discarded rollouts excluded
  generated_rollouts_per_hour: float
  discard_rate: float  # discarded groups / consumed groups
  sampler_busy_frac: float
  trainer_busy_frac: float
  verifier_busy_frac: float
  verifier_wait_mean_s: float
  queue_depth_mean: float  # time average
  queue_depth_max: int
  rollout_age_mean_s: float  # admission -> consumption of accepted groups
  staleness_mean: float
  staleness_histogram: dict[int, int]
  active_sequences_mean: float
  sampler_tokens_per_s: float
  trainer_padded_tokens_per_s: float  # rows x length bucket, what the train step computes
  weight_sync_frac: float  # share of wall time the trainer spent publishing
  rows: list[dict]
  # Tool use (Scenario.turns): sequences parked for a tool (time average), and the share
  # of the tool pool's worker time in use.
  parked_mean: float = 0.0
  tool_busy_frac: float = 0.0
  # Dynamic sampling: groups filtered for zero reward variance, and groups sampled
  # (admitted) per group trained.
  groups_filtered: int = 0
  sampled_per_trained: float = 1.0


def diagnose(pred: Prediction, scenario) -> str:
  """Names the bottleneck, after the seed's eight-GPU exercise.

    trainer-starved  queue mostly empty (mean depth under a quarter of a batch) and the
                     trainer idle half the time or more
    overproducing    staleness near the bound (mean >= bound / 2, bound > 0) with
                     discards, or a queue averaging at least one batch, with a busy trainer
    verifier-bound   trainer-starved, and the verifier pool busier than the sampler
    balanced         neither
  Sync mode waits at its barrier by design, so it is labelled by the larger share of
  the step: "sync, training-bound" or "sync, generation-bound".
  """
  if scenario.mode == "sync":
    return ("sync, training-bound" if pred.trainer_busy_frac >= 0.5
            else "sync, generation-bound")
  starved = (pred.queue_depth_mean < scenario.groups_per_step / 4 and
             pred.trainer_busy_frac < 0.5)
  if starved:
    if pred.verifier_busy_frac > max(pred.sampler_busy_frac, 0.8):
      return "verifier-bound"
    return "trainer-starved"
  bound = scenario.max_staleness
  stale = bound > 0 and pred.staleness_mean >= bound / 2 and pred.discard_rate > 0
  deep = pred.queue_depth_mean >= scenario.groups_per_step
  if (stale or deep) and pred.trainer_busy_frac >= 0.7:
    return "overproducing"
  return "balanced"

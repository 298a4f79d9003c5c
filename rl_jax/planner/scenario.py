"""What one simulated run is given (`Scenario`): the loop's settings as rl_jax.config
names them, the fitted or prior models of each part (rl_jax.planner.models), the layout
(replicas, slots, devices) and the contention between roles. rl_jax.planner.capacity
builds one from a config and a layout; rl_jax.planner.simulate runs it."""
from __future__ import annotations

import dataclasses

from rl_jax.orchestration.policy import StalenessPolicy
from rl_jax.planner.models import (LengthModel, SamplerModel, TrainerModel, TurnModel,
                                   VerifierModel)


@dataclasses.dataclass(frozen=True)
class Scenario:
  """Everything one simulated run needs. `decode_slots` counts all replicas' slots."""
  mode: str
  groups_per_step: int
  group_size: int
  max_staleness: int
  max_inflight_groups: int
  queue_maxsize: int
  weight_sync_every: int
  inflight_weight_updates: bool
  num_steps: int
  prompt_tokens: int
  length_buckets: tuple[int, ...]
  batch_multiple: int
  lengths: LengthModel
  verifier: VerifierModel
  sampler: SamplerModel
  sampler_replicas: int
  decode_slots: int
  trainer: TrainerModel
  trainer_devices: int
  weight_sync_s: float
  colocated: bool = False
  steps_per_call: int = 1
  # Decode steps a sequence holds its slot beyond its own tokens. The generator
  # dispatches each call before it reads the previous one (rl_jax.sampler.generator), so
  # a sequence that stops in one call is decoded for nothing in the next, and its slot
  # takes new work one call later: capacity.scenario sets steps_per_call.
  pipeline_lag_steps: int = 0
  seed: int = 0
  turns: TurnModel | None = None  # None: single-turn rollouts
  max_live_sequences: int = 0  # sequences whose KV fits at once; 0: no limit
  # Prompt tokens one generate call prefills (Engine.prefill_lane); 0: no limit
  prefill_lane_tokens: int = 0
  # Contention (rl_jax.planner.contention): speed of each role while the other is busy.
  sampler_share: float = 1.0
  trainer_share: float = 1.0
  # Dynamic sampling: rl.filter_groups, rl.max_oversample, and the share of verified
  # groups whose rewards are all equal (measured from a pilot or given to plan.py).
  filter_groups: str = "none"
  max_oversample: int = 4
  uniform_rate: float = 0.0
  queue_order: str = "fifo"  # rl.queue_order: the trainer's pick from the queue

  @property
  def policy(self) -> StalenessPolicy:
    return StalenessPolicy.make(
        mode=self.mode, groups_per_step=self.groups_per_step, max_staleness=self.max_staleness,
        max_inflight_groups=self.max_inflight_groups, queue_maxsize=self.queue_maxsize,
        weight_sync_every=self.weight_sync_every, filter_groups=self.filter_groups,
        max_oversample=self.max_oversample, queue_order=self.queue_order)

"""Host-side records that cross module boundaries: Rollout and Group.

Shape letters: t = completion tokens, p = prompt tokens.

Staleness of a rollout at consumption is `trainer_version - min(token_versions)`,
counted in published policy versions; a group's staleness is the max over its
rollouts.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

@dataclasses.dataclass
class Rollout:
  """One completion. Arrays are numpy; per-token arrays have length t."""
  group_id: int
  sample_index: int
  prompt_tokens: np.ndarray  # int32 [p]
  completion_tokens: np.ndarray  # int32 [t]
  behavior_logprobs: np.ndarray  # float32 [t], log-prob under the sampled distribution
  token_versions: np.ndarray  # int32 [t], policy version that produced each token
  finish_reason: str = "stop"  # stop | length | aborted
  reward: float = 0.0
  verifier_status: str = "pending"  # pending | ok | timeout | error
  reward_info: dict[str, Any] = dataclasses.field(default_factory=dict)
  completion_text: str = ""
  # Wall-clock timestamps (time.time()); 0.0 until reached.
  admitted: float = 0.0
  first_token: float = 0.0
  finished: float = 0.0
  verified: float = 0.0
  enqueued: float = 0.0

  @property
  def num_tokens(self) -> int:
    return int(self.completion_tokens.shape[0])

  @property
  def min_version(self) -> int:
    if self.token_versions.size == 0:
      return 0
    return int(self.token_versions.min())

  def staleness(self, trainer_version: int) -> int:
    return int(trainer_version) - self.min_version

  @property
  def mixed_versions(self) -> bool:
    return self.token_versions.size > 0 and int(self.token_versions.max()) != self.min_version


@dataclasses.dataclass
class Group:
  """The G rollouts of one prompt: the unit of admission, queueing and advantages."""
  group_id: int
  example: Any  # the task example the prompt came from
  prompt_tokens: np.ndarray
  rollouts: list[Rollout] = dataclasses.field(default_factory=list)
  admitted: float = 0.0
  enqueued: float = 0.0
  index: int = -1  # the task example's index (task.example(index))

  def staleness(self, trainer_version: int) -> int:
    return max(r.staleness(trainer_version) for r in self.rollouts)

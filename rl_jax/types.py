"""Host-side records that cross module boundaries: Rollout and Group.

Shape letters: t = completion tokens, p = prompt tokens.

Staleness of a rollout at consumption is `trainer_version - min(token_versions)` over
its model tokens, counted in published policy versions; a group's staleness is the max
over its rollouts.

Multi-turn rollouts (tool use): `completion_tokens` interleave the model's turns with the
environment's observations. `model_mask` is True at tokens the model sampled and False at
observation tokens, which carry behaviour log-prob 0.0 and version -1 and are masked out
of the loss, KL and entropy (they are context only).
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
  # bool [t]: True where the model sampled the token, False at environment observation
  # tokens; None means every completion token is the model's (single-turn rollouts).
  model_mask: np.ndarray | None = None
  num_turns: int = 1  # model turns (1 + the observations appended)

  @property
  def num_tokens(self) -> int:
    return int(self.completion_tokens.shape[0])

  @property
  def model_token_mask(self) -> np.ndarray:
    """bool [t]: the tokens the model sampled."""
    if self.model_mask is None:
      return np.ones(self.completion_tokens.shape, bool)
    return np.asarray(self.model_mask, bool)

  @property
  def model_versions(self) -> np.ndarray:
    """The policy versions of the model's tokens."""
    return self.token_versions if self.model_mask is None else self.token_versions[self.model_token_mask]

  @property
  def min_version(self) -> int:
    versions = self.model_versions
    if versions.size == 0:
      return 0
    return int(versions.min())

  def staleness(self, trainer_version: int) -> int:
    return int(trainer_version) - self.min_version

  @property
  def mixed_versions(self) -> bool:
    versions = self.model_versions
    return versions.size > 0 and int(versions.max()) != self.min_version


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

  @property
  def min_version(self) -> int:
    """The oldest policy version among its rollouts' tokens (staleness = trainer version
    minus this)."""
    return min((r.min_version for r in self.rollouts), default=0)

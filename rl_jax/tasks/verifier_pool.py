"""Concurrent, fault-tolerant scoring of completions: a WorkerPool (rl_jax.tasks.worker_pool)
whose handler is `task.reward(example, completion_text)`.

Settings come from the verifier config section (backend, workers, timeout_s, retries,
latency*, failure_prob); timeouts, retries, injected latency and failures behave as
worker_pool's docstring says. A call that times out or fails scores reward 0
(correct 0, format 0). `VerifyResult.reward` is the call's Reward.
"""
from __future__ import annotations

from typing import Any, Callable

from rl_jax.tasks.base import Example, Task, make_reward
from rl_jax.tasks.worker_pool import BACKENDS, STATUSES, CallResult, WorkerPool

VerifyResult = CallResult
__all__ = ["BACKENDS", "STATUSES", "VerifierPool", "VerifyResult"]


class _Score:
  """The verifier handler: payload (example, text) -> task.reward (picklable with the task)."""

  def __init__(self, task: Task):
    self.task = task

  def __call__(self, payload):
    example, text = payload
    return self.task.reward(example, text)


class VerifierPool(WorkerPool):
  """Scores completions with `task.reward` concurrently (see the module docstring)."""

  def __init__(self, task: Task, verifier_cfg, seed: int = 0):
    super().__init__(_Score(task), verifier_cfg, seed=seed, section="verifier",
                     name="verifier",
                     failure_value=make_reward(correct=0.0, format_ok=0.0, format_reward=0.0))
    self.task = task

  def submit(self, key: Any, example: Example, completion_text: str,
             callback: Callable[[Any, VerifyResult], None] | None = None) -> None:
    """Queues the scoring of one completion; raises RuntimeError after close()."""
    self.submit_call(key, (example, completion_text), callback)

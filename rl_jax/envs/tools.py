"""The tool pool: an environment's tool calls on the verifier pool's machinery.

`ToolPool` is a rl_jax.tasks.worker_pool.WorkerPool whose handler is `env.tool`, set up
from the env.tool config section (backend, workers, timeout_s, retries, latency*,
failure_prob): every call gets the pool's timeouts, retries, failure accounting and
injected latency, drawn per (seed, call index, attempt). A call that fails or times out
after its retries delivers value None (the environment's error observation).
"""
from __future__ import annotations

from typing import Any, Callable

from rl_jax.tasks.worker_pool import CallResult, WorkerPool

__all__ = ["CallResult", "ToolPool"]


class ToolPool(WorkerPool):
  """Runs env.tool(request) calls concurrently (see the module docstring)."""

  def __init__(self, env, tool_cfg, seed: int = 0):
    super().__init__(env.tool, tool_cfg, seed=seed, section="env.tool", name="tool",
                     failure_value=None)

  def submit(self, key: Any, request: Any,
             callback: Callable[[Any, CallResult], None] | None = None) -> None:
    """Queues one tool call; raises RuntimeError after close()."""
    self.submit_call(key, request, callback)

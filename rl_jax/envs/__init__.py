"""rl_jax.envs: multi-turn environments (tool use) for tasks that have one.

  base        Environment, Episode, ToolCall, End, make_turn_end (the interface)
  tools       ToolPool: tool calls on the verifier pool's machinery
  episodes    run_episodes: whole episodes on a generator with the tool called inline
              (held-out evaluation)
  calculator  the calculator task's environment

`make_env(task, env_cfg)` gives the environment of a task, or None for a single-turn
task (every built-in task but calculator). Nothing here imports model code.
"""
from __future__ import annotations

from rl_jax.envs.base import End, Environment, Episode, ToolCall, make_turn_end

__all__ = ["End", "Environment", "Episode", "ToolCall", "episode_budget", "make_env",
           "make_turn_end"]


def _calculator(env_cfg):
  from rl_jax.envs.calculator import CalculatorEnv
  return CalculatorEnv(max_turns=env_cfg.max_turns)


_ENVS = {"calculator": _calculator}


def make_env(task, env_cfg) -> Environment | None:
  """The environment of `task` (by task.name), None for single-turn tasks."""
  factory = _ENVS.get(task.name)
  return None if factory is None else factory(env_cfg)


def episode_budget(cfg) -> int:
  """Completion tokens of one episode, model and observation: env.max_total_tokens, or
  sampler.max_new_tokens when that is 0."""
  return int(cfg.env.max_total_tokens or cfg.sampler.max_new_tokens)

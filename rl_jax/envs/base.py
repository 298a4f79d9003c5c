"""Environments: episodes in which the model writes turns and the environment answers.

An episode starts from a task example's prompt. The model writes a turn, which ends at
one of the environment's stop strings (the closing tag of a tool call, e.g. "</calc>")
or at end of text. After a turn that ended at a stop string the episode decides
(`Episode.step`):

  ToolCall(request)  env.tool(request) runs in the tool pool (rl_jax.envs.tools: the
                     verifier pool's machinery, with its timeouts, retries, failure
                     accounting and injected latency); `Episode.observe(value)` turns the
                     result into the observation text appended to the episode, and the
                     model continues after it
  End(reason)        the episode ends now; reason is the rollout's finish_reason

End of text or the token budget end the episode in the generator. The episode's reward
is the task's verifier on the whole completion text (model turns and observations).

Limits (the env config section):
  env.max_turns         model turns per episode: a tool call in turn env.max_turns ends
                        the episode (End("length", "max_turns")), so no episode has more
  env.max_total_tokens  completion tokens per episode, model and observation tokens
                        together (the generator's episode budget; an observation that
                        does not fit is cut and ends the episode with "length")

Tool failures: a call that raises or times out (after env.tool.retries) gives the model
the error observation `observe(None)` (the calculator's "<result>error</result>"); the
episode continues, so the model can still answer, and the failure is counted
(env/tool_failures_total, env/tool_timeouts_total).

Observations are tokenized on their own (tokenizer.encode of the observation text) and
appended after the turn's tokens; they are context only (model_mask False).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable

import numpy as np

from rl_jax.tasks.base import Example


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """Run env.tool(request) (request must be picklable for the processes backend)."""
  request: Any


@dataclasses.dataclass(frozen=True)
class End:
  """End the episode: `reason` is the rollout's finish_reason, `why` says which rule."""
  reason: str = "stop"
  why: str = ""


class Episode:
  """One episode's state: its example and the counts of its tool calls.

  Subclasses of Environment may return a subclass holding more (a sandbox handle...).
  """

  def __init__(self, env: "Environment", example: Example):
    self.env, self.example = env, example
    self.tool_calls = 0
    self.tool_failures = 0

  def step(self, turn_text: str, *, turn_index: int) -> ToolCall | End:
    """What follows model turn `turn_index` (0-based), which ended at a stop string."""
    if turn_index + 1 >= self.env.max_turns:
      return End("length", "max_turns")
    action = self.env.parse_turn(self.example, turn_text)
    if isinstance(action, ToolCall):
      self.tool_calls += 1
    return action

  def observe(self, value: Any) -> str:
    """The observation text for a tool result; None: the call failed or timed out."""
    if value is None:
      self.tool_failures += 1
    return self.env.observation(value)


class Environment(abc.ABC):
  """A tool-using task's environment; see the module docstring."""
  stop_strings: tuple[str, ...] = ()

  def __init__(self, *, max_turns: int):
    if int(max_turns) < 1:
      raise ValueError(f"env.max_turns must be >= 1, got {max_turns}")
    self.max_turns = int(max_turns)

  def start(self, example: Example) -> Episode:
    return Episode(self, example)

  @abc.abstractmethod
  def parse_turn(self, example: Example, turn_text: str) -> ToolCall | End:
    """The action a turn that ended at a stop string asks for."""

  @property
  @abc.abstractmethod
  def tool(self) -> Callable[[Any], Any]:
    """The tool handler: request -> value (raises on a bad request). Runs on pool
    workers, so it must be thread-safe and, for the processes backend, picklable."""

  @abc.abstractmethod
  def observation(self, value: Any) -> str:
    """The text appended after a call: its value, or the error text for None."""


def make_turn_end(tokenizer, stop_strings) -> Callable[[np.ndarray], int | None]:
  """turn_end(turn_tokens) -> n for the generator: the turn ends after its first n tokens,
  the shortest prefix whose text contains a stop string; None while none does."""
  stops = tuple(stop_strings)

  def found(tokens) -> bool:
    text = tokenizer.decode(tokens)
    return any(s in text for s in stops)

  def turn_end(tokens: np.ndarray) -> int | None:
    tokens = np.asarray(tokens).tolist()
    if not stops or not found(tokens):
      return None
    n = len(tokens)
    # The stop string appeared among the newest tokens: walk back to where it starts
    # to be contained (a few decodes; a multi-token stop string may end mid-token).
    while n > 1 and found(tokens[:n - 1]):
      n -= 1
    return n
  return turn_end

"""The calculator environment of the calculator task (rl_jax.tasks.calculator).

A model turn that ends with "</calc>" is a call: its expression is the text between the
turn's last "<calc>" and the closing tag (the whole turn before the tag when there is no
opening tag). The tool evaluates it (`evaluate_call`: integers and + - *, bounded size);
the observation is "<result>VALUE</result>", or "<result>error</result>" when the
expression is malformed or the call fails or times out in the tool pool.
"""
from __future__ import annotations

from rl_jax.envs.base import Environment, ToolCall
from rl_jax.tasks import calculator as calc


class CalculatorTool:
  """The tool handler: expression -> value text (module level, so it pickles)."""

  def __call__(self, expression: str) -> str:
    return calc.evaluate_call(expression)


class CalculatorEnv(Environment):
  stop_strings = calc.CalculatorTask.stop_strings

  def parse_turn(self, example, turn_text: str) -> ToolCall:
    del example
    body = turn_text.rpartition(calc.CALL_CLOSE)[0]
    return ToolCall(body.rpartition(calc.CALL_OPEN)[2])

  @property
  def tool(self) -> CalculatorTool:
    return CalculatorTool()

  def observation(self, value) -> str:
    return calc.observation(value)

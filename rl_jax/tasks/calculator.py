"""Multiplication with a calculator tool: "37*48=" -> "<calc>37*48</calc><result>1776</result>1776".

Example i draws task.num_terms operands; each operand first draws its number of digits
uniformly from 1..task.digits, then its value uniformly among the numbers of that many
digits (0..9 for one digit), so small products (which a small model can memorise) mix
with large ones (which it cannot compute in its head). Operators come uniformly from
task.operators (chars of "+-*"; the default is "*"), with the usual precedence.

The episode (rl_jax.envs.calculator) lets the model call the tool any number of times,
up to env.max_turns model turns: a model turn that ends with CALL_CLOSE is a call; the
environment appends `<result>VALUE</result>` (or `<result>error</result>` when the call
cannot be evaluated, fails or times out) and the model continues. The completion text
scored here is the whole episode: model turns and observations.

Reward: the final answer is the text after the last RESULT_CLOSE (the whole completion
when no tool was called); it is correct when, stripped, it is exactly one integer equal
to the answer (as in the arithmetic task). format = 1 when the final answer is one
integer at all.

Warm-up demonstrations use the tool in a fixed share of the examples,
task.tool_demo_fraction, chosen by a hash of the prompt (so an example is always
demonstrated the same way); the others answer directly. The supervised loss covers the
model's parts only (`demonstration_segments`): the observation is context.
"""
from __future__ import annotations

import re

import numpy as np

from rl_jax.tasks import answers
from rl_jax.tasks.arithmetic import ARITHMETIC_OPERATORS, evaluate_terms
from rl_jax.tasks.base import (Example, ProceduralTask, Reward, TaskError, heldout_score,
                               make_reward, prompt_uid, register_task)

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
TOOL_ERROR = "error"
# A tool call longer than this is rejected without evaluation (bounded work per call).
MAX_CALL_CHARS = 64
_CALL = re.compile(r"\s*[0-9]{1,18}(\s*[-+*]\s*[0-9]{1,18}){0,7}\s*")
_TERM = re.compile(r"[0-9]+|[-+*]")


def evaluate_call(expression: str) -> str:
  """The calculator: the value of "a op b op ..." (integers, + - *, * first) as text;
  ValueError for anything else."""
  if len(expression) > MAX_CALL_CHARS or _CALL.fullmatch(expression) is None:
    raise ValueError(f"not an expression of integers and + - *: {expression[:MAX_CALL_CHARS]!r}")
  parts = _TERM.findall(expression)
  return str(evaluate_terms(terms=[int(t) for t in parts[::2]], operators="".join(parts[1::2])))


def observation(result: str | None) -> str:
  """The text the environment appends after a call: the value, or TOOL_ERROR (None)."""
  return f"{RESULT_OPEN}{TOOL_ERROR if result is None else result}{RESULT_CLOSE}"


def final_answer(completion_text: str) -> str:
  """The text after the last observation (the whole text when there is none)."""
  return completion_text.rpartition(RESULT_CLOSE)[2]


class CalculatorTask(ProceduralTask):
  name = "calculator"
  stop_strings = (CALL_CLOSE,)  # a model turn ends with a tool call

  def __init__(self, *, digits: int, num_terms: int, operators: str,
               tool_demo_fraction: float, **kwargs):
    super().__init__(**kwargs)
    self._set_shape(digits=digits, num_terms=num_terms, operators=operators,
                    allowed=ARITHMETIC_OPERATORS)
    if not 0.0 <= float(tool_demo_fraction) <= 1.0:
      raise TaskError(f"task.tool_demo_fraction must be in [0, 1], got {tool_demo_fraction}.")
    self.tool_demo_fraction = float(tool_demo_fraction)

  @classmethod
  def from_config(cls, task_cfg, *, seed: int, on_bad_line: str):
    del on_bad_line
    return cls(digits=task_cfg.digits, num_terms=task_cfg.num_terms,
               operators=task_cfg.operators, tool_demo_fraction=task_cfg.tool_demo_fraction,
               seed=seed, format_reward=task_cfg.format_reward,
               heldout_size=task_cfg.heldout_size, heldout_fraction=task_cfg.heldout_fraction)

  def _generate(self, rng: np.random.Generator) -> Example:
    terms = []
    for _ in range(self.num_terms):
      d = int(rng.integers(1, self.digits + 1))
      terms.append(int(rng.integers(0 if d == 1 else 10**(d - 1), 10**d)))
    ops = "".join(self.operators[k] for k in
                  rng.integers(0, len(self.operators), size=self.num_terms - 1))
    expression = str(terms[0]) + "".join(op + str(t) for op, t in zip(ops, terms[1:]))
    answer = str(evaluate_terms(terms=terms, operators=ops))
    return Example(uid=prompt_uid(self.name, expression + "="), prompt=expression + "=",
                   answer=answer, meta={"expression": expression})

  def reward(self, example: Example, completion_text: str) -> Reward:
    got = answers.canonical_integer(final_answer(completion_text))
    return make_reward(correct=got is not None and got == example.answer,
                       format_ok=got is not None, format_reward=self.format_reward,
                       parsed=answers.preview(got),
                       tool_calls=completion_text.count(CALL_CLOSE))

  def uses_tool_in_demo(self, example: Example) -> bool:
    # A hash independent of the held-out split's (which uses the prompt's own hash).
    return heldout_score("demo:" + example.prompt) < self.tool_demo_fraction

  def demonstration_segments(self, example: Example) -> list[tuple[str, bool]]:
    """The demonstration as (text, written by the model) pieces; observations are not."""
    if not self.uses_tool_in_demo(example):
      return [(example.answer, True)]
    expression = example.meta["expression"]
    return [(CALL_OPEN + expression + CALL_CLOSE, True),
            (observation(evaluate_call(expression)), False), (example.answer, True)]

  def demonstration(self, example: Example) -> str:
    return "".join(text for text, _ in self.demonstration_segments(example))


register_task(CalculatorTask.name, CalculatorTask.from_config)

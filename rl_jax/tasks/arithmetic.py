"""Procedural integer arithmetic: "12+34=" -> "46".

Example i draws task.num_terms operands uniformly from [0, 10**task.digits) and the
task.num_terms - 1 operators uniformly from task.operators (chars of "+-*"); the answer
uses the usual precedence (* before + and -). The completion is correct when, stripped
of surrounding whitespace, it is exactly one integer equal to the answer ("46", " 46 ",
"+46" and "046" pass; "46 47", "46.0", "4 6" fail). format = 1 when the completion is one
integer at all.
"""
from __future__ import annotations

import numpy as np

from rl_jax.tasks import answers
from rl_jax.tasks.base import (Example, ProceduralTask, Reward, make_reward,
                               prompt_uid, register_task)

ARITHMETIC_OPERATORS = "+-*"


def evaluate_terms(*, terms: list[int], operators: str) -> int:
  """Value of terms[0] op[0] terms[1] ... with * binding tighter than + and -."""
  total, product, sign = 0, terms[0], 1
  for op, term in zip(operators, terms[1:]):
    if op == "*":
      product *= term
    else:
      total += sign * product
      product, sign = term, (1 if op == "+" else -1)
  return total + sign * product


class ArithmeticTask(ProceduralTask):
  name = "arithmetic"

  def __init__(self, *, digits: int, num_terms: int, operators: str, **kwargs):
    super().__init__(**kwargs)
    self._set_shape(digits=digits, num_terms=num_terms, operators=operators,
                    allowed=ARITHMETIC_OPERATORS)

  def _generate(self, rng: np.random.Generator) -> Example:
    terms = [int(t) for t in rng.integers(0, 10**self.digits, size=self.num_terms)]
    ops = "".join(self.operators[k] for k in
                  rng.integers(0, len(self.operators), size=self.num_terms - 1))
    prompt = str(terms[0]) + "".join(op + str(t) for op, t in zip(ops, terms[1:])) + "="
    answer = str(evaluate_terms(terms=terms, operators=ops))
    return Example(uid=prompt_uid(self.name, prompt), prompt=prompt, answer=answer)

  def reward(self, example: Example, completion_text: str) -> Reward:
    got = answers.canonical_integer(completion_text)
    return make_reward(correct=got is not None and got == example.answer,
                       format_ok=got is not None, format_reward=self.format_reward,
                       parsed=answers.preview(got))


register_task(ArithmeticTask.name, ArithmeticTask.from_config)

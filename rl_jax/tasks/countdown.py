"""Countdown: combine given numbers with + - * / and parentheses to hit a target.

Prompt "3 5 7 -> 22:", a correct completion "3*5+7". Example i draws task.num_terms
numbers uniformly from [1, 10**task.digits) and builds the target by repeatedly
combining two random pool entries with a random operator from task.operators (chars of
"+-*/"; a subtraction is ordered to stay >= 0, a division is used only when exact), so
every target is reachable using all numbers; the construction is the demonstration.

Verification never evaluates code: a recursive-descent parser over the grammar

  expr   := term (("+" | "-") term)*
  term   := factor (("*" | "/") factor)*
  factor := INTEGER | "(" expr ")"

(ASCII digits, spaces allowed, no unary minus, no other characters) computes the value
with exact fractions. The completion is correct when it parses, each integer literal is
one of the given numbers with each given number used at most once (a number listed
twice may be used twice), and the value equals the target. format = 1 when it parses
and respects the number rules. Inputs are bounded (length, literal digits, nesting,
intermediate size), so "9**9**9" or a 10**5-digit literal is rejected cheaply.
"""
from __future__ import annotations

import collections
from fractions import Fraction

import numpy as np

from rl_jax.tasks.base import (Example, ProceduralTask, Reward, TaskError, make_reward,
                               prompt_uid, register_task)

COUNTDOWN_OPERATORS = "+-*/"
MAX_EXPRESSION_CHARS = 256
MAX_LITERAL_DIGITS = 18
MAX_DEPTH = 32
# |numerator| and denominator bound for every intermediate value.
MAX_MAGNITUDE = 10**40
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3
_MAX_GENERATION_ATTEMPTS = 100


class ExpressionError(ValueError):
  """A completion is not a valid countdown expression."""


class _Parser:
  """Parses and evaluates one expression, consuming numbers from a multiset."""

  def __init__(self, text: str, available: collections.Counter):
    self._text = text
    self._pos = 0
    self._available = available

  def _peek(self) -> str:
    while self._pos < len(self._text) and self._text[self._pos] == " ":
      self._pos += 1
    return self._text[self._pos] if self._pos < len(self._text) else ""

  def parse(self) -> Fraction:
    value = self._expr(0)
    if self._peek():
      raise ExpressionError(f"unexpected {self._peek()!r} at position {self._pos}")
    return value

  def _expr(self, depth: int) -> Fraction:
    value = self._term(depth)
    while self._peek() in ("+", "-"):
      op = self._text[self._pos]
      self._pos += 1
      value = _apply(op, value, self._term(depth))
    return value

  def _term(self, depth: int) -> Fraction:
    value = self._factor(depth)
    while self._peek() in ("*", "/"):
      op = self._text[self._pos]
      self._pos += 1
      value = _apply(op, value, self._factor(depth))
    return value

  def _factor(self, depth: int) -> Fraction:
    ch = self._peek()
    if ch == "(":
      if depth >= MAX_DEPTH:
        raise ExpressionError(f"parentheses nested deeper than {MAX_DEPTH}")
      self._pos += 1
      value = self._expr(depth + 1)
      if self._peek() != ")":
        raise ExpressionError(f"missing ')' at position {self._pos}")
      self._pos += 1
      return value
    # str.isdigit accepts other scripts' digits; only ASCII digits are literals.
    start = self._pos
    while self._pos < len(self._text) and self._text[self._pos] in "0123456789":
      self._pos += 1
    literal = self._text[start:self._pos]
    if not literal:
      raise ExpressionError(f"expected a number or '(' at position {start}, got {ch!r}")
    if len(literal) > MAX_LITERAL_DIGITS:
      raise ExpressionError(f"number with {len(literal)} digits is not a given number")
    n = int(literal)
    if self._available[n] <= 0:
      raise ExpressionError(f"{n} is not a given number or is used too often")
    self._available[n] -= 1
    return Fraction(n)


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction:
  if op == "/":
    if b == 0:
      raise ExpressionError("division by zero")
    value = a / b
  else:
    value = a + b if op == "+" else a - b if op == "-" else a * b
  if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
    raise ExpressionError("intermediate value too large")
  return value


def evaluate_expression(*, text: str, numbers: list[int]) -> tuple[Fraction, list[int]]:
  """(value, numbers used) of a countdown expression; raises ExpressionError if invalid."""
  text = text.strip()
  if not text:
    raise ExpressionError("empty expression")
  if len(text) > MAX_EXPRESSION_CHARS:
    raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
  available = collections.Counter(numbers)
  value = _Parser(text, available).parse()
  used = sorted((collections.Counter(numbers) - available).elements())
  return value, used


def _combine(a: tuple[Fraction, str, int], b: tuple[Fraction, str, int],
             op: str) -> tuple[Fraction, str, int]:
  """(value, text, precedence) of a op b, parenthesising operands only where needed."""
  prec = _PRECEDENCE[op]
  left = a[1] if a[2] >= prec else f"({a[1]})"
  # a - (b + c) and a / (b * c) need parentheses at equal precedence too.
  right = b[1] if b[2] > prec or (b[2] == prec and op in "+*") else f"({b[1]})"
  return _apply(op, a[0], b[0]), f"{left}{op}{right}", prec


class CountdownTask(ProceduralTask):
  name = "countdown"

  def __init__(self, *, digits: int, num_terms: int, operators: str, **kwargs):
    super().__init__(**kwargs)
    self._set_shape(digits=digits, num_terms=num_terms, operators=operators,
                    allowed=COUNTDOWN_OPERATORS)
    if set(operators) == {"/"}:
      raise TaskError("task.operators='/' alone rarely gives integer targets; "
                      "add '+', '-' or '*'.")

  def _generate(self, rng: np.random.Generator) -> Example:
    numbers = [int(n) for n in rng.integers(1, 10**self.digits, size=self.num_terms)]
    for _ in range(_MAX_GENERATION_ATTEMPTS):
      pool = [(Fraction(n), str(n), _ATOM) for n in numbers]
      try:
        while len(pool) > 1:
          i, j = rng.choice(len(pool), size=2, replace=False)
          a, b = pool[i], pool[j]
          op = self.operators[int(rng.integers(len(self.operators)))]
          if op == "/" and (b[0] == 0 or (a[0] / b[0]).denominator != 1):
            op = "*" if "*" in self.operators else "+" if "+" in self.operators else "-"
          if op == "-" and a[0] < b[0]:
            a, b = b, a
          pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [_combine(a, b, op)]
      except ExpressionError:
        # A product beyond MAX_MAGNITUDE: the verifier would reject this solution.
        continue
      value, text, _ = pool[0]
      if value.denominator == 1 and value >= 0:
        prompt = " ".join(map(str, numbers)) + f" -> {value.numerator}:"
        return Example(uid=prompt_uid(self.name, prompt), prompt=prompt,
                       answer=str(value.numerator),
                       meta={"numbers": numbers, "solution": text})
    raise TaskError(f"countdown could not build an integer target from {numbers} with "
                    f"task.operators={self.operators!r}.")

  def reward(self, example: Example, completion_text: str) -> Reward:
    try:
      value, used = evaluate_expression(text=completion_text,
                                        numbers=example.meta["numbers"])
    except ExpressionError as e:
      return make_reward(correct=0.0, format_ok=0.0, format_reward=self.format_reward,
                         reason=str(e))
    return make_reward(correct=value == int(example.answer), format_ok=1.0,
                       format_reward=self.format_reward, value=str(value), used=used)

  def demonstration(self, example: Example) -> str:
    return example.meta["solution"]


register_task(CountdownTask.name, CountdownTask.from_config)

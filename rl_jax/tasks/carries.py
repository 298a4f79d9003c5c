"""Addition whose reward pays for the working shown: "47+85=" -> "7+5=12 4+8+1=13 =132".

Example i draws task.num_terms = 2 operands uniformly from [0, 10**task.digits). The
working is one step per column, least significant first, over as many columns as the
longer operand has digits (a missing digit is 0): "a+b=s", or "a+b+1=s" when the column
before carried (s >= 10), separated by single spaces; then "=" and the sum. A bare
answer is just the sum ("132").

Reward of completion c (stripped): answer = c when c is one integer, else the integer
after the last " =" of c (None when there is none);
  correct = [answer == the sum]           (Reward.score)
  shown   = (steps that equal the expected step at their position) / columns, 0 for a
            bare answer
  total   = correct * (1 + shown) / 2 + task.format_reward * format
so a correct bare answer earns 0.5 and a correct answer with every step shown earns 1:
completions grow longer as the policy learns that showing the carries pays (the
workload of configs/length_drift.py). format = 1 when an answer was found.
Warm-up demonstrations show the working for a task.working_demo_fraction share of the
prompts (a hash of the prompt), bare answers for the rest.
"""
from __future__ import annotations

import numpy as np

from rl_jax.tasks import answers
from rl_jax.tasks.base import (Example, ProceduralTask, Reward, TaskError, heldout_score,
                               prompt_uid, register_task)


def working_steps(a: int, b: int) -> list[str]:
  """The column steps of a + b, least significant column first."""
  da, db = str(a)[::-1], str(b)[::-1]
  steps, carry = [], 0
  for k in range(max(len(da), len(db))):
    x = int(da[k]) if k < len(da) else 0
    y = int(db[k]) if k < len(db) else 0
    s = x + y + carry
    steps.append(f"{x}+{y}{'+1' if carry else ''}={s}")
    carry = int(s >= 10)
  return steps


def parse(text: str) -> tuple[str | None, list[str]]:
  """(canonical answer or None, the steps before it) of a completion."""
  text = text.strip()
  bare = answers.canonical_integer(text)
  if bare is not None:
    return bare, []
  head, sep, tail = text.rpartition(" =")
  if not sep and text.startswith("="):
    head, tail = "", text[1:]
  return answers.canonical_integer(tail), head.split()


class CarriesTask(ProceduralTask):
  name = "carries"

  def __init__(self, *, digits: int, num_terms: int, working_demo_fraction: float,
               **kwargs):
    super().__init__(**kwargs)
    self._set_shape(digits=digits, num_terms=num_terms, operators="+", allowed="+")
    if self.num_terms != 2:
      raise TaskError(f"task.num_terms must be 2 for {self.name} (column working of two "
                      f"operands), got {num_terms}.")
    if not 0.0 <= float(working_demo_fraction) <= 1.0:
      raise TaskError(f"task.working_demo_fraction must be in [0, 1], "
                      f"got {working_demo_fraction}.")
    self.working_demo_fraction = float(working_demo_fraction)

  @classmethod
  def from_config(cls, task_cfg, *, seed: int, on_bad_line: str):
    del on_bad_line
    return cls(digits=task_cfg.digits, num_terms=task_cfg.num_terms,
               working_demo_fraction=task_cfg.working_demo_fraction, seed=seed,
               format_reward=task_cfg.format_reward, heldout_size=task_cfg.heldout_size,
               heldout_fraction=task_cfg.heldout_fraction)

  def _generate(self, rng: np.random.Generator) -> Example:
    a, b = (int(t) for t in rng.integers(0, 10**self.digits, size=2))
    prompt = f"{a}+{b}="
    return Example(uid=prompt_uid(self.name, prompt), prompt=prompt, answer=str(a + b),
                   meta={"steps": working_steps(a, b)})

  def reward(self, example: Example, completion_text: str) -> Reward:
    got, steps = parse(completion_text)
    expected = example.meta["steps"]
    correct = float(got is not None and got == example.answer)
    shown = sum(s == e for s, e in zip(steps, expected)) / len(expected)
    return Reward(score=correct, total=correct * (1 + shown) / 2 +
                  self.format_reward * float(got is not None),
                  components={"correct": correct, "format": float(got is not None),
                              "working": shown},
                  info={"parsed": answers.preview(got)})

  def shows_working_in_demo(self, example: Example) -> bool:
    # A hash independent of the held-out split's (which uses the prompt's own hash).
    return heldout_score("demo:" + example.prompt) < self.working_demo_fraction

  def demonstration(self, example: Example) -> str:
    if not self.shows_working_in_demo(example):
      return example.answer
    return " ".join(example.meta["steps"]) + " =" + example.answer


register_task(CarriesTask.name, CarriesTask.from_config)

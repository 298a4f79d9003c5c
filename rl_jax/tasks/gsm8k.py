"""GSM8K-style word problems from a JSONL file of {"question", "answer"} records.

The reference is the number after the last "####" of the record's answer (the GSM8K
convention: worked solution, then "#### 72"); the prompt is the question followed by
"\\nAnswer:" so that a base model continues with its solution.

The completion's answer is its last "#### N" or last \\boxed{N}, whichever comes later,
else its last number (see rl_jax.tasks.answers.extract_final_answer). Numbers compare
after normalisation: commas, "$", a leading "+" and trailing fraction zeros are ignored
("$1,234.50" == "1234.5"); only ASCII digits count. format = 1 when the completion marks
its answer with "####" or \\boxed{} followed by a number. The record's worked solution
is the demonstration.
"""
from __future__ import annotations

import os
from typing import Any

from rl_jax.data.jsonl import read_jsonl, require_str
from rl_jax.tasks import answers
from rl_jax.tasks.base import (DatasetTask, Example, Reward, TaskError, make_reward,
                               register_task)

PROMPT_SUFFIX = "\nAnswer:"


def reference_answer(solution: str) -> str:
  """Canonical number after the last "####" of a GSM8K solution; ValueError if none."""
  got, source = answers.extract_final_answer(solution)
  if source != "####" or got is None:
    raise ValueError("answer has no '#### <number>' line")
  return got


def score_numeric(*, reference: str, completion_text: str,
                  format_reward: float) -> Reward:
  """Correct when the completion's final answer equals the canonical `reference`."""
  got, source = answers.extract_final_answer(completion_text)
  marked = got is not None and source in ("####", "boxed")
  return make_reward(correct=got is not None and got == reference, format_ok=marked,
                     format_reward=format_reward, extracted=answers.preview(got),
                     source=source)


class GSM8KTask(DatasetTask):
  name = "gsm8k"

  def reward(self, example: Example, completion_text: str) -> Reward:
    return score_numeric(reference=example.answer, completion_text=completion_text,
                         format_reward=self.format_reward)

  def demonstration(self, example: Example) -> str:
    return example.meta["solution"]


def _from_config(task_cfg, *, seed: int, on_bad_line: str) -> GSM8KTask:
  del seed
  if not task_cfg.path:
    raise TaskError("task.name='gsm8k' needs task.path, a JSONL file of "
                    "{\"question\", \"answer\"} records.")
  base = os.path.basename(task_cfg.path)

  def parse(obj: dict[str, Any], line_no: int) -> Example:
    question = require_str(obj, "question")
    solution = require_str(obj, "answer")
    return Example(uid=f"gsm8k:{base}:{line_no}", prompt=question + PROMPT_SUFFIX,
                   answer=reference_answer(solution), meta={"solution": solution})

  examples, skipped = read_jsonl(task_cfg.path, parse=parse, on_bad_line=on_bad_line)
  return GSM8KTask(examples=examples, source=task_cfg.path,
                   format_reward=task_cfg.format_reward,
                   heldout_size=task_cfg.heldout_size,
                   heldout_fraction=task_cfg.heldout_fraction, skipped_lines=skipped)


register_task(GSM8KTask.name, _from_config)

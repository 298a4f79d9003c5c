"""GSM8K-style word problems from a file of {"question", "answer"} records.

The file is JSON lines or the Hugging Face Parquet split (rl_jax.data.records). The
reference is the number after the last "####" of the record's answer (the GSM8K
convention: worked solution, then "#### 72"). The prompt is task.prompt_template with
"{question}" replaced by the question; the default "{question}\\nAnswer:" lets a base
model continue with its solution, a chat config asks for a final "#### <number>" line
instead. task.eval_path names a separate held-out file (e.g. the test split).

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

from rl_jax.data.jsonl import require_str
from rl_jax.data.records import read_records
from rl_jax.tasks import answers
from rl_jax.tasks.base import (DatasetTask, Example, Reward, TaskError, make_reward,
                               register_task)

QUESTION = "{question}"


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


def check_prompt_template(template: str) -> str:
  if QUESTION not in template:
    raise TaskError(f"task.prompt_template {template!r} has no {QUESTION} placeholder.")
  return template


def read_file(path: str, *, template: str, on_bad_line: str) -> tuple[list[Example], int]:
  """(examples, skipped records) of a GSM8K file; uids name the file and line/row."""
  base = os.path.basename(path)

  def parse(obj: dict[str, Any], line_no: int) -> Example:
    question = require_str(obj, "question")
    solution = require_str(obj, "answer")
    # Plain replacement, not str.format: questions and templates may contain braces.
    return Example(uid=f"gsm8k:{base}:{line_no}", prompt=template.replace(QUESTION, question),
                   answer=reference_answer(solution), meta={"solution": solution})

  return read_records(path, parse=parse, on_bad_line=on_bad_line)


def _from_config(task_cfg, *, seed: int, on_bad_line: str) -> GSM8KTask:
  del seed
  if not task_cfg.path:
    raise TaskError("task.name='gsm8k' needs task.path, a .jsonl or .parquet file of "
                    "{\"question\", \"answer\"} records.")
  template = check_prompt_template(task_cfg.get("prompt_template", QUESTION + "\nAnswer:"))
  examples, skipped = read_file(task_cfg.path, template=template, on_bad_line=on_bad_line)
  eval_examples = None
  if task_cfg.get("eval_path"):
    eval_examples, eval_skipped = read_file(task_cfg.eval_path, template=template,
                                            on_bad_line=on_bad_line)
    skipped += eval_skipped
  return GSM8KTask(examples=examples, source=task_cfg.path,
                   format_reward=task_cfg.format_reward,
                   heldout_size=task_cfg.heldout_size,
                   heldout_fraction=task_cfg.heldout_fraction, skipped_lines=skipped,
                   eval_examples=eval_examples)


register_task(GSM8KTask.name, _from_config)

"""Generic prompt files: records {"prompt": str, "answer": str} scored by a matcher.

The file is JSON lines or Parquet (rl_jax.data.records); task.eval_path names a
separate held-out file.

task.matcher:
  exact    the stripped completion equals the stripped answer; format = completion
           not blank.
  numeric  the answer is one number; the completion's final answer (last "#### N",
           last \\boxed{N}, else last number) must equal it after normalisation (as
           gsm8k); format = the answer is marked with "####" or \\boxed{}.
  regex    the answer is a Python regular expression that must match the whole
           stripped completion; format = completion not blank. Patterns are compiled
           when the file is read, so a bad pattern is reported with its line. A pattern
           can backtrack catastrophically on adversarial completions: the verifier
           pool's timeout bounds that (use verifier.backend="processes" to also stop
           the CPU work).
"""
from __future__ import annotations

import os
import re
from typing import Any

from rl_jax.data.jsonl import require_str
from rl_jax.data.records import read_records
from rl_jax.tasks import answers
from rl_jax.tasks.base import (DatasetTask, Example, Reward, TaskError, make_reward,
                               register_task)
from rl_jax.tasks.gsm8k import score_numeric

MATCHERS = ("exact", "numeric", "regex")


class JsonlTask(DatasetTask):
  name = "jsonl"

  def __init__(self, *, matcher: str, **kwargs):
    super().__init__(**kwargs)
    self.matcher = matcher

  def reward(self, example: Example, completion_text: str) -> Reward:
    if self.matcher == "numeric":
      return score_numeric(reference=example.answer, completion_text=completion_text,
                           format_reward=self.format_reward)
    text = completion_text.strip()
    if self.matcher == "exact":
      correct = text == example.answer.strip()
    else:
      correct = re.fullmatch(example.meta["pattern"], text) is not None
    return make_reward(correct=correct, format_ok=bool(text),
                       format_reward=self.format_reward)


def _from_config(task_cfg, *, seed: int, on_bad_line: str) -> JsonlTask:
  del seed
  matcher = task_cfg.matcher
  if matcher not in MATCHERS:
    raise TaskError(f"task.matcher must be one of {MATCHERS}, got {matcher!r}.")
  if not task_cfg.path:
    raise TaskError("task.name='jsonl' needs task.path, a .jsonl or .parquet file of "
                    "{\"prompt\", \"answer\"} records.")

  def parse(obj: dict[str, Any], line_no: int, base: str) -> Example:
    prompt = require_str(obj, "prompt")
    answer = require_str(obj, "answer")
    meta = {}
    if matcher == "numeric":
      canonical = answers.canonical_number(answer)
      if canonical is None:
        raise ValueError(f"answer {answer[:40]!r} is not a number (task.matcher=numeric)")
      answer = canonical
    elif matcher == "regex":
      try:
        meta["pattern"] = re.compile(answer)
      except re.error as e:
        raise ValueError(f"answer is not a valid regex ({e})") from None
    return Example(uid=f"jsonl:{base}:{line_no}", prompt=prompt, answer=answer, meta=meta)

  def read(path):
    base = os.path.basename(path)
    return read_records(path, parse=lambda obj, n: parse(obj, n, base),
                        on_bad_line=on_bad_line)

  examples, skipped = read(task_cfg.path)
  eval_examples = None
  if task_cfg.get("eval_path"):
    eval_examples, eval_skipped = read(task_cfg.eval_path)
    skipped += eval_skipped
  return JsonlTask(matcher=matcher, examples=examples, source=task_cfg.path,
                   format_reward=task_cfg.format_reward,
                   heldout_size=task_cfg.heldout_size,
                   heldout_fraction=task_cfg.heldout_fraction, skipped_lines=skipped,
                   eval_examples=eval_examples)


register_task(JsonlTask.name, _from_config)

"""Grain pipelines of training prompts.

The pipeline over training indices 0 <= i < task.num_train (PROCEDURAL_TRAIN_SIZE
for procedural tasks, whose example(i) already skips held-out prompts) is

  range(num_train) -> shuffle(seed)       grain index shuffle, reshuffled every epoch
                   -> repeat(num_epochs)  data.num_epochs; 0 repeats forever
                   -> [process_index::process_count]
                   -> map(record)

so processes read disjoint positions of one global order and together read all of it.
Each record is {"uid": str, "index": int (for task.example), "prompt_tokens": int32
[p], "truncated": bool}.

Prompt tokens are [bos] + tokenizer.encode(prompt) (no bos when tokenizer.bos_id is
None). With data.chat the prompt is first rendered as a chat by the tokenizer's chat
template, [system: data.system_prompt (when set), user: prompt] plus the generation
prompt, and the tokens are tokenizer.encode(rendered) with no bos added: the template
writes any bos it wants, as transformers' apply_chat_template(tokenize=True) does. A
prompt of more than data.max_prompt_length tokens is either truncated to its LAST
max_prompt_length - 1 tokens after the bos (the end holds the question and the answer
cue such as "=" or "Answer:", which the completion has to follow; a chat prompt keeps
its last max_prompt_length tokens) or dropped, per data.on_long_prompt. Counters
(`PromptSource.counters`) count records as they are consumed: truncated, dropped, plus
skipped_lines reported by the task's file reader. They are part of the saved state, so a
resumed run continues them.

The tokenizer is duck-typed: encode(text, add_bos=False) -> list[int], bos_id, eos_id,
and for data.chat apply_chat_template(messages) -> str.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import grain
import numpy as np

from rl_jax.data.jsonl import DataError

ON_LONG_PROMPT = ("truncate", "drop")
# A pipeline that drops this many prompts in a row is treated as misconfigured rather
# than spinning forever.
_MAX_CONSECUTIVE_DROPS = 1000


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """Prompts as one user turn (after an optional system turn) of the tokenizer's chat."""
  system_prompt: str = ""

  def messages(self, text: str) -> list[dict[str, str]]:
    system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
    return system + [{"role": "user", "content": text}]


def chat_format(data_cfg, tokenizer) -> ChatFormat | None:
  """ChatFormat for data.chat=True (checking the tokenizer has a template), else None."""
  if not data_cfg.get("chat", False):
    return None
  if getattr(tokenizer, "chat_template", None) is None:
    raise DataError("data.chat=True needs a tokenizer with a chat template: set model.path "
                    "to a checkpoint whose tokenizer_config.json has 'chat_template' or that "
                    "has chat_template.jinja.")
  return ChatFormat(system_prompt=data_cfg.get("system_prompt", ""))


def encode_prompt(text: str, *, tokenizer, max_length: int,
                  chat: ChatFormat | None = None) -> tuple[np.ndarray, bool]:
  """(int32 tokens, truncated): [bos] + encode(text), or the rendered chat; keeps the
  end if too long."""
  if chat is not None:
    tokens = list(tokenizer.encode(tokenizer.apply_chat_template(chat.messages(text)),
                                   add_bos=False))
    head = []
  else:
    tokens = list(tokenizer.encode(text, add_bos=False))
    bos = getattr(tokenizer, "bos_id", None)
    head = [] if bos is None else [int(bos)]
  room = max_length - len(head)
  truncated = len(tokens) > room
  if truncated:
    tokens = tokens[len(tokens) - room:]
  return np.asarray(head + tokens, np.int32), truncated


def demonstration_tokens(task, example, *, tokenizer) -> tuple[list[int], np.ndarray]:
  """(tokens, bool mask) of the task's warm-up demonstration for `example`, eos included.

  The mask is False at tokens the model does not write: the observations of a tool-using
  demonstration (task.demonstration_segments: (text, written by the model) pieces, each
  tokenized on its own as the environment's observations are). Tasks without segments
  give task.demonstration(example), all True."""
  segments = getattr(task, "demonstration_segments", None)
  pieces = segments(example) if segments is not None else [(task.demonstration(example), True)]
  tokens, mask = [], []
  for text, by_model in pieces:
    ids = list(tokenizer.encode(text))
    tokens += ids
    mask += [bool(by_model)] * len(ids)
  return tokens + [tokenizer.eos_id], np.asarray(mask + [True], bool)


@dataclasses.dataclass(frozen=True)
class _MakeRecord:
  """Maps a training index to its record; a class so grain can pickle it."""
  task: Any
  tokenizer: Any
  max_length: int
  chat: ChatFormat | None = None

  def __call__(self, index: int) -> dict[str, Any]:
    example = self.task.example(int(index))
    tokens, truncated = encode_prompt(example.prompt, tokenizer=self.tokenizer,
                                      max_length=self.max_length, chat=self.chat)
    return {"uid": example.uid, "index": int(index), "prompt_tokens": tokens,
            "truncated": truncated}


def _check_data_config(data_cfg) -> None:
  if int(data_cfg.num_epochs) < 0:
    raise DataError(f"data.num_epochs must be >= 0 (0 = forever), got {data_cfg.num_epochs}.")
  if int(data_cfg.max_prompt_length) < 2:
    raise DataError(f"data.max_prompt_length must be >= 2, got {data_cfg.max_prompt_length}.")
  if data_cfg.on_long_prompt not in ON_LONG_PROMPT:
    raise DataError(f"data.on_long_prompt must be one of {ON_LONG_PROMPT}, "
                    f"got {data_cfg.on_long_prompt!r}.")


class PromptSource:
  """An iterator of prompt records with resumable state and counters.

  get_state() is a JSON-able dict; set_state() on a source built with the same task,
  config, seed and process layout continues with exactly the records the saved source
  would have produced next.
  """

  def __init__(self, *, task, dataset: grain.MapDataset, on_long_prompt: str,
               max_prompt_length: int):
    self.task = task
    self._dataset = dataset
    self._on_long_prompt = on_long_prompt
    self._max_prompt_length = max_prompt_length
    # Records are cheap to build; grain's read-ahead threads would only contend for
    # the GIL.
    self._iterator = iter(dataset.to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
    self._counts = {"truncated": 0, "dropped": 0}

  @property
  def counters(self) -> dict[str, int]:
    return {"skipped_lines": int(getattr(self.task, "skipped_lines", 0)), **self._counts}

  def __iter__(self) -> "PromptSource":
    return self

  def __next__(self) -> dict[str, Any]:
    for _ in range(_MAX_CONSECUTIVE_DROPS):
      record = next(self._iterator)
      if not record["truncated"]:
        return record
      if self._on_long_prompt == "truncate":
        self._counts["truncated"] += 1
        return record
      self._counts["dropped"] += 1
    raise DataError(f"{_MAX_CONSECUTIVE_DROPS} prompts in a row are longer than "
                    f"data.max_prompt_length={self._max_prompt_length} tokens; raise it "
                    "or set data.on_long_prompt='truncate'.")

  def get_state(self) -> dict[str, Any]:
    return {"iterator": self._iterator.get_state(), "counters": dict(self._counts)}

  def set_state(self, state: dict[str, Any]) -> None:
    self._iterator.set_state(state["iterator"])
    self._counts = {k: int(v) for k, v in state["counters"].items()}


def make_prompt_source(task, data_cfg, tokenizer, seed: int, process_index: int = 0,
                       process_count: int = 1) -> PromptSource:
  """The training prompt stream of this process (see the module docstring)."""
  _check_data_config(data_cfg)
  if not 0 <= process_index < process_count:
    raise DataError(f"process_index={process_index} is outside [0, {process_count}).")
  if task.num_train < process_count:
    raise DataError(f"task {task.name} has {task.num_train} training prompts, fewer than "
                    f"the {process_count} processes reading them.")
  dataset = grain.MapDataset.range(task.num_train)
  if data_cfg.shuffle:
    # grain takes seeds in [0, 2**32).
    dataset = dataset.shuffle(seed=int(seed) % 2**32)
  dataset = dataset.repeat(int(data_cfg.num_epochs) or None)
  dataset = dataset[process_index::process_count]
  dataset = dataset.map(_MakeRecord(task=task, tokenizer=tokenizer,
                                    max_length=int(data_cfg.max_prompt_length),
                                    chat=chat_format(data_cfg, tokenizer)))
  return PromptSource(task=task, dataset=dataset, on_long_prompt=data_cfg.on_long_prompt,
                      max_prompt_length=int(data_cfg.max_prompt_length))


def prompt_tokens(task, data_cfg, tokenizer, index: int) -> list[int]:
  """The prompt tokens of training example `index`, as the prompt stream encodes them."""
  record = _MakeRecord(task=task, tokenizer=tokenizer, max_length=int(data_cfg.max_prompt_length),
                       chat=chat_format(data_cfg, tokenizer))(index)
  return list(record["prompt_tokens"])


def heldout_records(task, data_cfg, tokenizer) -> list[dict[str, Any]]:
  """Records of task.heldout_examples(), "index" being the position in that list.

  Long prompts follow data.on_long_prompt like training prompts, so the held-out set
  only shrinks under "drop".
  """
  _check_data_config(data_cfg)
  chat = chat_format(data_cfg, tokenizer)
  records = []
  for index, example in enumerate(task.heldout_examples()):
    tokens, truncated = encode_prompt(example.prompt, tokenizer=tokenizer,
                                      max_length=int(data_cfg.max_prompt_length), chat=chat)
    if truncated and data_cfg.on_long_prompt == "drop":
      continue
    records.append({"uid": example.uid, "index": index, "prompt_tokens": tokens,
                    "truncated": truncated})
  if not records:
    raise DataError(f"every held-out prompt of task {task.name} is longer than "
                    f"data.max_prompt_length={data_cfg.max_prompt_length} tokens.")
  return records

"""Task protocol, rewards, held-out split, scoring and the task registry.

A task turns an index into an `Example` (a prompt and its reference answer) and scores
a completion against it. Completions end at the tokenizer's eos, so `completion_text`
holds no special tokens.

Reward of one completion c for example x:

  correct(x, c) in [0, 1]               the verifier's correctness score (`Reward.score`)
  format(x, c)  in [0, 1]               whether c has the expected answer shape
  total = correct + task.format_reward * format                   (`Reward.total`)

The trainer optimises `total`; accuracy and held-out curves use `score`.

Held-out split. A prompt p is held out when

  u(p) = int(sha1(p)[:8 bytes]) / 2**64 < task.heldout_fraction,

a fixed function of the prompt text alone, so the split does not depend on the run
seed, on file order or on which process asks, and a prompt text can never appear both
in the training stream and in the held-out set.
"""
from __future__ import annotations

import abc
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from rl_jax.errors import UserError

# Training indices of a procedural task: large enough that no run exhausts them, small
# enough for grain's index shuffle.
PROCEDURAL_TRAIN_SIZE = 10**7
# Draws made from the fixed held-out stream of a procedural task per held-out example
# wanted, before accepting a smaller set (small prompt spaces, e.g. 1-digit addition).
_HELDOUT_DRAWS_PER_EXAMPLE = 20
# Redraws of a training example whose prompt falls in the held-out split.
_MAX_TRAIN_REDRAWS = 1000
# Entropy word that separates the held-out stream from every training stream.
_HELDOUT_STREAM = 0x6E1D0


class TaskError(UserError, ValueError):
  """A task is misconfigured (unknown name, bad field value, unusable data)."""


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt with its reference answer.

  uid: stable across runs; procedural tasks derive it from the prompt text, file
    tasks from the file name and line number.
  meta: task-specific data the verifier needs (e.g. countdown numbers, a regex).
  """
  uid: str
  prompt: str
  answer: str
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Reward:
  """The verdict on one completion.

  score: correctness in [0, 1]. total = score + format_reward * components["format"].
  components: named parts, always including "correct" and "format".
  info: diagnostics (extracted answer, reason for rejection).
  """
  score: float
  total: float
  components: dict[str, float] = dataclasses.field(default_factory=dict)
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


def make_reward(*, correct: float, format_ok: float, format_reward: float,
                **info: Any) -> Reward:
  """Reward with total = correct + format_reward * format_ok."""
  correct, format_ok = float(correct), float(format_ok)
  return Reward(score=correct, total=correct + float(format_reward) * format_ok,
                components={"correct": correct, "format": format_ok}, info=dict(info))


@runtime_checkable
class Task(Protocol):
  """What the sampler, trainer and verifier pool need from a task.

  Training examples are addressed by index: `example(i)` for 0 <= i < num_train.
  Procedural tasks have num_train = PROCEDURAL_TRAIN_SIZE and generate example i
  deterministically from (seed, i); dataset tasks index their training records.
  """
  name: str
  procedural: bool
  format_reward: float

  @property
  def num_train(self) -> int:
    ...

  def example(self, i: int) -> Example:
    ...

  def train_examples(self) -> Sequence[Example]:
    ...

  def heldout_examples(self) -> list[Example]:
    ...

  def reward(self, example: Example, completion_text: str) -> Reward:
    ...

  def demonstration(self, example: Example) -> str:
    ...


def heldout_score(prompt: str) -> float:
  """u(p) = first 8 bytes of sha1(p) / 2**64, uniform in [0, 1)."""
  digest = hashlib.sha1(prompt.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(prompt: str, *, fraction: float) -> bool:
  return heldout_score(prompt) < fraction


def prompt_uid(name: str, prompt: str) -> str:
  """A uid derived from the prompt text: equal prompts get equal uids."""
  return f"{name}:{hashlib.sha1(prompt.encode('utf-8')).hexdigest()[:16]}"


def check_split_config(task_cfg) -> None:
  """Validates task.heldout_fraction and task.heldout_size."""
  fraction = float(task_cfg.heldout_fraction)
  if not 0.0 < fraction < 1.0:
    raise TaskError(f"task.heldout_fraction must be in (0, 1), got {fraction}.")
  if int(task_cfg.heldout_size) < 1:
    raise TaskError(f"task.heldout_size must be >= 1, got {task_cfg.heldout_size}.")


class _IndexedExamples(Sequence):
  """A lazy, read-only sequence view over `task.example(i)`."""

  def __init__(self, task: "ProceduralTask"):
    self._task = task

  def __len__(self) -> int:
    return self._task.num_train

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self._task.example(j) for j in range(*i.indices(len(self)))]
    if not -len(self) <= i < len(self):
      raise IndexError(i)
    return self._task.example(i % len(self))


class ProceduralTask(abc.ABC):
  """Base of generated tasks. Subclasses implement `_generate(rng) -> Example`.

  Training example i is the first draw from rng(seed, i, attempt), attempt = 0, 1, ...,
  whose prompt is not held out. The held-out set is the first `heldout_size` distinct
  held-out prompts of a fixed stream that ignores the run seed, so runs with different
  seeds are evaluated on the same prompts.
  """
  procedural = True
  name = ""

  def __init__(self, *, seed: int, format_reward: float, heldout_size: int,
               heldout_fraction: float):
    if int(seed) < 0:
      raise TaskError(f"seed must be >= 0 for procedural tasks, got {seed}.")
    self.seed = int(seed)
    self.format_reward = float(format_reward)
    self.heldout_size = int(heldout_size)
    self.heldout_fraction = float(heldout_fraction)
    self._heldout: list[Example] | None = None

  @classmethod
  def from_config(cls, task_cfg, *, seed: int, on_bad_line: str):
    """Registry factory for procedural tasks shaped by task.digits/num_terms/operators."""
    del on_bad_line  # procedural tasks read no file
    return cls(digits=task_cfg.digits, num_terms=task_cfg.num_terms,
               operators=task_cfg.operators, seed=seed,
               format_reward=task_cfg.format_reward, heldout_size=task_cfg.heldout_size,
               heldout_fraction=task_cfg.heldout_fraction)

  def _set_shape(self, *, digits, num_terms, operators: str, allowed: str) -> None:
    """Validates and stores task.digits, task.num_terms and task.operators."""
    if int(digits) < 1:
      raise TaskError(f"task.digits must be >= 1, got {digits}.")
    if int(num_terms) < 2:
      raise TaskError(f"task.num_terms must be >= 2, got {num_terms}.")
    if not operators or set(operators) - set(allowed):
      raise TaskError(f"task.operators must be a non-empty string of characters from "
                      f"{allowed!r} for {self.name}, got {operators!r}.")
    self.digits, self.num_terms = int(digits), int(num_terms)
    self.operators = "".join(sorted(set(operators)))

  @abc.abstractmethod
  def _generate(self, rng: np.random.Generator) -> Example:
    """One example drawn from `rng` (subclasses define the task's distribution)."""

  @property
  def num_train(self) -> int:
    return PROCEDURAL_TRAIN_SIZE

  def example(self, i: int) -> Example:
    i = int(i)
    if not 0 <= i < self.num_train:
      raise IndexError(f"{self.name} training index {i} outside [0, {self.num_train}).")
    for attempt in range(_MAX_TRAIN_REDRAWS):
      ex = self._generate(np.random.default_rng([self.seed, i, attempt]))
      if not is_heldout(ex.prompt, fraction=self.heldout_fraction):
        return ex
    raise TaskError(
        f"task {self.name}: {_MAX_TRAIN_REDRAWS} draws in a row were held out; "
        f"task.heldout_fraction={self.heldout_fraction} leaves no training prompts.")

  def train_examples(self) -> Sequence[Example]:
    return _IndexedExamples(self)

  def heldout_examples(self) -> list[Example]:
    if self._heldout is None:
      seen: dict[str, Example] = {}
      draws = _HELDOUT_DRAWS_PER_EXAMPLE * self.heldout_size / self.heldout_fraction
      for j in range(int(draws)):
        ex = self._generate(np.random.default_rng([_HELDOUT_STREAM, j]))
        if is_heldout(ex.prompt, fraction=self.heldout_fraction):
          seen.setdefault(ex.prompt, ex)
          if len(seen) == self.heldout_size:
            break
      if not seen:
        raise TaskError(f"task {self.name}: no prompt falls in the held-out split; "
                        "raise task.heldout_fraction or widen the task.")
      self._heldout = list(seen.values())
    return list(self._heldout)

  def demonstration(self, example: Example) -> str:
    return example.answer


class DatasetTask:
  """Base of file-backed tasks over a list of examples, split by `is_heldout`.

  Held-out examples are the first `heldout_size` held-out records in file order; the
  remaining held-out records are used by neither split, so the training set does not
  change with heldout_size. With `eval_examples` (a separate file, task.eval_path, such
  as GSM8K's test split) every record of `examples` trains and the held-out set is the
  first `heldout_size` of `eval_examples`.
  """
  procedural = False
  name = ""

  def __init__(self, *, examples: Sequence[Example], source: str, format_reward: float,
               heldout_size: int, heldout_fraction: float, skipped_lines: int = 0,
               eval_examples: Sequence[Example] | None = None):
    self.format_reward = float(format_reward)
    self.skipped_lines = int(skipped_lines)
    if eval_examples is not None:
      train, heldout = list(examples), list(eval_examples)
    else:
      train, heldout = [], []
      for ex in examples:
        (heldout if is_heldout(ex.prompt, fraction=heldout_fraction) else train).append(ex)
    if not train:
      raise TaskError(f"{source}: every record falls in the held-out split "
                      f"(task.heldout_fraction={heldout_fraction}); no training data.")
    if not heldout:
      raise TaskError(f"{source}: no record falls in the held-out split "
                      f"(task.heldout_fraction={heldout_fraction}).")
    self._train = train
    self._heldout = heldout[:int(heldout_size)]

  @property
  def num_train(self) -> int:
    return len(self._train)

  def example(self, i: int) -> Example:
    return self._train[int(i)]

  def train_examples(self) -> Sequence[Example]:
    return tuple(self._train)

  def heldout_examples(self) -> list[Example]:
    return list(self._heldout)

  def demonstration(self, example: Example) -> str:
    raise TaskError(f"task {self.name} has no demonstrations; set warmstart.steps=0.")


def evaluate(task: Task, examples: Sequence[Example],
             completions: Sequence[str]) -> dict[str, float]:
  """Scores completions[k] against examples[k].

  reward_mean = mean_k total_k; accuracy = mean_k [score_k == 1]; n = number scored.
  """
  if len(examples) != len(completions):
    raise ValueError(f"evaluate got {len(examples)} examples but "
                     f"{len(completions)} completions.")
  if not examples:
    return {"reward_mean": 0.0, "accuracy": 0.0, "n": 0}
  rewards = [task.reward(ex, text) for ex, text in zip(examples, completions)]
  return {"reward_mean": float(np.mean([r.total for r in rewards])),
          "accuracy": float(np.mean([r.score >= 1.0 for r in rewards])),
          "n": len(rewards)}


_REGISTRY: dict[str, Callable[..., Task]] = {}


def register_task(name: str, factory: Callable[..., Task]) -> None:
  """Adds `factory(task_cfg, *, seed, on_bad_line) -> Task` under `name`."""
  _REGISTRY[name] = factory


def task_names() -> tuple[str, ...]:
  return tuple(sorted(_REGISTRY))


def make_task(task_cfg, *, seed: int = 0, on_bad_line: str = "fail") -> Task:
  """Builds the task named by task_cfg.name.

  seed drives procedural training streams; on_bad_line (data.on_bad_line: skip | fail)
  governs malformed records in task.path.
  """
  name = task_cfg.name
  if name not in _REGISTRY:
    raise TaskError(f"task.name={name!r} is unknown; allowed: {', '.join(task_names())}.")
  check_split_config(task_cfg)
  if float(task_cfg.format_reward) < 0:
    raise TaskError(f"task.format_reward must be >= 0, got {task_cfg.format_reward}.")
  return _REGISTRY[name](task_cfg, seed=seed, on_bad_line=on_bad_line)


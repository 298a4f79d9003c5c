"""The Generator's host-side bookkeeping: admitted groups, their sequences, and the
generate call in flight.

Plain dataclasses (no JAX): rl_jax.sampler.generator schedules them, turns.py extends
them with multi-turn episode state.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, NamedTuple

import numpy as np

from rl_jax.sampler import engine as engine_lib
from rl_jax.sampler import turns as turns_lib


@dataclasses.dataclass(eq=False)
class GroupState:
  """One admitted prompt and its samples, as the Generator schedules them."""
  group_id: int
  prompt: np.ndarray
  num_samples: int
  seed: int
  sampling: engine_lib.Sampling
  max_new_tokens: int
  stop_on_eos: bool
  admitted: float
  order: int
  waiting: collections.deque  # sample indices not running and not finished
  num_full: int  # prompt pages every sample shares
  partial: bool  # the cached prompt ends inside a page
  prefix_pages: np.ndarray | None = None  # the group's own references, while it has waiting samples
  running: int = 0
  done: int = 0
  turn_end: Callable[[np.ndarray], int | None] | None = None  # multi-turn episodes (turns.py)
  attempts: list | None = None  # per sample: restarts from the prompt (turn_end groups)
  parked: int = 0  # samples parked at a tool call or resuming
  # Samples restored from a checkpoint mid-decode: index -> (tokens, logprobs, versions)
  # decoded before it; such a sample continues from there (Generator.add_group).
  restored: dict | None = None


@dataclasses.dataclass(eq=False)
class SeqState:
  """One sample being decoded: its slot, pages, cache length and the tokens so far."""
  group: GroupState
  sample_index: int
  slot: int
  pages: list
  length: int  # tokens in the cache
  cache_limit: int  # the cache never holds more: cached prompt + max_new (every decode
  # input is cached, the last sampled token is not, and the first input is the last
  # prompt token)
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  first_token: float = 0.0
  turn: turns_lib.TurnState | None = None  # episode state (turn_end groups only)
  run: int = 0  # bumped when the sequence parks: calls dispatched before carry void tokens


class InflightCall(NamedTuple):
  """A generate call on the device whose tokens the host has not read yet."""
  out: Any  # packed outputs (updates.unpack_output)
  version: int  # the weights it decodes with
  busy: list  # [(slot, sequence, sequence.run)] of the slots it decodes
  seqs: set  # those sequences

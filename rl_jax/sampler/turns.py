"""The multi-turn half of the Generator: parking sequences at tool calls and resuming them.

Shape letters: t completion tokens of an episode.

A group added with `turn_end` runs episodes: model turns separated by environment
observations. After each generate call the generator asks turn_end about every sequence
of such a group; when a turn ends (and the episode did not end at the same token) the
sequence is parked: its slot is freed at once, the pages holding its cache are kept
(pages past its cached positions are returned), and a `Turn` is queued for
`take_turns()`. The worker then either `resume`s it with an observation or
`end_episode`s it.

A worker's loop: step(); take_turns() and hand each to its environment; resume or
end_episode as results come. The generator has work while num_active, num_pending or
num_parked is non-zero; a resume whose observation reaches the budget ends the
episode, and that Rollout comes from the next step().

Resuming: the parked cache holds every token but the turn's last sampled one, x. At the
next scheduling pass the engine writes the K/V of [x] + observation[:-1] into the
sequence's pages (extend.Extender.extend, one batched call for the pass) and the
sequence restarts decoding in a free slot with observation[-1] as its first input,
with the sampling keys of (seed, sample_index, position), so its tokens do not depend
on the slot, the batch or the wait. Observation tokens enter the rollout with
behaviour log-prob 0.0, version -1 and model_mask False.

Pages and scheduling: resuming sequences start before new samples of any group (oldest
group first), and the pages they need are reserved from admission while they wait. A
parked sequence holds its pages until it resumes, ends, is aborted or is preempted.

Preemption (no deadlock): the pool can run dry while running sequences grow, or while
nothing runs and parked sequences hold the pages a resume needs. Either way the youngest
group holding pages (running, parked or resuming samples, or its prompt cache) is
preempted: all its unfinished samples restart from their prompt, and each restarted
sample's `attempt` is bumped, so the worker drops the old environment episode; a
resume or end_episode that names an old attempt is ignored, and a restarted sample
reports a new turn 0 under its new attempt. `add_group` admits only groups that fit the
pool alone with every sample at its longest, so the oldest group always progresses.

Weight updates: a parked sequence keeps its cache across a weight swap (also with
inflight weight updates off: waiting on a tool does not hold the swap back); its tokens
after the wait carry the new version.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from rl_jax.sampler import extend as extend_lib
from rl_jax.sampler import page_table as pt

_END_REASONS = ("stop", "length", "aborted")


@dataclasses.dataclass
class Turn:
  """A model turn that ended in a tool call: the sequence is parked (slot freed, pages kept)."""
  group_id: int
  sample_index: int
  attempt: int  # bumps each time the episode restarts from its prompt (preemption)
  turn_index: int  # 0 for the first model turn
  tokens: np.ndarray  # int32: this turn's model tokens, including the tokens that ended it
  num_tokens: int  # completion tokens so far in the episode (model + observation)


@dataclasses.dataclass(eq=False)
class TurnState:
  """Per-sequence episode state (only for groups with turn_end)."""
  attempt: int
  index: int = 0  # the current model turn
  start: int = 0  # where the current model turn begins in the sequence's tokens
  spans: list = dataclasses.field(default_factory=list)  # (begin, end) of each observation
  observation: np.ndarray | None = None  # waiting to be prefilled (resuming)


class TurnsMixin:
  """Generator methods for episodes; they use the Generator's state and belong to the
  sampler thread."""

  def _init_turns(self) -> None:
    self._parked: dict[tuple[int, int], object] = {}  # (group, sample) -> parked _Seq
    self._resuming: list = []  # _Seqs with an observation, waiting for a slot
    self._turns: list[Turn] = []
    self._extender = extend_lib.Extender.of(self.engine)

  @property
  def num_parked(self) -> int:
    """Sequences without a slot that hold pages: parked at a tool call, or resuming."""
    return len(self._parked) + len(self._resuming)

  @property
  def parked_pages(self) -> int:
    """Distinct KV pages the parked (and resuming) sequences hold."""
    held = {p for s in list(self._parked.values()) + self._resuming for p in s.pages}
    return len(held)

  def take_turns(self) -> list[Turn]:
    """The turns parked since the last call, in the order they ended."""
    turns, self._turns = self._turns, []
    return turns

  def resume(self, group_id: int, sample_index: int, attempt: int, observation_tokens) -> None:
    """Append an observation (>= 1 token) to a parked sequence; it continues decoding
    from a later step(). An observation that reaches the episode budget is cut to fit
    and the episode ends ("length", from the next step()). A stale attempt is ignored."""
    obs = np.asarray(observation_tokens, np.int32).reshape(-1)
    if obs.size < 1:
      raise ValueError("an observation needs at least one token")
    seq = self._parked_seq(group_id, sample_index, attempt)
    if seq is None:
      return None
    del self._parked[group_id, sample_index]
    room = seq.group.max_new_tokens - len(seq.tokens)
    if obs.size >= room:
      self._append_observation(seq, obs[:room])
      self._held.append(self._end_parked(seq, "length"))
    else:
      seq.turn.observation = obs
      self._resuming.append(seq)
    return None

  def end_episode(self, group_id: int, sample_index: int, attempt: int, reason: str = "stop"):
    """The environment ends a parked episode: its pages are freed and its Rollout is
    returned (None for a stale attempt)."""
    if reason not in _END_REASONS:
      raise ValueError(f"reason must be one of {_END_REASONS}, got {reason!r}")
    seq = self._parked_seq(group_id, sample_index, attempt)
    if seq is None:
      return None
    del self._parked[group_id, sample_index]
    return self._end_parked(seq, reason)

  def _parked_seq(self, group_id, sample_index, attempt):
    """The parked sequence, None when `attempt` is stale (restarted, aborted, or the
    group is gone); an error when the current attempt is not parked."""
    key = (int(group_id), int(sample_index))
    seq = self._parked.get(key)
    if seq is not None and seq.turn.attempt == int(attempt):
      return seq
    g = next((g for g in self._groups if g.group_id == key[0]), None)
    if (g is None or g.attempts is None or not 0 <= key[1] < g.num_samples or
        g.attempts[key[1]] != int(attempt)):
      return None
    raise ValueError(f"sample {key[1]} of group {key[0]} (attempt {attempt}) is not parked")

  def _turn_ended(self, seq, reason) -> bool:
    """Ask the group's turn_end about the current turn; park the sequence (True) when
    the turn ended before the episode did. Tokens after the turn's end are dropped."""
    ts = seq.turn
    turn = seq.tokens[ts.start:]
    k = seq.group.turn_end(np.asarray(turn, np.int32))
    if k is None:
      return False
    k = int(k)
    if not 1 <= k <= len(turn):
      raise ValueError(f"turn_end returned {k} for a turn of {len(turn)} tokens")
    if reason is not None and k == len(turn):
      return False  # EOS or the budget at the turn's last token: the episode ends
    drop = len(turn) - k
    if drop:
      del seq.tokens[-drop:], seq.logprobs[-drop:], seq.versions[-drop:]
      seq.length -= drop  # the dropped inputs' K/V is overwritten after the observation
      self.tokens_generated -= drop
    g = seq.group
    self._slots[seq.slot] = None
    seq.slot = -1
    seq.run += 1  # the call in flight decoded past the turn: its tokens for it are void
    keep = pt.pages_for(seq.length, self.engine.page_size)
    self.allocator.release(seq.pages[keep:])
    del seq.pages[keep:]
    g.running -= 1
    g.parked += 1
    self._parked[g.group_id, seq.sample_index] = seq
    self._turns.append(Turn(g.group_id, seq.sample_index, ts.attempt, ts.index,
                            np.asarray(seq.tokens[ts.start:], np.int32), len(seq.tokens)))
    return True

  def _append_observation(self, seq, obs: np.ndarray) -> None:
    begin = len(seq.tokens)
    seq.tokens.extend(obs.tolist())
    seq.logprobs.extend([0.0] * obs.size)
    seq.versions.extend([-1] * obs.size)
    seq.turn.spans.append((begin, len(seq.tokens)))

  def _end_parked(self, seq, reason: str):
    self.allocator.release(seq.pages)
    seq.pages = []
    g = seq.group
    g.parked -= 1
    g.done += 1
    if g.done == g.num_samples:
      self._retire(g)
    return self._rollout(seq, reason, self._clock())

  def _resume_pages(self, seq) -> int:
    """Pages `seq` lacks for its observation and its first generate call after it."""
    length = seq.length + seq.turn.observation.size
    need = min(length + self.engine.steps_per_call, seq.cache_limit)
    return max(pt.pages_for(need, self.engine.page_size) - len(seq.pages), 0)

  def _start_resumes(self, free: list, reserve: int, inserts: list, extends: list) -> int:
    """Give resuming sequences (oldest group first) free slots and their pages, and
    queue their extend and insert; returns `reserve` plus the pages of those that must
    wait, so new samples do not take them."""
    alloc = self.allocator
    waiting = False
    for seq in sorted(self._resuming, key=lambda s: s.group.order):
      need = self._resume_pages(seq)
      if waiting or not free or alloc.num_free < need + reserve:
        waiting = True
        reserve += need
        continue
      g, ts, obs = seq.group, seq.turn, seq.turn.observation
      seq.pages.extend(int(p) for p in alloc.allocate(need))
      extends.append((np.concatenate([[seq.tokens[-1]], obs[:-1]]), seq.length,
                      list(seq.pages)))
      self._append_observation(seq, obs)
      seq.length += obs.size
      ts.index, ts.start, ts.observation = ts.index + 1, len(seq.tokens), None
      seq.slot = free.pop()
      self._slots[seq.slot] = seq
      self._resuming.remove(seq)
      g.parked -= 1
      g.running += 1
      inserts.append(dict(
          slot=seq.slot, pages=seq.pages, token=int(obs[-1]), length=seq.length,
          max_new_tokens=g.max_new_tokens - len(seq.tokens), stop_on_eos=g.stop_on_eos,
          seed=g.seed, sample_index=seq.sample_index, sampling=g.sampling))
    return reserve

  def _unblock_resumes(self) -> None:
    """Nothing runs and resumes still wait for pages that only parked sequences (or
    prompt caches) hold: preempt the youngest such group until one starts."""
    while self._resuming and not self._num_decoding:
      holders = [g for g in self._groups if g.parked or g.prefix_pages is not None]
      if not holders:
        raise RuntimeError("resuming sequences do not fit an empty pool")
      self._preempt(max(holders, key=lambda g: g.order))
      self._try_fill()

  def _drop_parked(self, g) -> list[int]:
    """Drop the group's parked and resuming samples (preemption): free their pages and
    queued turns; returns their sample indices."""
    seqs = [s for s in self._parked.values() if s.group is g]
    seqs += [s for s in self._resuming if s.group is g]
    if not seqs:
      return []
    for seq in seqs:
      self._parked.pop((g.group_id, seq.sample_index), None)
      self.allocator.release(seq.pages)
      seq.pages = []
    self._resuming = [s for s in self._resuming if s.group is not g]
    g.parked -= len(seqs)
    dropped = {s.sample_index for s in seqs}
    self._turns = [t for t in self._turns
                   if t.group_id != g.group_id or t.sample_index not in dropped]
    return sorted(dropped)

  def _abort_parked(self, now: float) -> list:
    """Aborted Rollouts of every parked and resuming sequence; their pages are freed."""
    seqs = list(self._parked.values()) + self._resuming
    self._parked, self._resuming, self._turns = {}, [], []
    out = []
    for seq in seqs:
      self.allocator.release(seq.pages)
      seq.pages = []
      g = seq.group
      g.parked -= 1
      g.done += 1
      out.append(self._rollout(seq, "aborted", now))
    return out

  @staticmethod
  def _model_mask(seq) -> np.ndarray:
    mask = np.ones((len(seq.tokens),), bool)
    if seq.turn is not None:
      for begin, end in seq.turn.spans:
        mask[begin:end] = False
    return mask

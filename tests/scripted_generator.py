"""A scripted stand-in for the Generator's multi-turn contract (no model, no devices).

Each sample's model turns come from `script(group_id, sample_index, turn_index, attempt)`,
which returns the turn's token ids; one step() runs one whole turn of every running
sequence. The model token at completion position j gets behaviour log-prob
`logprob(token, j)` and the generator's current version. With turn_end set, a turn
whose turn_end(tokens) is n parks after n tokens (a Turn from take_turns); otherwise
the episode ends: "stop" when the turn ends with eos, "length" when the budget cuts it.
Slots are counted as the real generator does: running sequences hold one, parked ones
none (they hold `pages_per_seq` pages each).
"""
import collections
import dataclasses

import numpy as np

from rl_jax.types import Rollout


def logprob(token: int, position: int) -> float:
  return -0.01 * (int(token) % 13 + 1) - 0.001 * position


@dataclasses.dataclass
class Turn:
  group_id: int
  sample_index: int
  attempt: int
  turn_index: int
  tokens: np.ndarray
  num_tokens: int


@dataclasses.dataclass
class _Seq:
  gid: int
  idx: int
  prompt: np.ndarray
  budget: int
  turn_end: object
  stop_on_eos: bool
  attempt: int = 0
  turn: int = 0
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  mask: list = dataclasses.field(default_factory=list)
  state: str = "waiting"  # waiting | running | parked


class ScriptedGenerator:
  def __init__(self, script, *, eos_id=2, slots=8, version=0, pages_per_seq=2,
               max_new_tokens=64):
    self.script, self.eos_id, self.slots = script, eos_id, slots
    self.version = version
    self.pages_per_seq = pages_per_seq
    self.max_new_tokens = max_new_tokens
    self._pending_version = None
    self._seqs: dict = {}
    self._turns: list = []
    self._done: list = []
    self.generate_calls = self.preemptions = 0
    self.added = []  # (group_id, kwargs) of add_group calls

  # -- the counters the worker reads ----------------------------------------------
  @property
  def num_active(self):
    return sum(s.state == "running" for s in self._seqs.values())

  @property
  def num_pending(self):
    return len({s.gid for s in self._seqs.values() if s.state == "waiting"})

  @property
  def num_parked(self):
    return sum(s.state == "parked" for s in self._seqs.values())

  @property
  def parked_pages(self):
    return self.num_parked * self.pages_per_seq

  @property
  def kv_pages_used(self):
    return len(self._seqs) * self.pages_per_seq

  def has_capacity(self):
    return self.num_active + sum(s.state == "waiting" for s in self._seqs.values()) < self.slots

  def update_params(self, params, version):
    del params
    self._pending_version = int(version)

  # -- the contract ------------------------------------------------------------------
  def add_group(self, group_id, prompt_tokens, num_samples, seed, *, sampling=None,
                max_new_tokens=None, stop_on_eos=True, turn_end=None):
    del seed
    self.added.append((group_id, dict(sampling=sampling, max_new_tokens=max_new_tokens,
                                      turn_end=turn_end)))
    for i in range(num_samples):
      self._seqs[(group_id, i)] = _Seq(
          gid=group_id, idx=i, prompt=np.asarray(prompt_tokens, np.int32),
          budget=max_new_tokens or self.max_new_tokens, turn_end=turn_end,
          stop_on_eos=stop_on_eos)

  def step(self):
    if self._pending_version is not None:
      self.version, self._pending_version = self._pending_version, None
    started = 0
    for seq in list(self._seqs.values()):
      if seq.state == "waiting" and self.num_active < self.slots:
        seq.state = "running"
        started += 1
    running = [s for s in self._seqs.values() if s.state == "running"]
    if running:
      self.generate_calls += 1
    for seq in running:
      self._run_turn(seq)
    out, self._done = self._done, []
    return out

  def _run_turn(self, seq):
    tokens = list(self.script(seq.gid, seq.idx, seq.turn, seq.attempt))
    n = seq.turn_end(np.asarray(tokens, np.int32)) if seq.turn_end is not None else None
    if n is not None:
      tokens = tokens[:n]
    room = seq.budget - len(seq.tokens)
    cut = len(tokens) > room
    tokens = tokens[:room]
    for t in tokens:
      seq.logprobs.append(logprob(t, len(seq.tokens)))
      seq.tokens.append(int(t))
      seq.versions.append(self.version)
      seq.mask.append(True)
    if cut:
      self._finish(seq, "length")
    elif n is not None:
      seq.state = "parked"
      self._turns.append(Turn(seq.gid, seq.idx, seq.attempt, seq.turn,
                              np.asarray(tokens, np.int32), len(seq.tokens)))
    else:
      self._finish(seq, "stop" if tokens and tokens[-1] == self.eos_id else "length")

  def _finish(self, seq, reason):
    del self._seqs[(seq.gid, seq.idx)]
    multi = seq.turn_end is not None
    r = Rollout(group_id=seq.gid, sample_index=seq.idx, prompt_tokens=seq.prompt,
                completion_tokens=np.asarray(seq.tokens, np.int32),
                behavior_logprobs=np.asarray(seq.logprobs, np.float32),
                token_versions=np.asarray(seq.versions, np.int32), finish_reason=reason,
                model_mask=np.asarray(seq.mask, bool) if multi else None,
                num_turns=seq.turn + 1)
    self._done.append(r)
    return r

  def take_turns(self):
    out, self._turns = self._turns, []
    return out

  def _parked(self, gid, idx, attempt):
    seq = self._seqs.get((gid, idx))
    if seq is None or seq.attempt != attempt or seq.state != "parked":
      return None
    return seq

  def resume(self, group_id, sample_index, attempt, observation_tokens):
    seq = self._parked(group_id, sample_index, attempt)
    if seq is None:
      return None
    obs = [int(t) for t in observation_tokens]
    room = seq.budget - len(seq.tokens)
    for t in obs[:room]:
      seq.tokens.append(t)
      seq.logprobs.append(0.0)
      seq.versions.append(-1)
      seq.mask.append(False)
    seq.turn += 1
    if len(obs) >= room:
      self._finish(seq, "length")
    else:
      seq.state = "waiting"
    return None

  def end_episode(self, group_id, sample_index, attempt, reason="stop"):
    seq = self._parked(group_id, sample_index, attempt)
    if seq is None:
      return None
    r = self._finish(seq, reason)
    self._done.remove(r)
    return r

  def restart(self, group_id, sample_index):
    """Preemption: the episode restarts from its prompt with the next attempt."""
    seq = self._seqs[(group_id, sample_index)]
    seq.attempt += 1
    seq.turn = 0
    seq.tokens, seq.logprobs, seq.versions, seq.mask = [], [], [], []
    seq.state = "waiting"
    self.preemptions += 1

  def abort_all(self):
    out = list(self._done)
    self._done = []
    for seq in list(self._seqs.values()):
      out.append(self._finish(seq, "aborted"))
      self._done.remove(out[-1])
    return out

  def groups(self):
    return collections.Counter(gid for gid, _ in self._seqs)

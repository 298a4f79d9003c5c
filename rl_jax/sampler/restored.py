"""Samples continued from a checkpoint, and the snapshot a checkpoint takes (Generator).

A group added with `restored` (add_group) holds samples decoded partway before a
checkpoint: (tokens, logprobs, versions) each. Such a sample gets its own pages, one
extend writes the K/V of its prompt and tokens so far under the current weights, and
its insert continues decoding from its last token with the same PRNG stream (keys
depend on seed, sample index and position only). `snapshot()` is the other half: the
samples in flight, read for a checkpoint.
"""
from __future__ import annotations

import numpy as np

from rl_jax.sampler import page_table as pt
from rl_jax.sampler.sequences import GroupState, SeqState
from rl_jax.types import Rollout


class RestoredMixin:
  """Generator methods for restored samples; state lives on the Generator."""

  @staticmethod
  def _check_restored(group_id: int, restored, todo: list, turn_end, max_new: int) -> dict:
    """add_group's `restored` as lists, checked: only samples still to produce, of a
    group without turn_end, with 1..max_new - 1 tokens, log-probs and versions each."""
    restored = {int(i): tuple(np.asarray(x).tolist() for x in v)
                for i, v in (restored or {}).items()}
    for i, (tokens, logprobs, versions) in restored.items():
      if turn_end is not None or i not in todo:
        raise ValueError(f"restored sample {i} of group {group_id}: only a sample still to "
                         "produce, of a group without turn_end, continues from its tokens")
      if not (1 <= len(tokens) < max_new and len(tokens) == len(logprobs) == len(versions)):
        raise ValueError(f"restored sample {i} of group {group_id} has {len(tokens)} tokens "
                         f"({len(logprobs)} log-probs, {len(versions)} versions); a sample "
                         f"in flight has 1..{max_new - 1} of each")
    return restored

  @staticmethod
  def _fresh(g: GroupState) -> list[int]:
    """The group's waiting samples that start from the prompt (not restored ones)."""
    if not g.restored:
      return list(g.waiting) if g.waiting else []
    return [i for i in g.waiting if i not in g.restored]

  def _start_restored(self, free: list, reserve: int, inserts: list, extends: list) -> int:
    """Start waiting samples restored mid-decode (add_group's `restored`), oldest group
    first, while slots and pages last: each gets its own pages for the prompt, its
    tokens so far and its next call; one extend writes their K/V, then its insert
    continues from its last token. Returns `reserve` plus the pages they took."""
    eng, alloc = self.engine, self.allocator
    now = self._clock()
    for g in self._groups:
      for i in [i for i in g.waiting if g.restored and i in g.restored]:
        tokens, logprobs, versions = g.restored[i]
        cached = g.prompt.shape[0] - 1
        length = cached + len(tokens)
        need = pt.pages_for(min(length + eng.steps_per_call, cached + g.max_new_tokens),
                            eng.page_size)
        if not free or alloc.num_free < need + reserve:
          return reserve  # first come, first served, as for new prompts
        g.waiting.remove(i)
        seq = SeqState(group=g, sample_index=i, slot=free.pop(),
                       pages=[int(p) for p in alloc.allocate(need)], length=length,
                       cache_limit=cached + g.max_new_tokens, tokens=list(tokens),
                       logprobs=list(logprobs), versions=list(versions), first_token=now)
        self._slots[seq.slot] = seq
        g.running += 1
        reserve += self._pages_short(seq)
        # The cache holds every input but the next one: the prompt and the tokens so far
        # but the last, which is the next decode input.
        extends.append((np.concatenate([g.prompt, np.asarray(tokens[:-1], np.int32)]), 0,
                        list(seq.pages)))
        inserts.append(dict(
            slot=seq.slot, pages=seq.pages, token=int(tokens[-1]), length=length,
            max_new_tokens=g.max_new_tokens - len(tokens), stop_on_eos=g.stop_on_eos,
            seed=g.seed, sample_index=i, sampling=g.sampling))
    return reserve

  def snapshot(self) -> tuple[dict[int, dict[int, tuple]], list[Rollout]]:
    """What a checkpoint keeps of the RL groups (ids >= 0) in this generator: group id ->
    {sample index: (tokens, logprobs, versions)} of each sample decoded partway (running,
    or restored and still waiting), and the rollouts that finished but that step() has
    not returned yet, handed to the caller (removed here). Reads the generate call on
    the device first, so no decoded token is left out. Sampler thread (or paused)."""
    self._held += self._collect()
    finished = [r for r in self._held if r.group_id >= 0]
    self._held = [r for r in self._held if r.group_id < 0]
    out: dict[int, dict[int, tuple]] = {}
    for g in self._groups:
      if g.group_id >= 0:
        out[g.group_id] = {i: g.restored[i] for i in g.waiting if g.restored and i in g.restored}
    for seq in self._slots:
      if seq is not None and seq.group.group_id >= 0 and seq.turn is None and seq.tokens:
        out[seq.group.group_id][seq.sample_index] = (
            list(seq.tokens), list(seq.logprobs), list(seq.versions))
    return out, finished

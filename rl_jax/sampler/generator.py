"""Continuous-batching rollout generator over the paged Engine.

Shape letters: s decode steps per generate call, b decode slots.

One `step()` is one scheduling iteration:
  1. swap in weights published by `update_params` (see below);
  2. fill free slots: a group (one prompt, G samples) is prefilled once when its turn
     comes and its samples are inserted as slots free up; the samples share the full
     prompt pages and each gets a private copy of the partial last prompt page;
  3. give every running sequence the pages its next `steps_per_call` tokens need;
  4. dispatch one generate call, then read the tokens of the previous call and hand
     finished sequences back as rl_jax.types.Rollout objects, freeing their slot and
     pages. When few slots are busy, their sequences are moved into the lowest slots
     (registers only: the KV stays in its pages) and the call covers just the smallest
     power-of-two prefix of slots.

One dispatch per step: the slot and page-table updates of steps 2-4 are staged in an
updates.Pending and applied inside the generate program, and the prompts admitted in
the step ride in its prefill lane (prefill_lane.py) while they fit, the rest in one
batched prefill call of the same step (not left idle for a call). The device runs a
step's call while the host prepares the next step, so the host learns of a stop token
one call late and a call may cover a slot whose sequence already ended (the device
leaves it idle); a budget that runs out in the call in flight frees its slot and pages
before the next call (_release_ending). slot_steps - tokens_generated counts the
slot-steps spent on idle slots. `slot_limit` caps the slots in use (live control).

Memory (paging.py): pages are taken as sequences grow, not reserved for the worst
case, so long tails do not hold memory they never use. Admission is first-come
first-served and waits (the group stays pending) while free pages are short. If a
running sequence cannot grow, the youngest group holding pages is preempted: its
running samples are dropped and re-run from their prompt later (same seed, so the same
tokens under the same weights); rollouts it already emitted stay emitted. `add_group`
rejects any group that could not run alone in the whole pool, so the oldest group
always makes progress.

Rollouts: `completion_tokens` include the stop token when finish_reason is "stop", with
its log-prob and version, so the trainer learns to stop. Every group yields exactly
num_samples rollouts (finish_reason "aborted" after `abort_all`).

Multi-turn episodes (tool use, turns.py): a group added with `turn_end` parks a sequence
when a model turn ends (slot freed, pages kept) and reports a `Turn` through
`take_turns()`; `resume(...)` appends an observation (prefilled over the kept pages)
and `end_episode(...)` finishes it. Contract notes: `Turn` lives in turns.py (imported
here); `num_parked` counts resuming sequences (observation given, no slot yet) too;
rollouts of turn_end groups always carry model_mask (all True when no observation).

Resuming from a checkpoint (restored.py): add_group's `samples` and `restored` continue
samples decoded partway before it; `snapshot()` reads the samples in flight for one.

Weight updates: `update_params(params, version)` (and `set_slot_limit`) are the methods
safe to call from another thread; it stores the weights in a pending slot that the sampler thread swaps
in at the top of its next `step()` (the latest call wins). With inflight weight updates
on, running sequences continue on the new weights with their KV kept, and tokens from
then on carry the new version (the call already on the device keeps the old weights,
and its tokens their version). With them off, the generator stops starting sequences,
finishes the running ones on the old weights, then swaps and re-prefills prompts that
were prefilled under the old weights. Every other method belongs to the sampler thread.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from rl_jax.sampler import engine as engine_lib
from rl_jax.sampler import page_table as pt
from rl_jax.sampler import paging
from rl_jax.sampler import programs as programs_lib
from rl_jax.sampler import restored as restored_lib
from rl_jax.sampler import turns as turns_lib
from rl_jax.sampler import updates
from rl_jax.sampler.sequences import GroupState, InflightCall, SeqState
from rl_jax.sampler.turns import Turn  # noqa: F401  (part of the Generator's API)
from rl_jax.types import Rollout

_REASONS = {engine_lib.FINISH_STOP: "stop", engine_lib.FINISH_LENGTH: "length"}


def _move_pools(src, dst):
  """(src without its K/V pools, dst with them): one set of pools, two sets of registers."""
  pools = dict(k_pages=src.k_pages, v_pages=src.v_pages)
  return src._replace(k_pages=None, v_pages=None), dst._replace(**pools)


class Generator(paging.PagesMixin, turns_lib.TurnsMixin, restored_lib.RestoredMixin):
  """Turns groups (prompt, G, seed) into Rollouts with continuous batching."""

  def __init__(self, engine: engine_lib.Engine, params: Any, *, version: int = 0,
               inflight_weight_updates: bool = True,
               sampling: engine_lib.Sampling = engine_lib.Sampling(),
               max_new_tokens: int | None = None, clock: Callable[[], float] = time.time,
               borrows_pool: bool = False):
    self.engine = engine
    self.inflight_weight_updates = bool(inflight_weight_updates)
    self.sampling = sampling
    self.max_new_tokens = engine.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    if not 1 <= self.max_new_tokens <= engine.max_new_tokens:
      raise ValueError(f"max_new_tokens {self.max_new_tokens} outside 1..{engine.max_new_tokens}")
    self._clock = clock
    self._merged = engine.merges(params)  # _params is this generator's own merge
    self._params = engine.load_params(params)
    self._version = int(version)
    self._pending_params: tuple[Any, int] | None = None
    self._lock = threading.Lock()
    self._state = engine.init_decode_state(pools=not borrows_pool)  # see lend_pool
    # Slot / page-table updates of this pass, applied by the next generate call.
    self._pending = updates.Pending(engine.max_concurrent_decodes, engine.prefill_lane)
    self.allocator = pt.PageAllocator(num_pages=engine.num_pages, page_size=engine.page_size)
    self._groups: list[GroupState] = []  # unfinished groups, oldest first
    self._group_ids: set[int] = set()
    self._slots: list[SeqState | None] = [None] * engine.max_concurrent_decodes
    self.slot_limit = engine.max_concurrent_decodes  # decode slots in use at most
    self._order = 0
    self._eval_ids = 0
    self._held: list[Rollout] = []  # other groups' rollouts finished inside generate()
    self._inflight: InflightCall | None = None  # the generate call on the device (see _launch)
    self._ending: set[SeqState] = set()  # sequences that end in that call (see _release_ending)
    self.tokens_generated = 0
    self.rollouts_finished = 0
    self.preemptions = 0
    self.generate_calls = 0
    self.slot_steps = 0  # decode steps dispatched: slots a call covers x its steps
    self.busy_s = 0.0
    self._init_turns()

  def compile_covers(self) -> list:
    """Under Engine.compile_in_background (not ragged attention): compile now the
    programs that cover every later call of this generator's sampling
    (programs.compile_covers), so that none of its calls waits for a compile; the keys
    compiled ([] when compiles are inline or already done)."""
    eng = self.engine
    if eng.programs is None or eng.attention == "ragged":
      return []
    s = self.sampling
    truncate = eng.truncate or (s.temperature > 0 and (s.top_k > 0 or s.top_p < 1))
    return programs_lib.compile_covers(eng, eng.sampler_params(self._params), self._state,
                                       truncate=truncate)

  @property
  def version(self) -> int:
    """Version of the weights the next generate call uses (before any pending swap)."""
    return self._version

  @property
  def num_active(self) -> int:
    """Sequences occupying a decode slot or ending in the call on the device."""
    return self._num_decoding + len(self._ending)

  @property
  def _num_decoding(self) -> int:
    """Sequences occupying a decode slot (the next generate call decodes them)."""
    return len(self._slots) - self._slots.count(None)

  @property
  def num_pending(self) -> int:
    """Groups with at least one sample that has not started (or was preempted)."""
    return sum(1 for g in self._groups if g.waiting)

  @property
  def kv_pages_used(self) -> int:
    return self.allocator.num_used

  def has_capacity(self) -> bool:
    """True if a group added now could start at the next step: no weight swap is
    draining the slots, free slots outnumber samples and resumes already waiting, and,
    while sequences are parked, free pages exceed what they need to come back."""
    if self._draining():
      return False
    waiting = sum(len(g.waiting) for g in self._groups) + len(self._resuming)
    if self._free_slots() <= waiting:
      return False
    # What waiting resumes need, and a page for each sequence still waiting on its tool.
    return not self.num_parked or self.allocator.num_free > (
        sum(self._resume_pages(s) for s in self._resuming) + len(self._parked))

  def _free_slots(self) -> int:
    """Slots a new sequence may take: free ones, within slot_limit."""
    return max(0, min(self._slots.count(None), self.slot_limit - self._num_decoding))

  def update_params(self, params: Any, version: int) -> None:
    """Publish new weights; safe from any thread. Swapped in by the next step()
    (LoRA adapters are merged there, into the weights they replace)."""
    if not self.engine.merges(params):
      params = self.engine.load_params(params)
    with self._lock:
      self._pending_params = (params, int(version))

  def set_slot_limit(self, slots: int) -> None:
    """Cap the decode slots in use (live control); safe from any thread, it takes effect
    at the next slot fill (running sequences keep their slots)."""
    with self._lock:
      self.slot_limit = int(slots)

  def add_group(self, group_id: int, prompt_tokens, num_samples: int, seed: int, *,
                sampling: engine_lib.Sampling | None = None, max_new_tokens: int | None = None,
                stop_on_eos: bool = True,
                turn_end: Callable[[np.ndarray], int | None] | None = None,
                samples: Sequence[int] | None = None,
                restored: dict[int, tuple] | None = None) -> None:
    """Queue G = num_samples completions of one prompt; sample i uses seed (seed, i).

    With `turn_end`, each sample is an episode of model turns and observations
    (turns.py): turn_end(turn_tokens) -> None (go on) or n, the turn ends after its
    first n tokens; max_new_tokens then bounds all completion tokens of the episode.

    Resuming a group from a checkpoint: `samples` names the sample indices still to
    produce (default all; the others finished before), and `restored` maps some of them
    to (tokens, logprobs, versions) decoded before the checkpoint. Such a sample's
    prompt and tokens are prefilled again under the current weights (in its own pages)
    and it continues decoding at the position it reached, with the same PRNG stream
    (keys depend on seed, sample index and position only); its earlier tokens keep their
    log-probs and versions. Not for turn_end groups.
    """
    eng = self.engine
    prompt = np.asarray(prompt_tokens, np.int32).reshape(-1)
    max_new = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    if group_id in self._group_ids:
      raise ValueError(f"group {group_id} is already in the generator")
    if num_samples < 1:
      raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not 1 <= prompt.shape[0] <= eng.max_prefill_length:
      raise ValueError(f"prompt of group {group_id} has {prompt.shape[0]} tokens; "
                       f"sampler.max_prefill_length allows 1..{eng.max_prefill_length}")
    if not 1 <= max_new <= eng.max_new_tokens:
      raise ValueError(f"max_new_tokens {max_new} outside 1..{eng.max_new_tokens} "
                       "(sampler.max_new_tokens)")
    todo = list(range(num_samples)) if samples is None else sorted({int(i) for i in samples})
    if not todo or not 0 <= todo[0] <= todo[-1] < num_samples:
      raise ValueError(f"samples of group {group_id} must be some of 0..{num_samples - 1}, "
                       f"got {todo}")
    restored = self._check_restored(group_id, restored, todo, turn_end, max_new)
    cached = prompt.shape[0] - 1
    num_full = cached // eng.page_size
    per_sample = pt.pages_for(cached + max_new, eng.page_size) - num_full
    # The full prompt pages, the partial page's template, and every sample's own pages.
    worst = num_full + bool(cached % eng.page_size) + num_samples * per_sample
    if worst > self.allocator.capacity:
      raise ValueError(
          f"group {group_id} needs up to {worst} KV pages "
          f"with all {num_samples} samples running, the pool has {self.allocator.capacity}: "
          "raise sampler.num_pages / kv_cache_bytes or lower max_new_tokens")
    self._order += 1
    self._groups.append(GroupState(
        group_id=group_id, prompt=prompt, num_samples=int(num_samples), seed=int(seed),
        sampling=self.sampling if sampling is None else sampling, max_new_tokens=max_new,
        stop_on_eos=bool(stop_on_eos), admitted=self._clock(), order=self._order,
        waiting=collections.deque(todo), num_full=num_full,
        partial=bool(cached % eng.page_size), turn_end=turn_end,
        attempts=None if turn_end is None else [0] * int(num_samples),
        done=int(num_samples) - len(todo), restored=restored or None))
    self._group_ids.add(group_id)

  def step(self) -> list[Rollout]:
    """One scheduling iteration; returns the rollouts whose last token it read (they
    finished in the previous iteration's call)."""
    held, self._held = self._held, []
    return held + self._step()

  def generate(self, prompts_tokens: Sequence, *, greedy: bool = True,
               max_new_tokens: int | None = None, sampling: engine_lib.Sampling | None = None,
               seed: int = 0) -> list[np.ndarray]:
    """Completions (int32, stop token removed) for held-out evaluation, in order.

    Uses group ids < 0. Rollouts of other groups that finish meanwhile are kept and
    returned by the next step().
    """
    mode = engine_lib.Sampling.greedy() if greedy else (sampling or self.sampling)
    ids = []
    for i, prompt in enumerate(prompts_tokens):
      self._eval_ids += 1
      ids.append(-self._eval_ids)
      self.add_group(ids[-1], prompt, 1, seed + i, sampling=mode, max_new_tokens=max_new_tokens)
    wanted = set(ids)
    done: dict[int, Rollout] = {}
    while len(done) < len(ids):
      for r in self._step():
        if r.group_id in wanted:
          done[r.group_id] = r
        else:
          self._held.append(r)
    out = []
    for gid in ids:
      r = done[gid]
      out.append(r.completion_tokens[:-1] if r.finish_reason == "stop" else r.completion_tokens)
    return out

  def abort_all(self) -> list[Rollout]:
    """End every group now: running samples keep their tokens so far (including those of
    the call still on the device), samples that never started come back empty; all
    finish_reason "aborted" but the ones that finished in that call and rollouts held
    back by generate(). Frees every slot and page."""
    out, self._held = self._held, []
    out += self._collect()  # rollouts that finish in the call in flight end normally
    now = self._clock()
    running = [s for s in self._slots if s is not None]
    for seq in running:
      self._pending.free(seq.slot)
      out.append(self._end(seq, "aborted", now))
    out.extend(self._abort_parked(now))
    for g in list(self._groups):
      while g.waiting:
        i = g.waiting.popleft()
        tokens, logprobs, versions = (g.restored or {}).get(i, ([], [], []))
        empty = SeqState(group=g, sample_index=i, slot=-1, pages=[], length=0, cache_limit=0,
                         tokens=list(tokens), logprobs=list(logprobs), versions=list(versions))
        out.append(self._rollout(empty, "aborted", now))
        g.done += 1
      self._release_prefix(g)
      self._retire(g)
    return out

  @contextlib.contextmanager
  def lend_pool(self, borrower: Generator, pages: int):
    """While the body runs, `borrower` (made with borrows_pool=True) decodes in this
    generator's K/V pools with pages from its allocator; this generator must not step
    meanwhile. First the youngest groups are preempted (as when the pool runs dry) until
    `pages` pages are free, so a borrowed sequence of that many pages always fits."""
    while self.allocator.num_free < pages:
      holders = [g for g in self._groups if g.running or g.parked or g.prefix_pages is not None]
      if not holders:
        break
      self._preempt(max(holders, key=lambda g: g.order))
    borrower.allocator = self.allocator
    self._state, borrower._state = _move_pools(self._state, borrower._state)
    try:
      yield borrower
    finally:
      borrower._state, self._state = _move_pools(borrower._state, self._state)

  def _draining(self) -> bool:
    with self._lock:
      return self._pending_params is not None and not self.inflight_weight_updates

  def _maybe_swap_params(self) -> None:
    with self._lock:
      if self._pending_params is None:
        return
      if not self.inflight_weight_updates and self._num_decoding:
        return
      params, self._version = self._pending_params
      self._pending_params = None
    merged = self.engine.merges(params)
    if merged:  # the call on the device finishes first: the merge is timed alone
      params = self.engine.load_params(params, reuse=self._params if self._merged else None,
                                       after=self._inflight and self._inflight.out)
    self._params, self._merged = params, merged
    if not self.inflight_weight_updates:
      # Nothing is running; prompts cached under the old weights are prefilled again.
      for g in self._groups:
        self._release_prefix(g)

  def _step(self) -> list[Rollout]:
    t0 = time.perf_counter()
    self._release_ending()
    self._maybe_swap_params()
    if not self._draining():
      self._fill_slots()
    if self._num_decoding:
      self._grow_pages()
    launched = None
    if self._num_decoding:
      launched = self._launch()
    else:
      # Every group prefilled in this pass was preempted (its pages are free again):
      # drop its lane prompts, so they cannot land in pages reused by a later pass.
      self._pending.take_lane()
    # The previous call ran on the device while this pass was prepared on the host.
    finished = self._collect()
    self._inflight = launched
    self.busy_s += time.perf_counter() - t0
    return finished

  def _launch(self) -> InflightCall:
    """Dispatch this pass's generate call (no wait)."""
    num_slots = self._compact()
    busy = [(b, s, s.run) for b, s in enumerate(self._slots) if s is not None]
    # Attention reads only the page-table columns the longest busy sequence reaches.
    width = self.engine.page_bucket(max(self._call_positions(s) for _, s, _ in busy))
    # One dispatch: this pass's prompts, inserts, page rows and moves, then the decode.
    self._state, out = self.engine.apply_and_generate(
        self._params, self._state, self._pending, num_slots=num_slots, num_pages=width,
        live=self._live_pages())
    self.generate_calls += 1
    self.slot_steps += num_slots * self.engine.steps_per_call
    return InflightCall(out, self._version, busy, {s for _, s, _ in busy})

  def _release_ending(self) -> None:
    """Free the slot and pages of each sequence whose budget runs out in the call in
    flight now, not when its tokens are read (the next call would decode its slot for
    nothing). Later programs run after that call, so its KV writes land before the pages
    are reused; its tokens are taken in when the call is collected."""
    if self._inflight is None:
      return
    steps = self.engine.steps_per_call
    for _, seq, run in self._inflight.busy:
      if (seq.turn is None and seq.run == run and self._slots[seq.slot] is seq and
          seq.length + steps >= seq.cache_limit):
        self._slots[seq.slot] = None
        self._pending.free(seq.slot)
        self.allocator.release(seq.pages)
        seq.group.running -= 1
        self._ending.add(seq)

  def _collect(self) -> list[Rollout]:
    """Wait for the call in flight (if any) and take in its tokens."""
    if self._inflight is None:
      return []
    call, self._inflight = self._inflight, None
    return self._consume(updates.unpack_output(np.asarray(call.out), self.engine.steps_per_call),
                         call.version, call.busy)

  def _fill_slots(self) -> None:
    """Start resuming sequences, then waiting samples, in free slots, oldest group first."""
    self._try_fill()
    if not self._num_decoding and (self._resuming or any(g.waiting for g in self._groups)):
      # Nothing runs, so nothing will give pages back: drop the prompt caches of waiting
      # groups (they are prefilled again) so the oldest group gets the whole pool.
      for g in self._groups:
        self._release_prefix(g)
      self._try_fill()
      if self._resuming and not self._num_decoding:
        self._unblock_resumes()

  def _try_fill(self) -> None:
    eng, alloc = self.engine, self.allocator
    free = [i for i, s in enumerate(self._slots) if s is None][:self._free_slots()][::-1]
    # Pages the running sequences need for the next call; a sample is started only if
    # its own first call fits beside them. Longer-term growth is not reserved: when the
    # pool runs dry, _grow_pages preempts the youngest group.
    reserve = sum(self._pages_short(s) for s in self._slots if s is not None)
    inserts, exhausted, prefills, extends = [], [], [], []
    if self._resuming:  # older work than any new sample
      reserve = self._start_resumes(free, reserve, inserts, extends)
    if free and any(g.restored for g in self._groups):
      reserve = self._start_restored(free, reserve, inserts, extends)
    groups, i = list(self._groups), 0
    while free and i < len(groups):
      g = groups[i]
      i += 1
      if not self._fresh(g):
        continue
      cached = g.prompt.shape[0] - 1
      first_call = pt.pages_for(min(cached + eng.steps_per_call, cached + g.max_new_tokens),
                                eng.page_size) - g.num_full
      if g.prefix_pages is None:
        # While others run, a new prompt also leaves 1/16 of the pool free for their
        # growth, which keeps preemptions (recomputed work) rare near a full pool.
        watermark = alloc.capacity // 16 if self._num_decoding else 0
        if alloc.num_free < g.num_full + g.partial + first_call + reserve + watermark:
          # First come, first served for new prompts: from here on only groups that
          # hold their prompt pages may start samples (no per-group scan of the rest).
          groups = [h for h in groups[i:] if h.prefix_pages is not None]
          i = 0
          continue
        self._prefill(g, prefills)
      while self._fresh(g) and free and alloc.num_free >= first_call + reserve:
        private = alloc.allocate(1) if g.partial else np.zeros((0,), np.int32)
        shared = g.prefix_pages[:g.num_full]
        alloc.share(shared)
        index = self._fresh(g)[0]
        g.waiting.remove(index)
        seq = SeqState(group=g, sample_index=index, slot=free.pop(),
                   pages=[int(p) for p in shared] + [int(p) for p in private],
                   length=cached, cache_limit=cached + g.max_new_tokens)
        if g.turn_end is not None:
          seq.turn = turns_lib.TurnState(attempt=g.attempts[seq.sample_index])
        self._slots[seq.slot] = seq
        g.running += 1
        reserve += self._pages_short(seq)
        inserts.append(dict(
            slot=seq.slot, pages=seq.pages, token=int(g.prompt[-1]), length=seq.length,
            max_new_tokens=g.max_new_tokens, stop_on_eos=g.stop_on_eos, seed=g.seed,
            sample_index=seq.sample_index, sampling=g.sampling,
            copy=(int(g.prefix_pages[-1]), int(private[0])) if g.partial else None))
      if not self._fresh(g):
        exhausted.append(g)
    # Prompts go to the prefill lane of this pass's generate call while they fit, the
    # rest to one batched call now (an extra dispatch costs less than idle slots for a
    # whole call). Both happen before the inserts copy their template pages.
    prefills = [g for g in prefills if not self._pending.prefill(g.prompt, g.prefix_pages)]
    if prefills:
      self._state = eng.prefill_into_pages(self._params, self._state,
                                           [g.prompt for g in prefills],
                                           [g.prefix_pages for g in prefills])
    if extends:  # observations of resuming sequences, before their inserts
      self._state = self._extender.extend(self._params, self._state, extends)
    # Applied by this pass's generate call, after the prefill above and before its decode
    # steps write any page, so the template pages released below are read in time.
    for entry in inserts:
      self._pending.insert(entry)
    for g in exhausted:
      self._release_prefix(g)

  def _consume(self, out: engine_lib.StepOutput, version: int, busy) -> list[Rollout]:
    """Append the tokens of one call to its busy sequences, busy = [(slot, sequence,
    run)] at dispatch (one slice per slot, not per token). Sequences that ended, parked
    at a turn's end (and maybe resumed since: `run` changed) or were preempted after the
    call was dispatched are skipped: the device did not decode them, or their tokens are
    void."""
    now = self._clock()
    finished = []
    valid_sb = np.asarray(out.valid_sb)
    busy = [(b, seq) for b, seq, run in busy
            if seq.run == run and (seq in self._ending or self._slots[seq.slot] is seq)]
    if not valid_sb[0, [b for b, _ in busy]].all():
      # Host and device disagree about which slots decode: fail now, not spin forever.
      raise RuntimeError(f"decode slots {[b for b, _ in busy]} are busy on the host but the "
                         f"device decoded only {np.flatnonzero(valid_sb[0]).tolist()}")
    # A slot decodes a prefix of the call's steps: valid until it finishes. Each array
    # goes to Python lists once per call, not once per slot.
    counts_b = valid_sb.sum(axis=0)
    finish_b = out.finish_sb[np.maximum(counts_b - 1, 0), np.arange(counts_b.shape[0])]
    tokens_bs, logprobs_bs = out.tokens_sb.T.tolist(), out.logprobs_sb.T.tolist()
    counts_b, finish_b = counts_b.tolist(), finish_b.tolist()
    steps = valid_sb.shape[0]
    parked = []
    for b, seq in busy:
      n = counts_b[b]
      if not seq.tokens:
        seq.first_token = now
      seq.tokens.extend(tokens_bs[b] if n == steps else tokens_bs[b][:n])
      seq.logprobs.extend(logprobs_bs[b] if n == steps else logprobs_bs[b][:n])
      seq.versions.extend([version] * n)
      seq.length += n
      self.tokens_generated += n
      reason = _REASONS.get(finish_b[b])
      slot = seq.slot  # where it is now: a move since the dispatch changes it
      if seq.turn is not None and self._turn_ended(seq, reason):
        parked.append(slot)
      elif reason is not None:
        finished.append(self._end(seq, reason, now))
      elif seq in self._ending:
        raise RuntimeError(f"slot {b} decoded {n} of {steps} steps and did not finish, but "
                           "its sequence's budget ends in this call")
    for b in parked:  # their slots still decode past the turn's end on the device
      self._pending.free(b)
    return finished

  def _end(self, seq: SeqState, reason: str, now: float) -> Rollout:
    """Free a sequence's slot and pages (its slot is already idle on device), unless
    _release_ending did."""
    g = seq.group
    if seq in self._ending:
      self._ending.discard(seq)
    else:
      self._slots[seq.slot] = None
      self.allocator.release(seq.pages)
      g.running -= 1
    g.done += 1
    if g.done == g.num_samples:
      self._retire(g)
    return self._rollout(seq, reason, now)

  def _retire(self, g: GroupState) -> None:
    self._groups.remove(g)
    self._group_ids.discard(g.group_id)

  def _rollout(self, seq: SeqState, reason: str, now: float) -> Rollout:
    self.rollouts_finished += 1
    g = seq.group
    return Rollout(
        group_id=g.group_id, sample_index=seq.sample_index, prompt_tokens=g.prompt.copy(),
        completion_tokens=np.asarray(seq.tokens, np.int32),
        behavior_logprobs=np.asarray(seq.logprobs, np.float32),
        token_versions=np.asarray(seq.versions, np.int32), finish_reason=reason,
        admitted=g.admitted, first_token=seq.first_token, finished=now,
        model_mask=None if g.turn_end is None else self._model_mask(seq),
        num_turns=1 if seq.turn is None else seq.turn.index + 1)

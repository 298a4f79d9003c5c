"""Compiling the sampler's programs off the decode path (Engine.compile_in_background).

The engine has one fused generate program per (slots, page columns, lane tokens) bucket
and one batched prefill per (prompts, length) bucket (engine.py). Compiled at its first
call, each new bucket stalls the sampler for its compile: on the 2-core CPU default that
is about 38 programs of 2-3 s each in the first minutes of a run, a quarter of its
pipeline time. With an executor, a call whose program is not compiled yet runs a
compiled program that covers it, and its own program compiles on the executor for the
calls after it:
  - generate: more slots (the extra ones are idle on the device), more page columns
    (masked past every sequence's length) and a lane at least as long (padding
    segments), `generate_cover`;
  - prefill: the prompts padded to a compiled batch and length, or in several batches
    of a compiled size, `prefill_plan`.
Without an executor (sampler.compile="ahead") nothing compiles in the background:
compile_covers compiles the covering programs before the run and every call runs on
one of them (more padding per call, no compile during the run; the same programs in
every run and process, so sync runs stay reproducible).
A covering program computes the same tokens and log-probs on more padding, equal up to
the last bits of floating-point reductions. Which program runs depends on when a
compile finishes, so sync runs (reproducible bit for bit) and multi-process runs (every
process must launch the same programs) compile inline.

Keys: generate (num_slots, num_pages, num_live, fused, truncate, lane), Engine's
generate_program keys; prefill ("prefill", n prompts, t positions).
"""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Hashable, Sequence

import jax
import numpy as np


def abstract(args) -> Any:
  """ShapeDtypeStructs of a call's arguments: what lowering needs (the jitted function
  names every argument's sharding)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)


class Programs:
  """Ahead-of-time compiled programs by key, compiled on `executor` (its thread belongs
  to the caller, orchestration/). Lookups and scheduling are thread-safe."""

  def __init__(self, executor: concurrent.futures.Executor | None):
    self._executor = executor  # None: no background compiles (schedule does nothing)
    self._lock = threading.Lock()
    self._ready: dict[Hashable, Callable] = {}
    self._futures: dict[Hashable, concurrent.futures.Future] = {}
    self.compiled_inline = 0  # compiles that stalled the caller (nothing covered)
    self.compiled_ahead = 0  # compile_covers, before the run's clock starts
    self.compiled_background = 0
    self.covered_calls = 0  # calls that ran a covering program

  def lookup(self, key: Hashable) -> Callable | None:
    with self._lock:
      return self._ready.get(key)

  def ready_keys(self) -> list:
    with self._lock:
      return list(self._ready)

  def schedule(self, key: Hashable, jitted, args) -> None:
    """Compile `key` on the executor (once); a failure is raised by `compile_now` or by
    the next `schedule` of any key, not lost."""
    if self._executor is None:
      return
    with self._lock:
      self._raise_failures()
      if key in self._ready or key in self._futures:
        return
      specs = abstract(args)  # only for a key not yet compiling
      self._futures[key] = self._executor.submit(self._compile, key, jitted, specs)

  def compile_now(self, key: Hashable, jitted, args, *, ahead: bool = False) -> Callable:
    """The program of `key`, compiled here if no compile of it is under way (counted
    in compiled_ahead when `ahead`, else in compiled_inline)."""
    with self._lock:
      future = self._futures.get(key)
      if future is None and key not in self._ready:
        self._futures[key] = future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        inline = True
      else:
        inline = False
    if inline:
      try:
        program = jitted.lower(*abstract(args)).compile()
      except BaseException as e:
        with self._lock:
          del self._futures[key]
        future.set_exception(e)
        raise
      with self._lock:
        self._ready[key] = program
        if ahead:
          self.compiled_ahead += 1
        else:
          self.compiled_inline += 1
        del self._futures[key]
      future.set_result(None)
    elif future is not None:
      future.result()
    return self.lookup(key)

  def _compile(self, key, jitted, specs) -> None:
    program = jitted.lower(*specs).compile()
    with self._lock:
      self._ready[key] = program
      self.compiled_background += 1
      del self._futures[key]

  def _raise_failures(self) -> None:
    """(under _lock) A background compile that failed, raised on the caller's thread."""
    for key, future in list(self._futures.items()):
      if future.done() and future.exception() is not None:
        del self._futures[key]
        raise RuntimeError(f"compiling the sampler program {key} failed") from future.exception()


def compile_covers(engine, params, decode_state, *, truncate: bool) -> list:
  """Compile, on the caller's thread, the programs that cover every later call of the
  sampling variant `truncate` (engine.programs must be set): the fused generate over all
  slots and page columns with the whole prefill lane (generate_cover takes it for any
  call), and the batched prefill of the fused layout's rows (to a power of two) at the
  longest prompt bucket (prefill_plan runs any prefill on it, in several calls when
  longer). Before a run's clock starts, so no call of the run waits for a compile: the
  other buckets compile in the background while these serve. `params` as the engine's
  programs take them (Engine.sampler_params). Returns the keys compiled."""
  progs = engine.programs
  slots, lane = engine.max_concurrent_decodes, engine.prefill_lane
  gen_key = (slots, engine.pages_per_seq, 0, 2, bool(truncate), lane)
  jitted = engine.generate_program(slots, engine.pages_per_seq, fused=2, truncate=truncate,
                                   lane=lane)
  upd_v = engine.fused_layout._replace(lane=lane).empty()
  n = 1 << (engine.fused_layout.rows - 1).bit_length()
  t = engine.prefill_buckets[-1]
  pre_key = ("prefill", n, t)
  pre_args = (params, decode_state) + engine.prefill_arrays([], [], n, t)
  done = []
  for key, program, args in ((gen_key, jitted, (params, decode_state, upd_v)),
                             (pre_key, engine.prefill_pages_program, pre_args)):
    if progs.lookup(key) is None:
      progs.compile_now(key, program, args, ahead=True)
      done.append(key)
  return done


def generate_cover(ready: Sequence, *, num_slots: int, num_pages: int, lane: int,
                   truncate: bool) -> tuple | None:
  """The cheapest ready fused-generate key that can run a call over `num_slots` slots
  and `num_pages` page columns with `lane` lane tokens (0: no lane): at least as many
  slots and columns, the same sampling variant, and a lane at least as long when one
  is needed (a lane program runs a call without one on an empty lane). Cost: slots x
  columns, then lane tokens. None when nothing ready covers it."""
  best, best_cost = None, None
  for key in ready:
    if len(key) != 6 or key[2] or not key[3]:
      continue  # prefill keys, ragged-attention and unfused programs
    k, w, _, _, trunc, lane_k = key
    if k < num_slots or w < num_pages or trunc != truncate or lane_k < lane:
      continue
    cost = (k * w, lane_k)
    if best_cost is None or cost < best_cost:
      best, best_cost = key, cost
  return best


def prefill_plan(ready: Sequence, *, num_prompts: int, length: int) -> tuple[int, int] | None:
  """A ready prefill key ("prefill", n, t) with t >= length to run `num_prompts` prompts
  on: the smallest batch n >= num_prompts, else the largest batch (the prompts then go
  in ceil(num_prompts / n) calls). None when no ready program has t >= length."""
  keys = [(n, t) for tag, n, t in (k for k in ready if len(k) == 3 and k[0] == "prefill")
          if t >= length]
  if not keys:
    return None
  fits = [(n * t, n, t) for n, t in keys if n >= num_prompts]
  if fits:
    return min(fits)[1:]
  return max(keys, key=lambda nt: (nt[0], -nt[1]))


def covered_generate(engine, params, decode_state, pending, layout, *, num_slots=None,
                     num_pages=None, live=None):
  """Engine.apply_and_generate under compile_in_background: the call's own program
  when compiled, else (its compile scheduled) the cheapest compiled one covering it,
  with the update packed for that program's lane."""
  del live  # only ragged attention reads it, and it compiles inline
  progs = engine.programs
  k = engine.max_concurrent_decodes if num_slots is None else int(num_slots)
  w = engine.pages_per_seq if num_pages is None else int(num_pages)
  key = (k, w, 0, 1 + bool(layout.lane), engine.truncate, layout.lane)
  jitted = engine.generate_program(k, w, fused=key[3], lane=layout.lane)
  upd_v = pending.pack(layout)
  program = progs.lookup(key)
  if program is None:
    cover = generate_cover(progs.ready_keys(), num_slots=k, num_pages=w, lane=layout.lane,
                           truncate=engine.truncate)
    if cover is None:
      program = progs.compile_now(key, jitted, (params, decode_state, upd_v))
    else:
      progs.schedule(key, jitted, (params, decode_state, upd_v))
      progs.covered_calls += 1
      program = progs.lookup(cover)
      upd_v = pending.pack(layout._replace(lane=cover[5]))
  pending.clear()
  return program(params, decode_state, upd_v)


def covered_prefill(engine, args, padded, pages):
  """Engine.prefill_into_pages under compile_in_background. args = (params, state,
  tokens_nt, true_n, pages_nm) of its own program; padded = [(tokens, length)]."""
  progs = engine.programs
  n, t = args[2].shape
  key = ("prefill", n, t)
  program = progs.lookup(key)
  if program is not None:
    return program(*args)
  plan = prefill_plan(progs.ready_keys(), num_prompts=len(padded), length=t)
  if plan is None:
    return progs.compile_now(key, engine.prefill_pages_program, args)(*args)
  progs.schedule(key, engine.prefill_pages_program, args)
  progs.covered_calls += 1
  n2, t2 = plan
  program = progs.lookup(("prefill", n2, t2))
  params, state = args[:2]
  for i in range(0, len(padded), n2):
    state = program(params, state,
                    *engine.prefill_arrays(padded[i:i + n2], pages[i:i + n2], n2, t2))
  return state

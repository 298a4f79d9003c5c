"""Concurrent, fault-tolerant calls of one handler: the verifier pool and the tool pool.

A `WorkerPool` runs `handler(payload)` for every submitted call; the verifier's handler
scores a completion (rl_jax.tasks.verifier_pool), an environment's handler runs a tool
call (rl_jax.envs.tools). Its settings come from one config section, `section` (the
verifier section, or env.tool), with the fields backend, workers, timeout_s, retries,
latency* and failure_prob.

`submit` never blocks: it queues a call and returns. `workers` workers take calls from
the queue; each attempt of a call may take at most timeout_s seconds, measured from the
attempt's start (queueing does not count). A timed-out or failed attempt is retried up
to `retries` times, so a call takes at most (retries + 1) * timeout_s of worker time
plus its queueing delay. The final status is that of the last attempt:

  ok       the handler returned; the result carries its value
  timeout  the last attempt ran past timeout_s; value = the pool's failure_value
  error    the last attempt raised (or its process died); value = failure_value

Results arrive through the call's callback(key, result), run on a pool thread (keep it
short and thread-safe), or, without a callback, on an output queue read with poll() and
get(). latency_s of a result = t_finished - t_submitted (time.time() stamps).

Backends (<section>.backend):
  threads    workers are threads. Python cannot stop a thread, so a watchdog marks an
             attempt that overruns its deadline as timed out, starts a replacement
             worker to keep `workers` live, and discards the late result when
             the stuck thread eventually returns.
  processes  each worker thread owns one spawned process that runs the handler; an
             attempt that overruns is stopped by killing that process, which is then
             respawned. The handler and payloads must be picklable.

Injected latency and failures (rl_jax.tasks.latency) are drawn per (seed, call index,
attempt), the call index being the submission order.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from rl_jax.tasks.base import TaskError
from rl_jax.tasks.latency import InjectedFailure, draw_call, make_latency

BACKENDS = ("threads", "processes")
STATUSES = ("ok", "timeout", "error")
# Latencies kept for percentiles: a sliding window, so stats() stays O(window).
_LATENCY_WINDOW = 10_000
# close() waits this long in total for workers to exit; idle ones exit at once and a
# thread stuck inside the handler is a daemon that is left behind.
_CLOSE_WAIT_S = 1.0
# A process worker checks for close() this often while waiting on its process.
_POLL_S = 0.05
# How long a new worker process may take to import the handler before it counts as
# failed; start-up is not charged to any call's timeout.
_PROCESS_START_S = 120.0

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CallResult:
  """The outcome of one submitted call; times are time.time() stamps.

  value is the handler's return value (the pool's failure_value unless status is ok);
  t_started is the start of the first attempt; error is the last failed attempt's
  message ("" when status is ok).
  """
  key: Any
  value: Any
  status: str
  attempts: int
  t_submitted: float
  t_started: float
  t_finished: float
  error: str = ""

  @property
  def latency_s(self) -> float:
    return self.t_finished - self.t_submitted

  @property
  def reward(self):
    """The verifier's name for the value (a rl_jax.tasks.Reward)."""
    return self.value


class _Closed(Exception):
  """The pool closed while an attempt was waiting."""


@dataclasses.dataclass(eq=False)
class _Call:
  key: Any
  payload: Any
  callback: Callable[[Any, CallResult], None] | None
  index: int
  t_submitted: float
  t_started: float = 0.0
  attempts: int = 0
  running: int = 0  # the attempt number in progress, 0 when none


def _process_main(conn, handler: Callable[[Any], Any], name: str) -> None:
  """Body of a worker process: run (payload, delay, fails) messages."""
  conn.send(("ready", None))
  while True:
    try:
      payload, delay, fails = conn.recv()
    except (EOFError, OSError):
      return
    try:
      if delay > 0:
        time.sleep(delay)
      if fails:
        raise InjectedFailure(f"injected {name} failure")
      conn.send(("ok", handler(payload)))
    except Exception as e:  # pylint: disable=broad-except
      conn.send(("error", f"{type(e).__name__}: {e}"))


class WorkerPool:
  """Runs `handler(payload)` calls concurrently; see the module docstring.

  cfg: the config section (`section` names it in errors, e.g. "verifier", "env.tool");
  name: what a call is, in messages ("verifier", "tool"); failure_value: the value of a
  call that timed out or failed.
  """

  def __init__(self, handler: Callable[[Any], Any], cfg, *, seed: int = 0,
               section: str = "verifier", name: str = "verifier", failure_value: Any = None):
    if cfg.backend not in BACKENDS:
      raise TaskError(f"{section}.backend must be one of {BACKENDS}, got {cfg.backend!r}.")
    if int(cfg.workers) < 1:
      raise TaskError(f"{section}.workers must be >= 1, got {cfg.workers}.")
    if not float(cfg.timeout_s) > 0:
      raise TaskError(f"{section}.timeout_s must be > 0, got {cfg.timeout_s}.")
    if int(cfg.retries) < 0:
      raise TaskError(f"{section}.retries must be >= 0, got {cfg.retries}.")
    self.handler, self.name, self.failure_value = handler, name, failure_value
    self.backend = cfg.backend
    self.workers = int(cfg.workers)
    self.timeout_s = float(cfg.timeout_s)
    self.retries = int(cfg.retries)
    self.failure_prob = float(cfg.failure_prob)
    self.seed = int(seed)
    self._latency = make_latency(cfg, section=section)

    self._lock = threading.Lock()
    self._wakeup = threading.Condition(self._lock)
    self._stop = threading.Event()
    self._inbox: queue.Queue[_Call | None] = queue.Queue()
    self._outbox: queue.Queue[CallResult] = queue.Queue()
    self._deadlines: list[tuple[float, int, _Call, int]] = []
    self._sequence = itertools.count()
    self._threads: list[threading.Thread] = []
    self._closed = False
    self._submitted = 0
    self._counts = dict.fromkeys(STATUSES, 0)
    self._retried = 0
    self._abandoned = 0
    self._callback_errors = 0
    self._latencies: list[float] = []

    if self.backend == "processes":
      # spawn, not fork: forking a process that runs JAX threads can deadlock.
      self._mp = multiprocessing.get_context("spawn")
      # Started here so that a handler that cannot be pickled fails the constructor.
      children = [self._spawn() for _ in range(self.workers)]
      for child in children:
        self._start_thread(lambda child=child: self._process_worker(*child),
                           f"{name}-worker")
    else:
      self._start_thread(self._watchdog, f"{name}-watchdog")
      for _ in range(self.workers):
        self._start_thread(self._thread_worker, f"{name}-worker")

  def _start_thread(self, target: Callable[[], None], name: str) -> None:
    thread = threading.Thread(target=target, name=name, daemon=True)
    # Abandoned workers exit once their stuck call returns; forget finished ones.
    self._threads = [t for t in self._threads if t.is_alive()] + [thread]
    thread.start()

  def continue_from(self, calls: int) -> None:
    """The next call gets index `calls`: each call's injected latency and failure are drawn
    from (seed, call index), so a resumed run continues an interrupted one's draws."""
    with self._lock:
      self._submitted = int(calls)

  def submit_call(self, key: Any, payload: Any,
                  callback: Callable[[Any, CallResult], None] | None = None) -> None:
    """Queues handler(payload) and returns at once; raises RuntimeError after close()."""
    with self._lock:
      if self._closed:
        raise RuntimeError(f"{type(self).__name__}.submit called after close().")
      call = _Call(key=key, payload=payload, callback=callback,
                   index=self._submitted, t_submitted=time.time())
      self._submitted += 1
    self._inbox.put(call)

  def poll(self) -> list[CallResult]:
    """Every result ready on the output queue, without waiting."""
    results = []
    while True:
      try:
        results.append(self._outbox.get_nowait())
      except queue.Empty:
        return results

  def get(self, timeout: float | None = None) -> CallResult | None:
    """The next result from the output queue; None if none arrives within timeout."""
    try:
      return self._outbox.get(timeout=timeout)
    except queue.Empty:
      return None

  @property
  def pending(self) -> int:
    """Calls submitted but not yet finished."""
    with self._lock:
      return self._submitted - sum(self._counts.values())

  def stats(self) -> dict[str, float]:
    """Counts by status and latency percentiles (seconds) of the last 10k results."""
    with self._lock:
      out = {"submitted": self._submitted, "pending": self._submitted -
             sum(self._counts.values()), **self._counts, "retries": self._retried,
             "abandoned_attempts": self._abandoned,
             "callback_errors": self._callback_errors}
      latencies = np.asarray(self._latencies)
    for q in (50, 95, 99):
      out[f"latency_p{q}_s"] = float(np.percentile(latencies, q)) if latencies.size else 0.0
    out["latency_mean_s"] = float(latencies.mean()) if latencies.size else 0.0
    return out

  def close(self) -> None:
    """Stops the workers without waiting for in-flight calls; queued calls are dropped.

    Returns within about 1 s even if the handler is stuck: threads are daemons,
    processes are killed.
    """
    with self._lock:
      if self._closed:
        return
      self._closed = True
      self._wakeup.notify_all()
      threads = list(self._threads)
    self._stop.set()
    for _ in threads:
      self._inbox.put(None)
    deadline = time.monotonic() + _CLOSE_WAIT_S
    for thread in threads:
      thread.join(timeout=max(0.0, deadline - time.monotonic()))

  def __enter__(self) -> "WorkerPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _begin_attempt(self, call: _Call) -> int:
    """Marks the next attempt of `call` as running (lock held); returns its number."""
    call.attempts += 1
    now = time.time()
    call.t_started = call.t_started or now
    call.running = call.attempts
    if self.backend == "threads":
      heapq.heappush(self._deadlines,
                     (now + self.timeout_s, next(self._sequence), call, call.attempts))
      self._wakeup.notify()
    return call.attempts

  def _settle(self, call: _Call, value: Any, status: str,
              error: str = "") -> CallResult | None:
    """Ends an attempt (lock held): the final result, or None if retried or closed."""
    call.running = 0
    if self._closed:
      return None
    if status != "ok" and call.attempts <= self.retries:
      self._retried += 1
      self._inbox.put(call)
      return None
    if status != "ok":
      value = self.failure_value
    result = CallResult(key=call.key, value=value,
                          status=status, attempts=call.attempts,
                          t_submitted=call.t_submitted, t_started=call.t_started,
                          t_finished=time.time(), error=error)
    self._counts[status] += 1
    self._latencies.append(result.latency_s)
    if len(self._latencies) > 2 * _LATENCY_WINDOW:
      del self._latencies[:-_LATENCY_WINDOW]
    return result

  def _deliver(self, call: _Call, result: CallResult | None) -> None:
    if result is None:
      return
    if call.callback is None:
      self._outbox.put(result)
      return
    try:
      call.callback(call.key, result)
    except Exception:  # pylint: disable=broad-except
      # A failing consumer must not kill a worker and strand the calls behind it.
      log.exception("%s callback failed for key %r", self.name, call.key)
      with self._lock:
        self._callback_errors += 1

  def _draw(self, call: _Call, attempt: int) -> tuple[float, bool]:
    return draw_call(latency=self._latency, failure_prob=self.failure_prob,
                     seed=self.seed, call_index=call.index, attempt=attempt)

  def _thread_worker(self) -> None:
    while True:
      call = self._inbox.get()
      with self._lock:
        if call is None or self._closed:
          return
        attempt = self._begin_attempt(call)
      value, status, error = None, "ok", ""
      try:
        delay, fails = self._draw(call, attempt)
        # Waiting on the stop event rather than sleeping lets close() return at once.
        if delay > 0 and self._stop.wait(delay):
          return
        if fails:
          raise InjectedFailure(f"injected {self.name} failure")
        value = self.handler(call.payload)
      except Exception as e:  # pylint: disable=broad-except
        status, error = "error", f"{type(e).__name__}: {e}"
      with self._lock:
        if call.running != attempt:
          # The watchdog timed this attempt out and started a replacement worker.
          return
        result = self._settle(call, value, status, error)
      self._deliver(call, result)

  def _watchdog(self) -> None:
    """Times out overdue thread attempts (threads backend)."""
    while True:
      expired = []
      with self._lock:
        if self._closed:
          return
        now = time.time()
        while self._deadlines and self._deadlines[0][0] <= now:
          _, _, call, attempt = heapq.heappop(self._deadlines)
          if call.running == attempt:
            self._abandoned += 1
            self._start_thread(self._thread_worker, f"{self.name}-worker")
            expired.append((call, self._settle(
                call, None, "timeout", f"attempt exceeded {self.timeout_s} s")))
        if not expired:
          wait = self._deadlines[0][0] - now if self._deadlines else None
          self._wakeup.wait(wait)
      for call, result in expired:
        self._deliver(call, result)

  def _spawn(self):
    parent, child = self._mp.Pipe()
    process = self._mp.Process(target=_process_main, args=(child, self.handler, self.name),
                               name=f"{self.name}-process", daemon=True)
    process.start()
    child.close()
    return process, parent

  def _receive(self, conn, timeout_s: float) -> tuple[str, Any] | None:
    """The next message from a process, None after timeout_s; _Closed on close()."""
    deadline = time.monotonic() + timeout_s
    while True:
      remaining = deadline - time.monotonic()
      if conn.poll(max(0.0, min(_POLL_S, remaining))):
        return conn.recv()
      if self._stop.is_set():
        raise _Closed()
      if remaining <= 0:
        return None

  def _run_in_process(self, conn, call: _Call, attempt: int) -> tuple[str, Any]:
    """Sends one attempt to the worker's process and waits up to timeout_s."""
    delay, fails = self._draw(call, attempt)
    conn.send((call.payload, delay, fails))
    message = self._receive(conn, self.timeout_s)
    return message or ("timeout", f"attempt exceeded {self.timeout_s} s")

  def _ready(self, process, conn) -> bool:
    """Waits for a new process's "ready"; False (logged) if it dies or stalls."""
    try:
      if self._receive(conn, _PROCESS_START_S) == ("ready", None):
        return True
      log.error("%s process did not start within %.0f s", self.name, _PROCESS_START_S)
    except (EOFError, OSError) as e:
      log.error("%s process exited during start-up (%s: %s, exit code %s)",
                self.name, type(e).__name__, e, process.exitcode)
    process.kill()
    process.join(timeout=1.0)
    return False

  def _start_process(self):
    """(process, conn) of a new worker process that reported ready, else (None, None)."""
    try:
      process, conn = self._spawn()
    except Exception:  # pylint: disable=broad-except
      log.exception("%s process failed to start", self.name)
      return None, None
    return (process, conn) if self._ready(process, conn) else (None, None)

  def _process_worker(self, process, conn) -> None:
    try:
      if not self._ready(process, conn):
        process, conn = self._start_process()
      while True:
        call = self._inbox.get()
        with self._lock:
          if call is None or self._closed:
            return
          attempt = self._begin_attempt(call)
        if process is None:
          process, conn = self._start_process()
        broken = False
        try:
          if process is None:
            raise RuntimeError(f"no {self.name} process could be started")
          status, payload = self._run_in_process(conn, call, attempt)
        except _Closed:
          return
        except Exception as e:  # pylint: disable=broad-except
          # The process died mid-call (EOFError, BrokenPipeError) or never started.
          broken = True
          status, payload = "error", f"{self.name} process failed ({type(e).__name__}: {e})"
        with self._lock:
          result = self._settle(call, payload if status == "ok" else None, status,
                                "" if status == "ok" else str(payload))
        self._deliver(call, result)
        if process is not None and (status == "timeout" or broken):
          # A timed-out process may still be computing (its late answer would sit in
          # the pipe) and a dead one cannot serve: replace it before the next call.
          process.kill()
          process.join(timeout=1.0)
          process, conn = self._start_process()
    except _Closed:
      return
    finally:
      if process is not None:
        process.kill()
        process.join(timeout=1.0)

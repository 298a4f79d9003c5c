"""Concurrent, fault-tolerant scoring of completions.

`VerifierPool.submit` never blocks: it queues a call and returns. verifier.workers
workers take calls from the queue; each attempt of a call may take at most
verifier.timeout_s seconds, measured from the attempt's start (queueing does not count).
A timed-out or failed attempt is retried up to verifier.retries times, so a call takes
at most (retries + 1) * timeout_s of worker time plus its queueing delay. The final
status is that of the last attempt:

  ok       task.reward returned; the result carries its Reward
  timeout  the last attempt ran past timeout_s; reward 0
  error    the last attempt raised (or its process died); reward 0

Results arrive through the call's callback(key, result), run on a pool thread (keep it
short and thread-safe), or, without a callback, on an output queue read with poll() and
get(). latency_s of a result = t_finished - t_submitted (time.time() stamps).

Backends (verifier.backend):
  threads    workers are threads. Python cannot stop a thread, so a watchdog marks an
             attempt that overruns its deadline as timed out, starts a replacement
             worker to keep verifier.workers live, and discards the late result when
             the stuck thread eventually returns.
  processes  each worker thread owns one spawned process that runs task.reward; an
             attempt that overruns is stopped by killing that process, which is then
             respawned. The task and examples must be picklable.

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

from rl_jax.tasks.base import Example, Reward, Task, TaskError, make_reward
from rl_jax.tasks.latency import InjectedFailure, draw_call, make_latency

BACKENDS = ("threads", "processes")
STATUSES = ("ok", "timeout", "error")
# Latencies kept for percentiles: a sliding window, so stats() stays O(window).
_LATENCY_WINDOW = 10_000
# close() waits this long in total for workers to exit; idle ones exit at once and a
# thread stuck inside task.reward is a daemon that is left behind.
_CLOSE_WAIT_S = 1.0
# A process worker checks for close() this often while waiting on its process.
_POLL_S = 0.05
# How long a new verifier process may take to import the task before it counts as
# failed; start-up is not charged to any call's timeout.
_PROCESS_START_S = 120.0

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class VerifyResult:
  """The outcome of one submitted call; times are time.time() stamps.

  t_started is the start of the first attempt; error is the last failed attempt's
  message ("" when status is ok).
  """
  key: Any
  reward: Reward
  status: str
  attempts: int
  t_submitted: float
  t_started: float
  t_finished: float
  error: str = ""

  @property
  def latency_s(self) -> float:
    return self.t_finished - self.t_submitted


class _Closed(Exception):
  """The pool closed while an attempt was waiting."""


@dataclasses.dataclass(eq=False)
class _Call:
  key: Any
  example: Example
  text: str
  callback: Callable[[Any, VerifyResult], None] | None
  index: int
  t_submitted: float
  t_started: float = 0.0
  attempts: int = 0
  running: int = 0  # the attempt number in progress, 0 when none


def _process_main(conn, task: Task) -> None:
  """Body of a verifier process: score (example, text, delay, fails) messages."""
  conn.send(("ready", None))
  while True:
    try:
      example, text, delay, fails = conn.recv()
    except (EOFError, OSError):
      return
    try:
      if delay > 0:
        time.sleep(delay)
      if fails:
        raise InjectedFailure("injected verifier failure")
      conn.send(("ok", task.reward(example, text)))
    except Exception as e:  # pylint: disable=broad-except
      conn.send(("error", f"{type(e).__name__}: {e}"))


class VerifierPool:
  """Scores completions with `task.reward` concurrently; see the module docstring."""

  def __init__(self, task: Task, verifier_cfg, seed: int = 0):
    if verifier_cfg.backend not in BACKENDS:
      raise TaskError(f"verifier.backend must be one of {BACKENDS}, "
                      f"got {verifier_cfg.backend!r}.")
    if int(verifier_cfg.workers) < 1:
      raise TaskError(f"verifier.workers must be >= 1, got {verifier_cfg.workers}.")
    if not float(verifier_cfg.timeout_s) > 0:
      raise TaskError(f"verifier.timeout_s must be > 0, got {verifier_cfg.timeout_s}.")
    if int(verifier_cfg.retries) < 0:
      raise TaskError(f"verifier.retries must be >= 0, got {verifier_cfg.retries}.")
    self.task = task
    self.backend = verifier_cfg.backend
    self.workers = int(verifier_cfg.workers)
    self.timeout_s = float(verifier_cfg.timeout_s)
    self.retries = int(verifier_cfg.retries)
    self.failure_prob = float(verifier_cfg.failure_prob)
    self.seed = int(seed)
    self._latency = make_latency(verifier_cfg)

    self._lock = threading.Lock()
    self._wakeup = threading.Condition(self._lock)
    self._stop = threading.Event()
    self._inbox: queue.Queue[_Call | None] = queue.Queue()
    self._outbox: queue.Queue[VerifyResult] = queue.Queue()
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
      # Started here so that a task that cannot be pickled fails the constructor.
      children = [self._spawn() for _ in range(self.workers)]
      for child in children:
        self._start_thread(lambda child=child: self._process_worker(*child),
                           "verifier-worker")
    else:
      self._start_thread(self._watchdog, "verifier-watchdog")
      for _ in range(self.workers):
        self._start_thread(self._thread_worker, "verifier-worker")

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

  def submit(self, key: Any, example: Example, completion_text: str,
             callback: Callable[[Any, VerifyResult], None] | None = None) -> None:
    """Queues one call and returns at once; raises RuntimeError after close()."""
    with self._lock:
      if self._closed:
        raise RuntimeError("VerifierPool.submit called after close().")
      call = _Call(key=key, example=example, text=completion_text, callback=callback,
                   index=self._submitted, t_submitted=time.time())
      self._submitted += 1
    self._inbox.put(call)

  def poll(self) -> list[VerifyResult]:
    """Every result ready on the output queue, without waiting."""
    results = []
    while True:
      try:
        results.append(self._outbox.get_nowait())
      except queue.Empty:
        return results

  def get(self, timeout: float | None = None) -> VerifyResult | None:
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

    Returns within about 1 s even if task.reward is stuck: threads are daemons,
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

  def __enter__(self) -> "VerifierPool":
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

  def _settle(self, call: _Call, reward: Reward | None, status: str,
              error: str = "") -> VerifyResult | None:
    """Ends an attempt (lock held): the final result, or None if retried or closed."""
    call.running = 0
    if self._closed:
      return None
    if status != "ok" and call.attempts <= self.retries:
      self._retried += 1
      self._inbox.put(call)
      return None
    if status != "ok":
      reward = make_reward(correct=0.0, format_ok=0.0, format_reward=0.0)
    result = VerifyResult(key=call.key, reward=reward,
                          status=status, attempts=call.attempts,
                          t_submitted=call.t_submitted, t_started=call.t_started,
                          t_finished=time.time(), error=error)
    self._counts[status] += 1
    self._latencies.append(result.latency_s)
    if len(self._latencies) > 2 * _LATENCY_WINDOW:
      del self._latencies[:-_LATENCY_WINDOW]
    return result

  def _deliver(self, call: _Call, result: VerifyResult | None) -> None:
    if result is None:
      return
    if call.callback is None:
      self._outbox.put(result)
      return
    try:
      call.callback(call.key, result)
    except Exception:  # pylint: disable=broad-except
      # A failing consumer must not kill a worker and strand the calls behind it.
      log.exception("verifier callback failed for key %r", call.key)
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
      reward, status, error = None, "ok", ""
      try:
        delay, fails = self._draw(call, attempt)
        # Waiting on the stop event rather than sleeping lets close() return at once.
        if delay > 0 and self._stop.wait(delay):
          return
        if fails:
          raise InjectedFailure("injected verifier failure")
        reward = self.task.reward(call.example, call.text)
      except Exception as e:  # pylint: disable=broad-except
        status, error = "error", f"{type(e).__name__}: {e}"
      with self._lock:
        if call.running != attempt:
          # The watchdog timed this attempt out and started a replacement worker.
          return
        result = self._settle(call, reward, status, error)
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
            self._start_thread(self._thread_worker, "verifier-worker")
            expired.append((call, self._settle(
                call, None, "timeout", f"attempt exceeded {self.timeout_s} s")))
        if not expired:
          wait = self._deadlines[0][0] - now if self._deadlines else None
          self._wakeup.wait(wait)
      for call, result in expired:
        self._deliver(call, result)

  def _spawn(self):
    parent, child = self._mp.Pipe()
    process = self._mp.Process(target=_process_main, args=(child, self.task),
                               name="verifier-process", daemon=True)
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
    conn.send((call.example, call.text, delay, fails))
    message = self._receive(conn, self.timeout_s)
    return message or ("timeout", f"attempt exceeded {self.timeout_s} s")

  def _ready(self, process, conn) -> bool:
    """Waits for a new process's "ready"; False (logged) if it dies or stalls."""
    try:
      if self._receive(conn, _PROCESS_START_S) == ("ready", None):
        return True
      log.error("verifier process did not start within %.0f s", _PROCESS_START_S)
    except (EOFError, OSError) as e:
      log.error("verifier process exited during start-up (%s: %s, exit code %s)",
                type(e).__name__, e, process.exitcode)
    process.kill()
    process.join(timeout=1.0)
    return False

  def _start_process(self):
    """(process, conn) of a new verifier process that reported ready, else (None, None)."""
    try:
      process, conn = self._spawn()
    except Exception:  # pylint: disable=broad-except
      log.exception("verifier process failed to start")
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
            raise RuntimeError("no verifier process could be started")
          status, payload = self._run_in_process(conn, call, attempt)
        except _Closed:
          return
        except Exception as e:  # pylint: disable=broad-except
          # The process died mid-call (EOFError, BrokenPipeError) or never started.
          broken = True
          status, payload = "error", f"verifier process failed ({type(e).__name__}: {e})"
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

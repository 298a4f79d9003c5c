"""Tests for rl_jax.tasks.verifier_pool and rl_jax.tasks.latency."""
import os
import threading
import time

import numpy as np
import pytest

from configs.base import get_config
from rl_jax.tasks import latency as latency_lib
from rl_jax.tasks.base import Example, TaskError, make_reward, make_task
from rl_jax.tasks.verifier_pool import VerifierPool


class SleepyTask:
  """Scores "ok" as correct; sleeps `completion` seconds when it parses as a float;
  "raise" raises, "exit" ends the (verifier) process."""
  name = "sleepy"
  procedural = True
  format_reward = 0.0

  def reward(self, example, completion_text):
    if completion_text == "raise":
      raise KeyError("verifier bug")
    if completion_text == "exit":  # only ever sent to the processes backend
      os._exit(3)
    try:
      time.sleep(float(completion_text))
    except ValueError:
      pass
    return make_reward(correct=completion_text == "ok", format_ok=1.0, format_reward=0.0)


EX = Example(uid="u", prompt="p", answer="ok")


def verifier_cfg(**fields):
  cfg = get_config().verifier
  cfg.workers, cfg.timeout_s, cfg.retries = 2, 2.0, 0
  for k, v in fields.items():
    setattr(cfg, k, v)
  return cfg


def collect(pool, n, timeout=120.0):
  results = [pool.get(timeout=timeout) for _ in range(n)]
  assert all(r is not None for r in results), "pool did not deliver every result"
  return {r.key: r for r in results}


def test_scores_arithmetic_completions():
  task = make_task(get_config().task)
  with VerifierPool(task, verifier_cfg(workers=3), seed=0) as pool:
    examples = [task.example(i) for i in range(30)]
    for i, ex in enumerate(examples):
      pool.submit(i, ex, ex.answer if i % 3 else "wrong")
    results = collect(pool, 30)
    assert pool.poll() == []
    stats = pool.stats()
  assert {r.status for r in results.values()} == {"ok"}
  assert [results[i].reward.score for i in range(30)] == [float(i % 3 != 0) for i in range(30)]
  assert all(r.attempts == 1 and r.t_submitted <= r.t_started <= r.t_finished
             for r in results.values())
  assert stats["ok"] == 30 and stats["pending"] == 0 and stats["latency_p99_s"] >= 0


def test_callback_delivery_and_poll():
  got, done = {}, threading.Event()

  def callback(key, result):
    got[key] = result
    if len(got) == 5:
      done.set()

  with VerifierPool(SleepyTask(), verifier_cfg(), seed=0) as pool:
    for i in range(5):
      pool.submit(i, EX, "ok", callback=callback)
    assert done.wait(120)
    pool.submit("q", EX, "no")
    deadline = time.monotonic() + 120  # a bound on a hang, not a timing window
    polled = []
    while not polled and time.monotonic() < deadline:
      polled = pool.poll()
      time.sleep(0.01)
  assert sorted(got) == list(range(5)) and all(r.reward.score == 1 for r in got.values())
  assert [(r.key, r.reward.score) for r in polled] == [("q", 0.0)]


class BlockingTask(SleepyTask):
  """SleepyTask whose "block" call waits until the test releases it (no time window:
  it overruns any timeout however slowly the machine runs) and then reports its return."""

  def __init__(self):
    self.release, self.returned = threading.Event(), threading.Event()

  def reward(self, example, completion_text):
    if completion_text == "block":
      self.release.wait(300)
      self.returned.set()
    return super().reward(example, completion_text)


def test_timeout_gives_zero_reward_and_pool_keeps_working():
  task = BlockingTask()
  # The timeout is a lower bound that load only stretches; "ok" needs far less than 3 s.
  with VerifierPool(task, verifier_cfg(workers=1, timeout_s=3.0), seed=0) as pool:
    pool.submit("slow", EX, "block")
    slow = pool.get(timeout=120)
    assert (slow.key, slow.status, slow.reward.score, slow.attempts) == ("slow", "timeout", 0.0, 1)
    assert slow.t_finished - slow.t_started >= 3.0
    # The only worker is stuck in the call; a replacement serves the next call.
    pool.submit("fast", EX, "ok")
    fast = pool.get(timeout=120)
    assert (fast.key, fast.status, fast.reward.score) == ("fast", "ok", 1.0)
    # The stuck call returns now: its late result must be discarded.
    task.release.set()
    assert task.returned.wait(120)
    time.sleep(0.2)  # let the worker hand its late result over (discarded either way)
    assert pool.poll() == []
    stats = pool.stats()
  assert (stats["timeout"], stats["ok"], stats["abandoned_attempts"]) == (1, 1, 1)


def test_timeout_is_retried():
  with VerifierPool(SleepyTask(), verifier_cfg(timeout_s=0.1, retries=1), seed=0) as pool:
    pool.submit(0, EX, "0.4")
    result = pool.get(timeout=120)
    assert (result.status, result.attempts) == ("timeout", 2)
    assert pool.stats()["retries"] == 1


@pytest.mark.parametrize("retries", [0, 2])
def test_injected_failure_errors_after_retries(retries):
  cfg = verifier_cfg(failure_prob=1.0, retries=retries)
  with VerifierPool(SleepyTask(), cfg, seed=0) as pool:
    pool.submit(0, EX, "ok")
    result = pool.get(timeout=120)
  assert (result.status, result.reward.score, result.attempts) == ("error", 0.0, retries + 1)
  assert "InjectedFailure" in result.error


def test_verifier_exception_and_bad_callback_do_not_break_the_pool():
  def bad_callback(key, result):
    raise RuntimeError("consumer bug")

  with VerifierPool(SleepyTask(), verifier_cfg(workers=1), seed=0) as pool:
    pool.submit(0, EX, "raise")
    assert pool.get(timeout=120).status == "error"
    pool.submit(1, EX, "ok", callback=bad_callback)
    pool.submit(2, EX, "ok")
    assert pool.get(timeout=120).key == 2
    assert pool.stats()["callback_errors"] == 1


def test_submit_never_blocks_and_close_is_quick():
  """A blocking submit or close would take the 600 s the worker is busy for; the bounds
  (60 s) sit far from both that and the milliseconds these take, so load cannot flip them."""
  cfg = verifier_cfg(workers=1, timeout_s=900.0, latency="fixed", latency_mean_s=600.0)
  pool = VerifierPool(SleepyTask(), cfg, seed=0)
  start = time.monotonic()
  for i in range(50):
    pool.submit(i, EX, "ok")
  assert time.monotonic() - start < 60
  start = time.monotonic()
  pool.close()  # a worker is inside its 600 s injected delay
  assert time.monotonic() - start < 60
  with pytest.raises(RuntimeError, match="after close"):
    pool.submit(0, EX, "ok")
  task = BlockingTask()
  pool = VerifierPool(task, verifier_cfg(workers=1, timeout_s=900.0), seed=0)
  pool.submit("stuck", EX, "block")
  start = time.monotonic()
  pool.close()  # a worker is (or is about to be) stuck inside task.reward
  assert time.monotonic() - start < 60
  task.release.set()


def test_processes_backend_scores_and_recovers_from_timeouts():
  task = make_task(get_config().task)
  ex = task.example(0)
  cfg = verifier_cfg(backend="processes", workers=1, timeout_s=0.5)
  with VerifierPool(task, cfg, seed=0) as pool:
    pool.submit("right", ex, ex.answer)
    pool.submit("wrong", ex, "x")
    results = collect(pool, 2, timeout=60)
    assert (results["right"].reward.score, results["wrong"].reward.score) == (1.0, 0.0)
  # A call that overruns kills its process; the next call runs on a fresh one.
  cfg = verifier_cfg(backend="processes", workers=1, timeout_s=0.3)
  with VerifierPool(SleepyTask(), cfg, seed=0) as pool:
    pool.submit("slow", EX, "30")
    pool.submit("after", EX, "ok")
    pool.submit("exit", EX, "exit")
    pool.submit("raise", EX, "raise")
    pool.submit("last", EX, "ok")
    results = collect(pool, 5, timeout=60)
  assert {k: r.status for k, r in results.items()} == {
      "slow": "timeout", "after": "ok", "exit": "error", "raise": "error", "last": "ok"}
  assert "process failed" in results["exit"].error and "KeyError" in results["raise"].error
  assert results["last"].reward.score == 1.0
  with VerifierPool(task, verifier_cfg(backend="processes", workers=1, failure_prob=1.0),
                    seed=0) as pool:
    pool.submit("fail", ex, ex.answer)
    result = pool.get(timeout=60)
    assert (result.status, result.attempts) == ("error", 1)


@pytest.mark.parametrize("fields, message", [
    (dict(backend="fibers"), "verifier.backend"), (dict(workers=0), "verifier.workers"),
    (dict(timeout_s=0), "verifier.timeout_s"), (dict(retries=-1), "verifier.retries"),
    (dict(latency="gamma"), "verifier.latency"),
    (dict(latency="pareto", latency_mean_s=1.0, latency_alpha=1.0), "verifier.latency_alpha"),
    (dict(latency="lognormal", latency_mean_s=0.0), "verifier.latency_mean_s"),
    (dict(failure_prob=1.5), "verifier.failure_prob"),
    (dict(latency="empirical"), "verifier.latency_file"),
])
def test_bad_verifier_config_names_the_field(fields, message):
  with pytest.raises(TaskError, match=message):
    VerifierPool(SleepyTask(), verifier_cfg(**fields), seed=0)


def draws(n=200_000, **fields):
  latency = latency_lib.make_latency(verifier_cfg(**fields))
  return latency.sample(np.random.default_rng(0), size=n)


def test_latency_distributions_match_their_parameters():
  assert np.all(draws(latency="none") == 0)
  assert np.all(draws(latency="fixed", latency_mean_s=0.3) == 0.3)
  sigma = 0.8
  lognormal = draws(latency="lognormal", latency_mean_s=2.0, latency_sigma=sigma)
  assert lognormal.mean() == pytest.approx(2.0, rel=0.02)
  assert np.median(lognormal) == pytest.approx(2.0 * np.exp(-sigma**2 / 2), rel=0.02)
  pareto = draws(latency="pareto", latency_mean_s=1.0, latency_alpha=3.0)
  x_m = 1.0 * (3.0 - 1) / 3.0
  assert pareto.min() >= x_m
  assert pareto.mean() == pytest.approx(1.0, rel=0.03)
  assert np.median(pareto) == pytest.approx(x_m * 2 ** (1 / 3.0), rel=0.02)
  # alpha = 1.5 has infinite variance: its sample mean converges slowly, its median fast.
  heavy = draws(latency="pareto", latency_mean_s=1.0, latency_alpha=1.5)
  assert np.median(heavy) == pytest.approx(1.0 / 3 * 2 ** (1 / 1.5), rel=0.02)


def test_empirical_latency_file(tmp_path):
  path = tmp_path / "lat.txt"
  path.write_text("# seconds\n0.1\n\n0.2\n0.7\n")
  values = draws(latency="empirical", latency_file=str(path))
  assert set(np.unique(values)) == {0.1, 0.2, 0.7}
  assert values.mean() == pytest.approx(1.0 / 3, rel=0.02)
  path.write_text("0.1\nslow\n")
  with pytest.raises(TaskError, match=r"lat\.txt:2: expected a latency"):
    latency_lib.make_latency(verifier_cfg(latency="empirical", latency_file=str(path)))
  path.write_text("0.1\n-1\n")
  with pytest.raises(TaskError, match=r"lat\.txt:2"):
    latency_lib.make_latency(verifier_cfg(latency="empirical", latency_file=str(path)))
  with pytest.raises(TaskError, match="cannot be read"):
    latency_lib.make_latency(verifier_cfg(latency="empirical",
                                          latency_file=str(tmp_path / "missing.txt")))


def test_injected_draws_are_deterministic_per_call():
  latency = latency_lib.make_latency(verifier_cfg(latency="lognormal", latency_mean_s=1.0))

  def draw(seed, call_index, attempt):
    return latency_lib.draw_call(latency=latency, failure_prob=0.5, seed=seed,
                                 call_index=call_index, attempt=attempt)

  assert draw(0, 5, 1) == draw(0, 5, 1)
  assert len({draw(0, i, 1) for i in range(20)}) == 20
  assert draw(0, 5, 1) != draw(0, 5, 2) and draw(0, 5, 1) != draw(1, 5, 1)
  fails = [draw(0, i, 1)[1] for i in range(4000)]
  assert np.mean(fails) == pytest.approx(0.5, abs=0.04)

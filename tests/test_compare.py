"""launch/compare.py (rl_jax.compare) --seeds: each mode over N seeds, one run after
another, median and range in the headline, every seed's curve in the plot (train.py
stubbed: no runs); --ab and its errors."""
import importlib.util
import json
import os

import numpy as np
import pytest

from rl_jax import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_compare():
  spec = importlib.util.spec_from_file_location(
      "compare_cli", os.path.join(ROOT, "launch", "compare.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _fake_train(calls):
  """A train.py stand-in: writes a summary whose curve depends on mode and seed. Sync
  reaches 0.5 + 0.1 * (seed - 7) at 30 s per evaluation, async at 10 s per evaluation."""
  def train(cmd):
    arg = dict(a.split("=", 1) for a in cmd if a.startswith("--config.") and "=" in a)
    workdir = cmd[cmd.index("--workdir") + 1]
    mode, seed = arg["--config.rl.mode"], int(arg["--config.seed"])
    calls.append((mode, seed))
    dt = 30.0 if mode == "sync" else 10.0
    top = 0.5 + 0.1 * (seed - 7)
    curve = [[0.0, 0, 0.2]] + [[dt * k, k, top] for k in (1, 2, 3)]
    os.makedirs(workdir)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump({"mode": mode, "heldout_curve": curve, "staleness_histogram": {"0": 4},
                 "wall_time_s": curve[-1][0], "timeline": {}}, f)
    return 0
  return train


def test_seeds_run_one_after_another_and_report_median_and_range(tmp_path, capsys):
  compare = _load_compare()
  calls = []
  compare._train = _fake_train(calls)
  plot = tmp_path / "seeds.png"
  status = compare.main(["--config", os.path.join(ROOT, "configs/default.py"),
                         "--config.seed=7", "--workdir", str(tmp_path / "runs"), "--seeds",
                         "3", "--plot", str(plot)])
  assert status == 0
  assert calls == [("sync", 7), ("sync", 8), ("sync", 9), ("async", 7), ("async", 8),
                   ("async", 9)]
  out = capsys.readouterr().out
  # Finals 0.5, 0.6, 0.7 in both modes (the same seed's): target = median 0.6, which seed
  # 7 never reaches (inf); sync reaches it at 30 s (seeds 8, 9), async at 10 s.
  assert ("over 3 seeds, median [min, max]: time to target (held-out reward 0.600, sync's "
          "median final) sync 30 [30, inf]s (1 of 3 never reached it), async 10 [10, inf]s "
          "(1 of 3 never reached it), median speedup 3.00x; final held-out (mean of last 3 "
          "evaluations) sync 0.6 [0.5, 0.7], async 0.6 [0.5, 0.7]") in out
  assert os.path.getsize(plot) > 1000
  page = open(tmp_path / "runs" / "report.html").read()
  assert all(f"<th>{m}_seed{s}</th>" in page for m in ("sync", "async") for s in (7, 8, 9))
  # --report-only rebuilds the same headline from the runs already there.
  calls.clear()
  assert compare.main(["--config", os.path.join(ROOT, "configs/default.py"),
                       "--config.seed=7", "--workdir", str(tmp_path / "runs"), "--seeds",
                       "3", "--report-only"]) == 0
  assert calls == [] and "median speedup 3.00x" in capsys.readouterr().out


def test_seeds_headline_against_numpy():
  rng = np.random.default_rng(0)
  runs = {}
  for mode in ("sync", "async"):
    runs[mode] = []
    for _ in range(5):
      t = np.cumsum(rng.uniform(5, 15, 6))
      r = np.sort(rng.uniform(0.2, 0.9, 6))
      runs[mode].append({"heldout_curve": [[float(a), k, float(b)]
                                           for k, (a, b) in enumerate(zip(t, r))]})
  finals = {m: [np.mean([c[2] for c in s["heldout_curve"][-3:]]) for s in runs[m]]
            for m in runs}
  target = np.median(finals["sync"])

  def first(curve):
    hit = [c[0] for c in curve if c[2] >= target - 1e-9]
    return hit[0] if hit else np.inf
  times = {m: [first(s["heldout_curve"]) for s in runs[m]] for m in runs}
  line = report.seeds_headline(runs)
  assert f"held-out reward {target:.3f}" in line
  for m in runs:
    t = np.asarray(times[m])
    assert f"{m} {np.median(t):.3g} [{t.min():.3g}, {t.max():.3g}]s" in line
    f = np.asarray(finals[m])
    assert f"{m} {np.median(f):.3g} [{f.min():.3g}, {f.max():.3g}]" in line
  speedup = np.median(times["sync"]) / np.median(times["async"])
  assert f"median speedup {speedup:.2f}x" in line


def test_seeds_must_be_positive(tmp_path, capsys):
  compare = _load_compare()
  assert compare.main(["--config", os.path.join(ROOT, "configs/default.py"),
                       "--workdir", str(tmp_path), "--seeds", "0"]) != 0
  assert "--seeds must be >= 1" in capsys.readouterr().err


def _fake_ab_train(calls):
  """A train.py stand-in for --ab rl.filter_groups: filtering reaches 0.8 at 20 s per
  evaluation, no filtering 0.7 at 30 s; busy fraction and filter figures per value."""
  def train(cmd):
    arg = dict(a.split("=", 1) for a in cmd if a.startswith("--config.") and "=" in a)
    workdir = cmd[cmd.index("--workdir") + 1]
    value, seed = arg["--config.rl.filter_groups"], int(arg["--config.seed"])
    calls.append((arg["--config.rl.mode"], value, seed, workdir))
    on = value == "zero_variance"
    dt, top = (20.0, 0.8) if on else (30.0, 0.7)
    curve = [[0.0, 0, 0.2]] + [[dt * k, k, top + 0.01 * (seed - 7)] for k in (1, 2, 3)]
    os.makedirs(workdir)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump({"mode": "async", "heldout_curve": curve, "staleness_histogram": {"0": 4},
                 "wall_time_s": curve[-1][0], "timeline": {},
                 "sampler_busy_frac": 0.9 + 0.01 * (seed - 7),
                 "groups_filtered_zero_variance": 10 * (seed - 6) if on else 0,
                 "filtered_share": 0.3 if on else 0.0,
                 "sampled_per_trained": 1.4 + 0.1 * (seed - 7) if on else 1.0}, f)
    return 0
  return train


def test_ab_compares_two_values_of_a_field_in_one_mode(tmp_path, capsys):
  compare = _load_compare()
  calls = []
  compare._train = _fake_ab_train(calls)
  runs = tmp_path / "runs"
  assert compare.main(["--config", os.path.join(ROOT, "configs/default.py"),
                       "--config.seed=7", "--workdir", str(runs), "--seeds", "2",
                       "--ab", "rl.filter_groups=none,zero_variance", "--modes", "async",
                       "--plot", str(tmp_path / "ab.png")]) == 0
  assert calls == [("async", v, s, str(runs / v / f"async_seed{s}"))
                   for v in ("none", "zero_variance") for s in (7, 8)]
  out = capsys.readouterr().out
  # Finals: none 0.7 / 0.71 (median 0.705 = target), zero_variance 0.8 / 0.81. Seed 7 of
  # none never reaches 0.705 (inf), seed 8 does at 30 s; filtering reaches it at 20 s.
  assert ("async: over 2 seeds, median [min, max]: time to target (held-out reward 0.705, "
          "rl.filter_groups=none's median final) rl.filter_groups=none inf [30, inf]s (1 of "
          "2 never reached it), rl.filter_groups=zero_variance 20 [20, 20]s; final held-out (mean of last 3 evaluations) rl.filter_groups=none 0.705 "
          "[0.7, 0.71], rl.filter_groups=zero_variance 0.805 [0.8, 0.81]; "
          "rl.filter_groups=none: sampler busy 0.905 [0.9, 0.91]; "
          "rl.filter_groups=zero_variance: sampler busy 0.905 [0.9, 0.91], filtered share "
          "0.3 [0.3, 0.3], sampled per trained 1.45 [1.4, 1.5]") in out
  assert os.path.getsize(tmp_path / "ab.png") > 1000


@pytest.mark.parametrize("flags, message", [
    (["--ab", "rl.filter_groups=none"], "--ab takes FIELD=A,B with two different values"),
    (["--ab", "rl.seed=1,1"], "--ab takes FIELD=A,B with two different values"),
    (["--modes", "async"], "--modes must be sync,async"),
    (["--ab", "seed=1,2", "--modes", "sink"], "--modes takes sync and/or async"),
])
def test_ab_and_modes_errors_are_one_line(tmp_path, capsys, flags, message):
  compare = _load_compare()
  compare._train = lambda cmd: pytest.fail("must not run")
  assert compare.main(["--config", os.path.join(ROOT, "configs/default.py"),
                       "--workdir", str(tmp_path), *flags]) == 1
  err = capsys.readouterr().err
  assert message in err and err.count("\n") == 1


def test_ab_headline_of_live_control_gives_the_pipeline_figures():
  from rl_jax import compare

  def summary(wall, disc, busy, control):
    s = {"heldout_curve": [[0.0, 0, 0.2], [wall / 2, 5, 0.5], [wall, 10, 0.6]],
         "optimizer_steps": 10, "wall_time_s": wall, "trainer_busy_frac": busy,
         "sampler_busy_frac": 0.9, "groups_discarded_stale": disc,
         "staleness_histogram": {"0": 30, "2": 10}}
    return {**s, "control_decisions": []} if control else s

  loaded = {"async rl.control=off": [{"summary": summary(20.0, 10, 0.4, False)}],
            "async rl.control=admission": [{"summary": summary(10.0, 0, 0.8, True)}]}
  line = compare.ab_headline(loaded, ["async"])
  # off: 10 steps / 20 s = 1800 steps/h, 10 / (10 + 40) discarded, staleness 20 / 40
  assert ("rl.control=off: sampler busy 0.9 [0.9, 0.9], steps per hour 1.8e+03 [1.8e+03, 1.8e+03], "
          "trainer busy frac 0.4 [0.4, 0.4], discard rate 0.2 [0.2, 0.2], staleness 0.5 "
          "[0.5, 0.5]; rl.control=admission: sampler busy 0.9 [0.9, 0.9], steps per hour "
          "3.6e+03 [3.6e+03, 3.6e+03], trainer busy frac 0.8 [0.8, 0.8], discard rate 0 [0, 0], "
          "staleness 0.5 [0.5, 0.5]") in line


def test_ab_values_that_are_paths_stay_inside_the_workdir(tmp_path):
  from rl_jax import compare
  arms = compare.arms(os.path.join(ROOT, "configs/default.py"), str(tmp_path), seeds=1,
                      modes="async", ab="model.path=/ckpt/a,../b", overrides=[])
  dirs = [runs[0][0] for runs in arms.values()]
  assert dirs == [str(tmp_path / "_ckpt_a" / "async"), str(tmp_path / "_b" / "async")]
  assert [runs[0][1][-1] for runs in arms.values()] == ["--config.model.path=/ckpt/a",
                                                        "--config.model.path=../b"]
  with pytest.raises(report.ReportError, match="would share the run directory '_ckpt_a'"):
    compare.arms(os.path.join(ROOT, "configs/default.py"), str(tmp_path), seeds=1,
                 modes="async", ab="model.path=/ckpt/a,_ckpt/a", overrides=[])

"""Report helpers: time to target, final reward, and the HTML page from run workdirs."""
import json
import os

import pytest

from rl_jax import report


def _workdir(tmp_path, name, curve, hist):
  d = tmp_path / name
  d.mkdir()
  summary = {"mode": name, "heldout_curve": curve, "staleness_histogram": hist,
             "rollouts_discarded_stale": 3, "wall_time_s": curve[-1][0],
             "timeline": {"sampler": [[0.0, 1.0], [2.0, 3.0]], "trainer": [[1.0, 2.0]]}}
  (d / "summary.json").write_text(json.dumps(summary))
  rows = [{"step": i, "time_s": float(i), "queue/depth": i % 3, "queue/inflight_groups": 2,
           "lengths/p50": 4.0, "lengths/p95": 9.0, "lengths/p99": 12.0} for i in range(1, 5)]
  (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  return str(d)


def test_time_to_target_and_final_reward():
  curve = [[0.0, 0, 0.2], [10.0, 10, 0.5], [20.0, 20, 0.4], [30.0, 30, 0.6]]
  assert report.time_to_target(curve, 0.5) == 10.0
  assert report.time_to_target(curve, 0.55) == 30.0
  assert report.time_to_target(curve, 0.7) is None
  assert report.final_reward(curve) == pytest.approx((0.5 + 0.4 + 0.6) / 3)


def test_compare_headline_time_to_target_and_the_common_level():
  sync = {"heldout_curve": [[0.0, 0, 0.2], [30.0, 10, 0.5], [60.0, 20, 0.6], [90.0, 30, 0.7]]}
  fast = {"heldout_curve": [[0.0, 0, 0.2], [10.0, 10, 0.55], [20.0, 20, 0.62], [30.0, 30, 0.7]]}
  line = report.compare_headline(sync, fast)
  # target = (0.5 + 0.6 + 0.7) / 3 = 0.6: sync's first evaluation >= 0.6 at 60 s, async's at 20 s
  assert line.startswith("time to target (held-out reward 0.600): sync 60.0s, async 20.0s, "
                         "speedup 3.00x;")
  assert "sync 0.600 vs async 0.623" in line
  # Async ends under sync's final 0.6 (its last 3: 0.45, 0.5, 0.58 -> 0.51): the common
  # level is async's final; sync first reaches 0.51 at 60 s (0.5 at 30 s is under it),
  # async at 30 s (0.58).
  low = {"heldout_curve": [[0.0, 0, 0.2], [10.0, 10, 0.45], [20.0, 20, 0.5], [30.0, 30, 0.58]]}
  line = report.compare_headline(sync, low)
  assert line == ("async never reached sync's final held-out reward 0.600 (async's final 0.510, "
                  "both the mean of the last 3 evaluations); time to async's final: sync 60.0s, "
                  "async 30.0s, speedup 2.00x")


def test_html_report_from_workdirs(tmp_path):
  sync = _workdir(tmp_path, "sync", [[0.0, 0, 0.2], [30.0, 10, 0.5]], {"0": 40})
  async_ = _workdir(tmp_path, "async", [[0.0, 0, 0.2], [10.0, 10, 0.5]], {"0": 10, "2": 30})
  runs = [report.load_run(sync), report.load_run(async_)]
  path = report.write_html(runs, str(tmp_path / "out"), headline="speedup 3.00x")
  page = open(path).read()
  assert "speedup 3.00x" in page and "<th>sync</th>" in page and "<th>async</th>" in page
  for png in ("heldout_vs_time.png", "staleness_hist.png", "queue_busy.png", "lengths.png"):
    assert os.path.getsize(tmp_path / "out" / png) > 1000
    assert png in page
  with pytest.raises(report.ReportError, match="summary.json does not exist"):
    report.load_run(str(tmp_path))


def test_html_report_shows_tool_use(tmp_path):
  d = _workdir(tmp_path, "async", [[0.0, 0, 0.2], [10.0, 10, 0.5]], {"0": 10})
  summary = json.load(open(os.path.join(d, "summary.json")))
  summary.update(heldout_tool_call_rate_curve=[[0.0, 0, 0.3], [10.0, 10, 0.9]],
                 heldout_tool_call_rate_initial=0.3, heldout_tool_call_rate_final=0.9,
                 tool_call_rate=0.75, tool_latency_p99_s=1.25)
  open(os.path.join(d, "summary.json"), "w").write(json.dumps(summary))
  rows = [{"step": i, "time_s": float(i), "latency/tool_p50": 0.1 * i, "latency/tool_p95": 0.2 * i,
           "latency/tool_p99": 0.3 * i} for i in range(1, 4)]
  open(os.path.join(d, "metrics.jsonl"), "w").write("\n".join(json.dumps(r) for r in rows))
  page = open(report.write_html([report.load_run(d)], str(tmp_path / "out"))).read()
  assert "<td>heldout_tool_call_rate_final</td><td>0.9</td>" in page
  assert "<td>tool_latency_p99_s</td><td>1.25</td>" in page
  assert "tool_use.png" in page and os.path.getsize(tmp_path / "out" / "tool_use.png") > 1000


def test_html_report_shows_live_control(tmp_path):
  d = _workdir(tmp_path, "async", [[0.0, 0, 0.2], [10.0, 10, 0.5]], {"0": 10})
  summary = json.load(open(os.path.join(d, "summary.json")))
  summary.update(control_decisions=[{"step": 2}, {"step": 4}],
                 control_advice=[{"step": 4, "overrides": ["--config.rl.group_size=8"]}],
                 control_error_mean={"steps_per_hour": 0.125, "queue_depth_mean": 0.5,
                                     "staleness_mean": 0.25})
  open(os.path.join(d, "summary.json"), "w").write(json.dumps(summary))
  rows = [{"step": i, "time_s": float(i), "control/admission_bound": 24 - 2 * i,
           "control/decode_slots": 64} for i in range(1, 5)]
  for r, pred, meas, err in ((rows[1], 100.0, 90.0, None), (rows[3], 110.0, 105.0, -0.05)):
    r.update({"control/predicted_steps_per_hour": pred, "control/measured_steps_per_hour": meas})
    if err is not None:
      r.update({"control/steps_per_hour_error": err, "control/queue_depth_error": 0.5,
                "control/staleness_error": 0.25})
  open(os.path.join(d, "metrics.jsonl"), "w").write("\n".join(json.dumps(r) for r in rows))
  page = open(report.write_html([report.load_run(d)], str(tmp_path / "out"))).read()
  assert "<td>control_decisions</td><td>2</td>" in page
  assert "<td>control_steps_per_hour_error</td><td>0.125</td>" in page
  assert "<td>control_advice</td><td>step 4: --config.rl.group_size=8</td>" in page
  assert "control.png" in page and os.path.getsize(tmp_path / "out" / "control.png") > 1000


def test_heldout_plot_alone_as_png_or_svg(tmp_path):
  sync = _workdir(tmp_path, "sync", [[0.0, 0, 0.2], [30.0, 10, 0.5]], {"0": 40})
  async_ = _workdir(tmp_path, "async", [[0.0, 0, 0.2], [10.0, 10, 0.5]], {"0": 10, "2": 30})
  runs = [report.load_run(sync), report.load_run(async_)]
  png = report.plot_heldout(runs, str(tmp_path / "docs" / "x.png"), note="speedup 3.00x")
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  svg = open(report.plot_heldout(runs, str(tmp_path / "x.svg"), title="default")).read()
  assert "<svg" in svg and "sync" in svg and "async" in svg and "default" in svg
  with pytest.raises(report.ReportError, match=r"--plot .*x\.pdf.*\.png or \.svg"):
    report.plot_heldout(runs, str(tmp_path / "x.pdf"))


def test_pipeline_windows_from_cumulative_columns():
  # Steps 0..4, 2 s per step; the trainer busy 1 s per step (busy_frac = 0.5 throughout);
  # 3 groups accepted and, from step 3 on, 1 discarded per step.
  rows = [{"step": s, "time_s": 2.0 * s, "trainer/busy_frac": 0.5,
           "staleness/accepted": 3 * s, "staleness/discarded": max(s - 2, 0),
           "staleness/mean": 0.25 * s} for s in range(5)]
  w = report.pipeline_windows(rows, every=2)
  assert list(w["time_s"]) == [4.0, 8.0]
  assert list(w["steps_per_hour"]) == [1800.0, 1800.0]
  assert list(w["trainer_busy_frac"]) == [0.5, 0.5]
  assert list(w["discard_rate"]) == [0.0, pytest.approx(2 / 8)]
  assert list(w["staleness"]) == [pytest.approx(0.375), pytest.approx(0.875)]

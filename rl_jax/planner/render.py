"""Text tables and the PNG of a Plan, and the validation table."""
from __future__ import annotations

import os

from rl_jax.planner.capacity import Plan

GIB = 2**30


def _row(rank, c) -> str:
  p = c.prediction
  mem = (f"{c.memory.sampler_bytes / GIB:6.1f}/{c.memory.trainer_bytes / GIB:<6.1f}"
         if c.memory else " " * 13)
  head = f"{rank:>4} {c.layout.label:>8} {c.max_staleness:>5} {c.max_inflight_groups:>5}"
  if p is None:
    return f"{head} {'-':>10} {'-':>8} {'':>29} {'':>14} {mem}  rejected: {c.rejected}"
  status = f"{c.diagnosis}; rejected: {c.rejected}" if c.rejected else c.diagnosis
  return (f"{head} {p.trained_rollouts_per_hour:>10.4g} {p.steps_per_hour:>8.4g} "
          f"{p.sampler_busy_frac:>5.2f} {p.trainer_busy_frac:>5.2f} {p.verifier_busy_frac:>5.2f} "
          f"{p.queue_depth_mean:>5.1f}/{p.queue_depth_max:<3d} {p.staleness_mean:>5.2f} "
          f"{p.rollout_age_mean_s:>7.3g} {100 * p.discard_rate:>5.1f} {mem}  {status}")


def format_plan(plan: Plan) -> str:
  """Ranked table (accepted first), recommendation and sensitivity, as text."""
  lines = [f"capacity plan: {plan.devices} devices, {plan.mode} mode"]
  lines += [f"  note: {n}" for n in plan.notes]
  lines.append(f"{'rank':>4} {'layout':>8} {'stale':>5} {'infl':>5} {'useful/h':>10} "
               f"{'steps/h':>8} {'samp':>5} {'train':>5} {'verif':>5} {'queue':>9} "
               f"{'stal':>5} {'age_s':>7} {'disc%':>5} {'mem GiB s/t':>13}  status")
  rank = 0
  for c in plan.candidates:
    rank += 0 if c.rejected else 1
    mark = "*" if c is plan.recommended else ""
    lines.append(_row(f"{mark}{rank}" if not c.rejected else "-", c))
  best = plan.recommended
  if best is None:
    lines.append("no layout passes the memory and staleness checks; when discards reject them, "
                 "a lower --sweep-inflight (e.g. groups_per_step) or a larger "
                 "--sweep-staleness may pass")
    return "\n".join(lines)
  p = best.prediction
  lines.append(f"recommended: {best.layout.label} (max_staleness {best.max_staleness}, "
               f"max_inflight_groups {best.max_inflight_groups}): "
               f"{p.trained_rollouts_per_hour:.4g} useful rollouts/h, "
               f"{p.steps_per_hour:.4g} steps/h, {best.diagnosis}")
  m = best.memory
  lines.append(f"  memory per device (GiB): sampler weights {m.sampler_weights_bytes / GIB:.2f} + "
               f"KV {m.kv_pool_bytes / GIB:.2f}; trainer state {m.trainer_state_bytes / GIB:.2f} + "
               f"activations {m.activation_bytes / GIB:.2f} (per data shard)"
               + ("; colocated: their sum" if best.layout.colocated else ""))
  hist = ", ".join(f"{k}: {100 * v / max(sum(p.staleness_histogram.values()), 1):.0f}%"
                   for k, v in p.staleness_histogram.items())
  lines.append(f"  staleness of trained groups {{{hist}}}; weight sync {100 * p.weight_sync_frac:.1f}% "
               f"of wall time; verifier wait {p.verifier_wait_mean_s:.3g}s per call; "
               f"mean active sequences {p.active_sequences_mean:.1f}")
  if best.scenario.turns is not None:
    lines.append(f"  tool use: {best.scenario.turns.mean_turns:.2g} turns per episode; mean "
                 f"parked sequences {p.parked_mean:.1f} (KV held, slot free); tool pool "
                 f"busy {100 * p.tool_busy_frac:.0f}%")
  if p.groups_filtered:
    lines.append(f"  dynamic sampling: {100 * best.scenario.uniform_rate:.0f}% of groups "
                 f"uniform, {p.groups_filtered} filtered; {p.sampled_per_trained:.2f} groups "
                 f"sampled per group trained")
  for s in plan.sensitivity:
    c = s["candidate"]
    if c.prediction is None:
      detail = f"rejected ({c.rejected})"
    else:
      q = c.prediction
      detail = (f"{q.trained_rollouts_per_hour:.4g} useful rollouts/h ({100 * s['change']:+.0f}%), "
                f"staleness {q.staleness_mean:.2f}, discards {100 * q.discard_rate:.1f}%, "
                f"{c.diagnosis}" + (f", rejected: {c.rejected}" if c.rejected else ""))
    lines.append(f"  if {s['case']}: {detail}; best split then {s['best_layout']}")
  return "\n".join(lines)


def format_validation(rows: list[dict]) -> str:
  """metric, predicted, observed, relative error; the 20% target marked per line."""
  lines = [f"{'metric':<20} {'predicted':>11} {'observed':>11} {'rel err':>8}"]
  for r in rows:
    err = r["rel_err"]
    text = "n/a" if err is None else f"{100 * err:+.1f}%"
    flag = "" if err is None or abs(err) <= 0.2 else "  > 20%"
    lines.append(f"{r['metric']:<20} {r['predicted']:>11.4g} {r['observed']:>11.4g} "
                 f"{text:>8}{flag}")
  return "\n".join(lines)


def plot_plan(plan: Plan, path: str) -> str:
  """Useful rollouts/h (top) and mean staleness (bottom) by split, one line per
  (max_staleness, in-flight) setting; x marks rejected, the star the recommendation."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  order = sorted({c.layout for c in plan.candidates}, key=lambda l: (l.colocated, l.sampler_devices))
  x = {lay.label: i for i, lay in enumerate(order)}
  fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
  settings = sorted({(c.max_staleness, c.max_inflight_groups) for c in plan.candidates})
  for st, inf in settings:
    group = sorted((c for c in plan.candidates if (c.max_staleness, c.max_inflight_groups) == (st, inf)
                    and c.prediction is not None), key=lambda c: x[c.layout.label])
    if not group:
      continue
    xs = [x[c.layout.label] for c in group]
    line, = ax1.plot(xs, [c.useful_per_hour for c in group], "-o",
                     label=f"max_staleness {st}, in-flight {inf}")
    ax2.plot(xs, [c.prediction.staleness_mean for c in group], "-o", color=line.get_color())
    bad = [c for c in group if c.rejected]
    ax1.plot([x[c.layout.label] for c in bad], [c.useful_per_hour for c in bad], "x",
             color="red", markersize=10)
  best = plan.recommended
  if best is not None:
    ax1.plot([x[best.layout.label]], [best.useful_per_hour], "*", color="gold",
             markeredgecolor="black", markersize=18, label=f"recommended {best.layout.label}")
    ax2.plot([x[best.layout.label]], [best.prediction.staleness_mean], "*", color="gold",
             markeredgecolor="black", markersize=18)
  ax1.set_ylabel("useful trained rollouts / h")
  ax1.set_title(f"{plan.devices} devices, {plan.mode}: predicted throughput by split (x: rejected)")
  ax1.legend(fontsize=8)
  ax2.set_ylabel("mean staleness (versions)")
  ax2.set_xticks(range(len(order)), [lay.label for lay in order])
  ax2.set_xlabel("sampler devices s / trainer devices t")
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path

"""What the planner's simulation (rl_jax.planner.simulate) reports: a metrics row per
optimizer step with rl_jax.orchestration.loop's names (so one steady-state estimator and
one profile fit read a simulated run and a pilot's metrics.jsonl alike), and the run's
`Prediction`. `Report` is a mixin of the simulation's `_Sim`: it reads the state the
simulation keeps (queue, active sequences, busy seconds, counters) and only writes the
integrals and rows it owns (q_area, parked_area, active_area, last_change, rows,
last_row and the per-row samples)."""
from __future__ import annotations

import numpy as np

from rl_jax.planner.prediction import Prediction


class Report:
  """Rows and the Prediction of a _Sim (module docstring)."""

  def _note_change(self, now: float) -> None:
    """Integrates queue depth and active sequences up to `now`."""
    dt = now - self.last_change
    self.q_area += len(self.queue) * dt
    self.parked_area += self.parked * dt
    self.active_area += len(self.rem) * (dt if self.segment is not None else 0.0)
    self.last_change = now

  def _write_row(self, now: float, published_s: float) -> None:
    """The row of the optimizer step that ended at `now` (published_s: its publication)."""
    self._note_change(now)
    t_prev, samp_prev, train_prev = self.last_row
    dt = max(now - t_prev, 1e-12)
    busy_s = self.sampler_busy_s + (now - self.segment.t0 if self.segment else 0.0)
    lengths = np.asarray(self.row_lengths or [0])
    service = np.asarray(self.row_service_s or [0.0])
    latency = np.asarray(self.row_latency_s or [0.0])
    self.rows.append({
        "step": self.step, "time_s": now,
        "sampler/tokens_per_s": (self.sampler_tokens - samp_prev) / dt,
        "sampler/busy_frac": busy_s / now,
        "trainer/padded_tokens": self.trainer_tokens - train_prev,
        "trainer/busy_frac": self.trainer_busy_s / now,
        "queue/depth": len(self.queue), "queue/inflight_groups": self.inflight,
        "staleness/mean": float(np.mean(self.batch_staleness)),
        "staleness/max": int(np.max(self.batch_staleness)),
        "staleness/discarded": self.discarded_groups,
        "staleness/accepted": self.accepted_groups,
        "data/groups_filtered_zero_variance": self.filtered,
        "weight_sync/duration_s": published_s,
        "weight_sync/version": self.version,
        "sampler/active_slots": len(self.rem),
        "sampler/parked": self.parked,
        "sampler/generate_calls": self.decode_steps // self.sc.steps_per_call,
        "trainer/step_time_s": self.train_s,
        **{f"lengths/p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 95, 99)},
        "lengths/truncation_rate": float(np.mean(lengths >= self.sc.lengths.max_tokens)),
        **{f"latency/verifier_p{q}": float(np.percentile(latency, q)) for q in (50, 95, 99)},
        **{f"latency/verifier_service_p{q}": float(np.percentile(service, q))
           for q in (50, 95, 99)},
    })
    self.last_row = (now, self.sampler_tokens, self.trainer_tokens)
    self.row_lengths, self.row_service_s, self.row_latency_s = [], [], []

  def _prediction(self, wall: float) -> Prediction:
    """The Prediction of a run that ended at pipeline time `wall`."""
    sc = self.sc
    self._note_change(wall)
    sampler_busy = self.sampler_busy_s + (wall - self.segment.t0 if self.segment else 0.0)
    consumed = self.discarded_groups + self.accepted_groups
    hours = wall / 3600
    return Prediction(
        wall_s=wall, optimizer_steps=self.step, steps_per_hour=self.step / hours,
        rollouts_generated=self.generated, rollouts_trained=self.trained,
        rollouts_discarded=self.discarded_groups * sc.group_size,
        trained_rollouts_per_hour=self.trained / hours,
        generated_rollouts_per_hour=self.generated / hours,
        discard_rate=self.discarded_groups / max(consumed, 1),
        sampler_busy_frac=sampler_busy / wall,
        trainer_busy_frac=self.trainer_busy_s / wall,
        verifier_busy_frac=self.pool.service_total_s / (sc.verifier.workers * wall),
        verifier_wait_mean_s=self.pool.mean_wait_s,
        queue_depth_mean=self.q_area / wall, queue_depth_max=self.q_max,
        rollout_age_mean_s=self.age_total_s / max(self.accepted_groups, 1),
        staleness_mean=(sum(k * v for k, v in self.hist.items()) /
                        max(sum(self.hist.values()), 1)),
        staleness_histogram=dict(sorted(self.hist.items())),
        active_sequences_mean=self.active_area / wall,
        sampler_tokens_per_s=self.sampler_tokens / wall,
        trainer_padded_tokens_per_s=self.trainer_tokens / wall,
        weight_sync_frac=self.sync_busy_s / wall,
        rows=self.rows, parked_mean=self.parked_area / wall,
        tool_busy_frac=(self.tools.service_total_s / (sc.turns.tool.workers * wall)
                        if self.tools is not None else 0.0),
        groups_filtered=self.filtered,
        sampled_per_trained=self.next_gid / max(self.accepted_groups, 1))


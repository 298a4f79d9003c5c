"""Discrete-event simulation of the sync / async GRPO pipeline of rl_jax.orchestration.loop.

Events live on a heapq ordered by time; all draws come from one seeded numpy Generator,
so a Scenario always gives the same Prediction. What is simulated, as loop.py does it:

  admission   the sampler admits a group (G sequences) at a generate-call boundary while
              its slots have room (active + pending < slots) and the StalenessPolicy
              (rl_jax/orchestration/policy.py, the object the run loop asks) allows it:
              can_admit over in-flight, queued and held groups (held: dequeued by the
              trainer, not yet released, as RolloutQueue.held) and, in sync mode,
              barrier_allows (groups_per_step groups per optimizer step, only once the
              sampler holds the trainer's current version).
  sampling    continuous batching: sequences start when a slot frees, each decode step
              emits one token per active sequence and takes SamplerModel.step_s(n, ctx);
              the host sees the engine only between generate calls of steps_per_call
              steps (a sequence that ends inside a call holds its slot to the call's end).
              Between two events the active set is fixed, so k steps take
                T(k) = k * A + g * k (k - 1) / 2,
                A = base + per_seq n / R + per_ctx ctx / R,  g = per_ctx n / R
              (every step adds n context tokens), and the simulation jumps straight to the
              call boundary of the next completion instead of stepping token by token.
  versions    a sequence's behaviour version is the sampler's version at its first token;
              with inflight_weight_updates later tokens carry newer versions, which does
              not change min(token_versions). A publication reaches the sampler at its next
              call boundary; without inflight updates the sampler neither admits nor starts
              sequences until its running ones drain, then swaps (rl_jax.sampler.generator).
              An idle sampler swaps at once.
  verifying   a finished rollout joins the verifier pool (workers servers, FIFO: its
              finish time is known when it arrives, ServerPool); a group enters the
              queue when all G rollouts are verified, one event at the last finish.
  filtering   with Scenario.uniform_rate > 0 a verified group's rewards are all equal with
              that probability; StalenessPolicy.filters (the run's rule and per-step
              budget) decides whether it is filtered: not queued, its credit returned at
              once, and in sync mode replaced (at the same version) once the round's
              groups are all verified. The trainer's batch is the informative groups.
  training    the trainer takes groups in the policy's order (arrival, or the oldest
              version first: StalenessPolicy.next_index), discards those the policy does
              not accept (staleness = trainer_version - min version > bound), trains on
              groups_per_step accepted groups for TrainerModel.step_s(padded tokens), then,
              when the policy publishes after that step, bumps the version and publishes
              for weight_sync_s (trainer busy throughout); held groups are released when
              the policy releases credit. The first step at each padded batch shape also
              pays TrainerModel.compile_s (XLA compiles per shape). After each step the
              trainer takes no batch for TrainerModel.loop_s (the loop's host work
              between steps; not busy).
  colocated   one device set: a full batch starts training at the sampler's next step
              boundary, and the sampler stays paused while the trainer trains and publishes.
  tool use    with Scenario.turns (a TurnModel), a rollout's model tokens split into K
              decode segments; after each but the last the sequence leaves its slot (the
              slot takes other work at once) and waits for a tool call in the tool pool
              (its own servers and FIFO line, like the verifier's); then it queues for a
              slot again ahead of new samples, its first step prefilling the observation
              tokens. A parked sequence keeps its KV pages: admission also requires
              active + waiting + parked sequences < max_live_sequences (what the KV pool
              holds; 0 = no limit beyond the slots).
  contention  split layouts whose roles still share compute (rl_jax.planner.contention):
              while the trainer trains or publishes, decode work progresses at
              sampler_share of its alone speed; while the sampler decodes, train work
              progresses at trainer_share. Both are 1 on independent devices.

Per optimizer step the simulation writes a row (rl_jax.planner.sim_report) with loop.py's
metric names (time_s, queue/depth, staleness/mean, sampler/busy_frac, trainer/busy_frac,
lengths/p50, ...),
plus sampler/generate_calls (cumulative), trainer/step_time_s, trainer/padded_tokens and
latency/verifier_service_p* (verifier time without pool queueing), so the same
steady-state estimator and profile fit read a simulated run and a pilot's metrics.jsonl.
"""
from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from rl_jax.planner.prediction import Prediction, diagnose
from rl_jax.planner.queueing import EventQueue, Progress, Segment, ServerPool
from rl_jax.planner.scenario import Scenario
from rl_jax.planner.sim_report import Report
from rl_jax.trainer.buckets import pick_bucket


@dataclasses.dataclass
class _Group:
  admitted: float
  lengths: np.ndarray  # completion tokens of each rollout (observations included)
  min_version: float = math.inf
  submitted: int = 0  # rollouts handed to the verifier pool
  ready: float = 0.0  # when the last of them is verified
  prefilled: bool = False  # its prompt went through a pass's prefill lane


LENGTH_BLOCK = 64  # groups whose lengths are drawn at once (_Sim._lengths)


class _Sim(Report):
  """One run of a Scenario; `run()` returns its Prediction."""

  def __init__(self, sc: Scenario):
    if sc.mode not in ("sync", "async"):
      raise ValueError(f"mode must be sync or async, got {sc.mode!r}")
    probe = sc.sampler.step_s(active=1, context_tokens=sc.prompt_tokens, replicas=sc.sampler_replicas)
    if not probe > 0:
      raise ValueError(f"sampler step time must be > 0, got {probe} from {sc.sampler}")
    self.sc = sc
    self.rng = np.random.default_rng(sc.seed)
    self.events = EventQueue()
    self.policy = sc.policy
    self.pool = ServerPool(sc.verifier.workers)
    # Sampler state: parallel arrays over active sequences (and the segments each has
    # left after its current one), then the resumed and pending lines; a line entry is
    # (group, segment tokens, context, later segments, tokens its start prefills).
    self.rem = np.zeros(0, np.int64)  # decode steps until the slot frees (tokens + lag)
    self.tok = np.zeros(0, np.int64)  # tokens still to emit
    self.ctx = np.zeros(0, np.int64)
    self.gid = np.zeros(0, np.int64)
    self.rest: list[tuple[int, ...]] = []
    self.pending: collections.deque = collections.deque()
    self.resumed: collections.deque = collections.deque()
    self.parked = 0  # waiting for a tool call
    self.tools = ServerPool(sc.turns.tool.workers) if sc.turns is not None else None
    self.segment: Segment | None = None
    self.token = 0
    self.held = False  # colocated: paused while the trainer runs
    self.step_waiting = False  # colocated: a full batch waits for the current decode step
    self.sampler_version = 0
    self.pending_version: int | None = None
    self.admitted = 0  # groups admitted so far
    self.groups: dict[int, _Group] = {}
    self._len_block, self._len_step, self._len_at = np.zeros(0, np.int64), -1, 0
    self.next_gid = 0
    self.inflight = 0
    self.queue: collections.deque = collections.deque()
    # Dequeued by the trainer and not yet released (RolloutQueue.held): they count
    # against max_inflight_groups until their step is trained and, in async mode, its
    # version published.
    self.trainer_held = 0
    # Trainer state.
    self.version = 0
    self.step = 0
    self.batch: list[_Group] = []
    self.batch_staleness: list[int] = []
    self.trainer_busy = False
    self.between = False  # in TrainerModel.loop_s after a step: takes no batch
    # The train step or publication in progress (alone seconds at a contention rate),
    # what its end event is, and that event's token (older ones are stale).
    self.job: Progress | None = None
    self.job_end: tuple[str, object] = ("", None)
    self.job_token = 0
    self.train_start = 0.0
    self.train_s = 0.0
    self.done = False
    # Accounting.
    self.sampler_busy_s = self.trainer_busy_s = self.sync_busy_s = 0.0
    self.sampler_tokens = self.trainer_tokens = 0
    self.generated = self.trained = 0  # rollouts
    self.discarded_groups = self.accepted_groups = 0
    self.age_total_s = 0.0
    self.hist: collections.Counter = collections.Counter()
    self.q_area = 0.0
    self.q_max = 0
    self.active_area = 0.0
    self.parked_area = 0.0
    self.last_change = 0.0
    self.rows: list[dict] = []
    self.last_row = (0.0, 0, 0)
    # Since the last row, for the percentiles loop.py logs.
    self.row_lengths: list[int] = []
    self.row_service_s: list[float] = []
    self.row_latency_s: list[float] = []
    self.decode_steps = 0
    self.shapes: set[int] = set()  # train-step batch shapes compiled so far
    self.filtered = 0  # groups filtered for zero reward variance
    self.filter_window = [0, 0]  # optimizer steps done, groups filtered filling that step
    self.to_replace = 0  # sync: filtered groups of the round, replaced once it is verified

  # -- sampler ---------------------------------------------------------------------

  def _can_admit(self) -> bool:
    sc = self.sc
    waiting = len(self.rem) + len(self.pending) + len(self.resumed)
    if waiting >= sc.decode_slots or (sc.max_live_sequences and
                                      waiting + self.parked >= sc.max_live_sequences):
      return False
    if not self.policy.can_admit(inflight=self.inflight, queued=len(self.queue),
                                 held=self.trainer_held):
      return False
    if self.pending_version is not None and not sc.inflight_weight_updates:
      return False  # draining for a weight swap
    return self.policy.barrier_allows(admitted=self.admitted, steps_done=self.step,
                                      sampler_version=self.sampler_version,
                                      trainer_version=self.version)

  def _admit(self, now: float) -> None:
    if self.to_replace and self.inflight == 0:  # the round is verified (sample_worker.admit)
      self.admitted -= self.to_replace
      self.to_replace = 0
    while self._can_admit():
      self._admit_one(now)

  def _admit_one(self, now: float) -> int:
    sc = self.sc
    self.admitted += 1
    gid = self.next_gid
    self.next_gid += 1
    lengths = self._lengths()
    if sc.turns is None:
      plans = [(int(n),) for n in lengths]
    else:
      plans = [tuple(sc.turns.segments(n, k, sc.lengths.max_tokens))
               for n, k in zip(lengths, sc.turns.sample(self.rng, sc.group_size))]
    obs = sc.turns.observation_tokens if sc.turns is not None else 0
    completion = np.asarray([sum(p) + obs * (len(p) - 1) for p in plans], np.int64)
    self.groups[gid] = _Group(admitted=now, lengths=completion)
    self.inflight += 1
    self.pending.extend((gid, p[0], sc.prompt_tokens, p[1:], sc.prompt_tokens) for p in plans)
    return gid

  def _lengths(self) -> np.ndarray:
    """A new group's completion lengths at the current step: from a block of
    LENGTH_BLOCK groups' draws made at this step (one draw per group costs more than the
    rest of its admission)."""
    g = self.sc.group_size
    if self._len_step != self.step or self._len_at + g > len(self._len_block):
      self._len_block = self.sc.lengths.sample(self.rng, g * LENGTH_BLOCK, step=self.step)
      self._len_step, self._len_at = self.step, 0
    self._len_at += g
    return self._len_block[self._len_at - g:self._len_at]

  def _boundary(self, now: float, steps: int) -> None:
    """The sampler reached a call boundary after `steps` decode steps of its segment."""
    self._sampler_boundary(now, steps)
    self._retime(now)

  def _sampler_boundary(self, now: float, steps: int) -> None:
    sc = self.sc
    self._note_change(now)
    seg, self.segment = self.segment, None
    if seg is not None:
      self.sampler_busy_s += now - seg.t0
      took = np.minimum(self.tok, steps)
      self.rem = self.rem - np.minimum(self.rem, steps)
      self.tok = self.tok - took
      self.ctx = self.ctx + took
      self.sampler_tokens += int(took.sum())
      self.decode_steps += steps
      done = self.rem == 0
      if done.any():
        idx = np.flatnonzero(done)
        if sc.turns is not None:  # a segment with others after it ends in a tool call
          calls = np.asarray([bool(self.rest[i]) for i in idx], bool)
          for i in idx[calls]:
            self._park(now, (int(self.gid[i]), int(self.ctx[i]), self.rest[i]))
          idx = idx[~calls]
        if len(idx):
          self.row_lengths.extend((self.ctx[idx] - sc.prompt_tokens).tolist())
          self._rollouts_finished(now, self.gid[idx].tolist())
        keep = ~done
        self.rem, self.tok = self.rem[keep], self.tok[keep]
        self.ctx, self.gid = self.ctx[keep], self.gid[keep]
        self.rest = [r for r, k in zip(self.rest, keep) if k]
    if self.pending_version is not None and (sc.inflight_weight_updates or len(self.rem) == 0):
      self.sampler_version, self.pending_version = self.pending_version, None
    draining = self.pending_version is not None
    if self.step_waiting:
      self.step_waiting = False
      self._start_step(now)
    if self.held or self.done:
      return
    self._admit(now)
    free = 0 if draining else sc.decode_slots - len(self.rem)
    starting, lane_blocked = [], False
    lane_left = sc.prefill_lane_tokens
    for line in (self.resumed, self.pending):  # resumed sequences first (older work)
      while line and len(starting) < free:
        group = self.groups[line[0][0]]
        if line is self.pending and sc.prefill_lane_tokens and not group.prefilled:
          # The generator prefills a pass's new prompts in its prefill lane; one that
          # misses the lane waits for the next pass (first come, first served).
          cached = max(int(sc.prompt_tokens) - 1, 0)
          if lane_left < cached <= sc.prefill_lane_tokens:
            lane_blocked = True
            break
          group.prefilled = True
          lane_left -= cached if cached <= lane_left else 0
        starting.append(line.popleft())
    for g, *_ in starting:
      group = self.groups[g]
      group.min_version = min(group.min_version, self.sampler_version)
    if starting:
      g, n, ctx, rest, _ = zip(*starting)
      self.rem = np.concatenate([self.rem, np.asarray(n, np.int64) + sc.pipeline_lag_steps])
      self.tok = np.concatenate([self.tok, n])
      self.ctx = np.concatenate([self.ctx, ctx])
      self.gid = np.concatenate([self.gid, g])
      self.rest.extend(rest)
    if len(self.rem) == 0:
      return
    n, r, m = len(self.rem), sc.sampler_replicas, sc.sampler
    a_s = m.base_s + m.per_seq_s * n / r + m.per_ctx_token_s * float(self.ctx.sum()) / r
    self.segment = Segment(
        t0=now, prefill_s=m.prefill_per_token_s * sum(e[4] for e in starting) / r,
        # a prompt waiting for the next pass's lane ends the segment after one call
        steps=self._call_boundary(1 if lane_blocked else int(self.rem.min())), a_s=a_s,
        g_s=m.per_ctx_token_s * n / r,
        token=self.token, progress=Progress(now, self._sampler_rate()))
    self._push_segment()

  def _call_boundary(self, steps: int) -> int:
    """The first generate-call boundary at or after `steps` decode steps."""
    spc = self.sc.steps_per_call
    return -(-steps // spc) * spc

  def _poke(self, now: float, force: bool = False) -> None:
    """Something the sampler checks between steps changed: stop at the next boundary.

    Only worth it when the sampler could act on it (idle, or a slot is free) or when
    `force`d (colocated trainer start); otherwise the next completion is soon enough.
    """
    seg = self.segment
    if seg is None:
      if not self.held:
        self._boundary(now, 0)
      return
    if not force and len(self.rem) + len(self.pending) + len(self.resumed) >= self.sc.decode_slots:
      return
    target = min(self._call_boundary(seg.steps_done(seg.progress.work_at(now)) + 1), seg.steps)
    if target < seg.steps:
      seg.steps = target
      self._push_segment()

  def _push_segment(self) -> None:
    """(Re)schedules the end of the current segment; earlier events become stale."""
    seg = self.segment
    self.token += 1
    seg.token = self.token
    self.events.push(seg.progress.time_of(seg.duration(seg.steps)), "sampler",
                     (self.token, seg.steps))

  # -- contention ----------------------------------------------------------------------

  def _sampler_rate(self) -> float:
    return max(self.sc.sampler_share, 0.01) if self.job is not None else 1.0

  def _trainer_rate(self) -> float:
    return max(self.sc.trainer_share, 0.01) if self.segment is not None else 1.0

  def _retime(self, now: float) -> None:
    """After either role started or stopped: each role's speed under contention
    (Scenario.sampler_share / trainer_share), its pending end event moved to match."""
    seg, job = self.segment, self.job
    if seg is not None and seg.progress.rate != self._sampler_rate():
      seg.progress.set_rate(now, self._sampler_rate())
      self._push_segment()
    if job is not None and job.rate != self._trainer_rate():
      job.set_rate(now, self._trainer_rate())
      self._push_job()

  def _start_job(self, now: float, work_s: float, kind: str, payload=None) -> None:
    self.job = Progress(now, self._trainer_rate(), work_s=work_s)
    self.job_end = (kind, payload)
    self._push_job()
    self._retime(now)

  def _push_job(self) -> None:
    self.job_token += 1
    self.events.push(self.job.time_of(self.job.work_s), "job", self.job_token)

  # -- tool calls --------------------------------------------------------------------

  def _park(self, now: float, item: tuple) -> None:
    """A segment ended in a tool call: the sequence leaves its slot and waits for it."""
    self.parked += 1
    self.events.push(self.tools.arrive(now, self.sc.turns.tool.service_s(self.rng)), "tool",
                     item)

  def _tool_done(self, now: float, item: tuple) -> None:
    self._note_change(now)
    self.parked -= 1
    gid, ctx, rest = item
    obs = self.sc.turns.observation_tokens
    self.resumed.append((gid, rest[0], ctx + obs, rest[1:], obs))
    self._poke(now)

  # -- verifier and queue ------------------------------------------------------------

  def _rollouts_finished(self, now: float, gids: list[int]) -> None:
    """Rollouts that finished decoding join the verifier pool, in order; a group's
    "verified" event is at the finish of its last one (ServerPool knows it at arrival)."""
    self.generated += len(gids)
    service = self.sc.verifier.service_times(self.rng, len(gids)).tolist()
    self.row_service_s.extend(service)
    for gid, service_s in zip(gids, service):
      finish = self.pool.arrive(now, service_s)
      self.row_latency_s.append(finish - now)
      group = self.groups[gid]
      group.ready = max(group.ready, finish)
      group.submitted += 1
      if group.submitted == self.sc.group_size:
        self.events.push(group.ready, "verified", gid)

  def _verified(self, now: float, gid: int) -> None:
    """Every rollout of group `gid` is verified: it is queued, or filtered."""
    self._note_change(now)
    self.inflight -= 1
    if self._filters():
      del self.groups[gid]
      self._poke(now)  # admission credit returned
      return
    self.queue.append(gid)
    self.q_max = max(self.q_max, len(self.queue))
    if not self.trainer_busy and not self.between:
      self._pull(now)

  def _filters(self) -> bool:
    """Whether a verified group is filtered: uniform with Scenario.uniform_rate (drawn
    only when filtering is on and the rate > 0, so other scenarios keep their random
    stream), then the policy's rule and budget."""
    sc = self.sc
    if sc.uniform_rate <= 0 or not self.policy.filter_zero_variance:
      return False
    uniform = self.rng.random() < sc.uniform_rate
    if self.filter_window[0] != self.step:
      self.filter_window = [self.step, 0]
    rewards = [0.0] * sc.group_size if uniform else [0.0, 1.0]
    if not self.policy.filters(rewards, self.filter_window[1]):
      return False
    self.filter_window[1] += 1
    self.filtered += 1
    if self.policy.sync:
      self.to_replace += 1
    return True

  # -- trainer -----------------------------------------------------------------------

  def _pull(self, now: float) -> None:
    """Dequeues eligible groups into the batch; starts the step when it is full."""
    sc = self.sc
    took = False
    self._note_change(now)
    while self.queue and len(self.batch) < sc.groups_per_step:
      self._take(now)
      took = True
    if len(self.batch) == sc.groups_per_step:
      self.trainer_busy = True  # the batch is full: no more pulls until the step ends
      self.held = sc.colocated
      if sc.colocated and self.segment is not None:
        # The devices are mid decode step: the train step starts at its boundary.
        self.step_waiting = True
        self._poke(now, force=True)
      else:
        self._start_step(now)
    elif took:
      self._poke(now)

  def _take(self, now: float) -> bool:
    """Dequeues the next group in the policy's order into the batch (the first, or the
    first of the oldest version), or discards it as the policy says."""
    i = 0
    if self.policy.orders_by_version:
      i = self.policy.next_index([self.groups[g].min_version for g in self.queue])
    gid = self.queue[i]
    del self.queue[i]
    group = self.groups.pop(gid)
    staleness = self.version - int(group.min_version)
    if not self.policy.accepts(staleness):
      self.discarded_groups += 1
      return False
    self.accepted_groups += 1
    self.trainer_held += 1
    self.hist[staleness] += 1
    self.age_total_s += now - group.admitted
    self.batch.append(group)
    self.batch_staleness.append(staleness)
    return True

  def _start_step(self, now: float) -> None:
    sc = self.sc
    rows = -(-sc.groups_per_step * sc.group_size // sc.batch_multiple) * sc.batch_multiple
    longest = max(int(g.lengths.max()) for g in self.batch) + sc.prompt_tokens
    tokens = rows * pick_bucket(longest, sc.length_buckets)
    self.trainer_tokens += tokens
    self.trained += sc.groups_per_step * sc.group_size
    self.train_start = now
    step_s = sc.trainer.step_s(tokens=tokens, devices=sc.trainer_devices)
    if tokens not in self.shapes:  # the first step at a batch shape compiles it
      self.shapes.add(tokens)
      step_s += sc.trainer.compile_s
    self._start_job(now, step_s, "trained")

  def _trained(self, now: float) -> None:
    sc = self.sc
    self.step += 1
    if self.policy.publishes(self.step):
      self.version += 1
      self._start_job(now, sc.weight_sync_s, "published", now)
    else:
      self._step_done(now, published_s=0.0)

  def _step_done(self, now: float, published_s: float) -> None:
    self.trainer_busy = False
    self.job = None
    self._retime(now)
    self.trainer_busy_s += now - self.train_start
    self.train_s = now - self.train_start - published_s
    self.sync_busy_s += published_s
    if self.policy.publishes(self.step):
      self.pending_version = self.version
    if self.policy.releases(self.step):
      self.trainer_held = 0
    self._write_row(now, published_s)
    self.batch, self.batch_staleness = [], []
    if self.step >= self.sc.num_steps:
      self.done = True
      return
    if self.held:
      self.held = False
    self._poke(now)  # new weights, or admission room released
    if self.sc.trainer.loop_s > 0:
      self.between = True
      self.events.push(now + self.sc.trainer.loop_s, "loop", None)
    else:
      self._pull(now)

  # -- run ---------------------------------------------------------------------------

  def run(self) -> Prediction:
    sc = self.sc
    stall = self.policy.stall_reason()  # the rule config validation applies
    if stall:
      raise ValueError(f"the simulated pipeline can never publish: {stall}")
    self._boundary(0.0, 0)
    now = 0.0
    while not self.done:
      if not self.events:
        raise ValueError(
            f"the simulated pipeline stalled at step {self.step}: no work can be admitted "
            f"(max_inflight_groups {self.policy.max_inflight}, queue_maxsize {sc.queue_maxsize}, "
            f"groups_per_step {sc.groups_per_step})")
      now, kind, payload = self.events.pop()
      if kind == "sampler":
        token, steps = payload
        if token == self.token and self.segment is not None:
          self._boundary(now, steps)
      elif kind == "verified":
        self._verified(now, payload)
      elif kind == "tool":
        self._tool_done(now, payload)
      elif kind == "loop":
        self.between = False
        self._pull(now)
      elif kind == "job" and payload == self.job_token:  # a train step's or publication's end
        kind, start = self.job_end
        self.job = None
        if kind == "trained":
          self._trained(now)
        else:
          self._step_done(now, published_s=now - start)
    return self._prediction(now)

def simulate(scenario: Scenario) -> Prediction:
  """Runs `scenario` until scenario.num_steps optimizer steps (with their publication)."""
  return _Sim(scenario).run()

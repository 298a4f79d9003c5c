"""StalenessPolicy (rl_jax/orchestration/policy.py): the rules themselves, and the run
loop's pieces and the planner's simulation taking the same decisions on one event
sequence."""
import collections
import dataclasses
import os

import numpy as np
import pytest

from rl_jax import config as config_lib
from rl_jax.orchestration.policy import StalenessPolicy
from rl_jax.orchestration.rollout_queue import RolloutQueue
from rl_jax.planner.simulate import Scenario, _Sim
from rl_jax.planner.models import LengthModel, SamplerModel, TrainerModel, VerifierModel
from rl_jax.tasks.latency import Latency
from rl_jax.types import Group, Rollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rl(**kw):
  base = dict(mode="async", groups_per_step=4, max_staleness=1, max_inflight_groups=-1,
              queue_maxsize=6, weight_sync_every=1)
  base.update(kw)
  return base


def test_zero_variance_filter_and_its_budget():
  off = StalenessPolicy.make(**_rl())
  assert not off.uniform([1.0, 1.0]) and not off.filters([0.0, 0.0], 0)
  p = StalenessPolicy.make(**_rl(filter_groups="zero_variance", max_oversample=3))
  assert p.filter_budget == 8  # (3 - 1) x 4 groups per step
  assert p.uniform([0.5, 0.5, 0.5]) and not p.uniform([0.5, 0.5, 0.25])
  assert p.filters([1.0, 1.0], 7) and not p.filters([1.0, 1.0], 8)
  assert not p.filters([1.0, 0.0], 0)
  assert not StalenessPolicy.make(**_rl(filter_groups="zero_variance",
                                        max_oversample=1)).filters([1.0, 1.0], 0)


def test_rules():
  p = StalenessPolicy.make(**_rl())
  assert p.max_inflight == 8 and p.bound == 1
  assert p.accepts(1) and not p.accepts(2)
  assert p.can_admit(inflight=3, queued=2, held=2) and not p.can_admit(inflight=3, queued=2, held=3)
  assert not p.can_admit(inflight=3, queued=3, held=0)  # queue_maxsize
  assert p.publishes(3) and p.releases(3)
  s = StalenessPolicy.make(**_rl(mode="sync", weight_sync_every=2))
  assert s.max_inflight == 4 and s.bound == 0
  assert s.releases(1) and not s.publishes(1)
  assert s.barrier_allows(admitted=7, steps_done=1, sampler_version=0, trainer_version=0)
  assert not s.barrier_allows(admitted=8, steps_done=1, sampler_version=0, trainer_version=0)
  assert not s.barrier_allows(admitted=0, steps_done=0, sampler_version=0, trainer_version=1)
  assert StalenessPolicy.make(**_rl(max_inflight_groups=5)).max_inflight == 5


def test_a_bound_that_can_never_publish_is_refused_by_the_run_and_the_planner():
  """Async credit returns only at publication: the admission bound must hold the
  weight_sync_every batches trained before one (#16's hang: max_staleness=0, every 2)."""
  hang = _rl(max_staleness=0, weight_sync_every=2)
  reason = StalenessPolicy.make(**hang).stall_reason()
  assert "rl.groups_per_step x rl.weight_sync_every = 8" in reason
  assert not StalenessPolicy.make(**_rl(max_staleness=1, weight_sync_every=2)).stall_reason()
  assert not StalenessPolicy.make(**_rl(mode="sync", max_staleness=0,
                                        weight_sync_every=2)).stall_reason()
  cfg, _ = config_lib.parse_args(["--config", os.path.join(ROOT, "configs/default.py"),
                                  "--config.rl.max_staleness=0", "--config.rl.weight_sync_every=2"])
  with pytest.raises(config_lib.ConfigError, match=r"'rl.max_inflight_groups', "
                     r"'rl.max_staleness', 'rl.groups_per_step', 'rl.weight_sync_every'"):
    config_lib.validate(cfg, num_devices=8)
  with pytest.raises(ValueError, match="can never publish"):
    _Sim(_scenario(hang, num_steps=2)).run()


def test_from_config_matches_the_planner_scenario():
  from rl_jax.planner import capacity
  from rl_jax.planner.models import DEVICES
  for extra in ([], ["--config.rl.mode=sync"], ["--config.rl.max_inflight_groups=24"],
                ["--config.rl.weight_sync_every=2", "--config.rl.max_staleness=3"],
                ["--config.rl.filter_groups=zero_variance", "--config.rl.max_oversample=3"]):
    cfg, _ = config_lib.parse_args(["--config", os.path.join(ROOT, "configs/default.py"), *extra])
    model_cfg, params = capacity.model_shape(cfg)
    sc = capacity.scenario(cfg, layout=capacity.pilot_layout(cfg), profile=None,
                           model_cfg=model_cfg, params=params, device=DEVICES["h200"],
                           num_steps=3)
    assert sc.policy == StalenessPolicy.from_config(cfg.rl), extra


def _scenario(rl: dict, num_steps: int = 0) -> Scenario:
  return Scenario(
      **rl, group_size=1, inflight_weight_updates=True, num_steps=num_steps, prompt_tokens=4,
      length_buckets=(64,), batch_multiple=1,
      lengths=LengthModel(kind="lognormal", max_tokens=8, median=4, sigma=0.1),
      verifier=VerifierModel(latency=Latency(kind="none"), workers=1),
      sampler=SamplerModel(base_s=0.01, per_seq_s=0.0, per_ctx_token_s=0.0),
      sampler_replicas=1, decode_slots=10**9,
      trainer=TrainerModel(fixed_s=0.1, tokens_per_s_per_device=1e5), trainer_devices=1,
      weight_sync_s=0.0)


def _group(gid: int, version: int) -> Group:
  r = Rollout(group_id=gid, sample_index=0, prompt_tokens=np.zeros(1, np.int32),
              completion_tokens=np.zeros(2, np.int32), behavior_logprobs=np.zeros(2, np.float32),
              token_versions=np.full(2, version, np.int32))
  return Group(group_id=gid, example=None, prompt_tokens=r.prompt_tokens, rollouts=[r])


@pytest.mark.parametrize("rl", [_rl(), _rl(max_staleness=0), _rl(weight_sync_every=2),
                                _rl(mode="sync"), _rl(mode="sync", weight_sync_every=2),
                                _rl(max_inflight_groups=5, queue_maxsize=3),
                                _rl(queue_order="oldest_version"),
                                _rl(max_staleness=0, queue_order="oldest_version"),
                                _rl(mode="sync", queue_order="oldest_version")])
def test_planner_and_loop_take_the_same_decisions(rl):
  """One random sequence of admissions, verified groups, dequeues, train steps and
  sampler swaps, applied to the loop's pieces (RolloutQueue plus the loop's barrier and
  credit bookkeeping) and to the planner's simulation state: every admission, acceptance,
  publication and credit release comes out the same, and the trainer takes the same
  group (groups finish verifying out of order, so the queue's arrival order is not the
  versions' order)."""
  policy = StalenessPolicy.make(**rl)
  sim = _Sim(_scenario(rl))  # pylint: disable=protected-access
  assert sim.policy == policy
  queue = RolloutQueue(policy)
  loop = dict(admitted=0, steps=0, version=0, sampler_version=0, credit=0)
  verifying: collections.deque = collections.deque()
  batch: list[Group] = []
  rng = np.random.default_rng(0)
  decisions = collections.Counter()
  versions = {}
  for i in range(3000):
    now = float(i + 1)
    loop_admits = queue.can_admit() and policy.barrier_allows(
        admitted=loop["admitted"], steps_done=loop["steps"],
        sampler_version=loop["sampler_version"], trainer_version=loop["version"])
    assert loop_admits == sim._can_admit()
    kind = rng.integers(5)
    if kind == 0 and loop_admits:
      decisions["admit"] += 1
      queue.admitted()
      loop["admitted"] += 1
      gid = sim._admit_one(now)
      sim.groups[gid].min_version = sim.sampler_version
      versions[gid] = loop["sampler_version"]
      verifying.append((gid, loop["sampler_version"]))
    elif kind == 1 and verifying:
      verifying.rotate(-int(rng.integers(len(verifying))))
      gid, version = verifying.popleft()
      queue.put(_group(gid, version))
      sim.trainer_busy = True  # the test, not the simulation, decides when to dequeue
      sim._verified(now, gid)
    elif kind == 2 and queue.snapshot()["depth"] and len(batch) < rl["groups_per_step"]:
      before = list(sim.queue)
      group = queue.get(timeout=0)
      loop_accepts = policy.accepts(group.staleness(loop["version"]))
      if loop_accepts:
        batch.append(group)
      else:
        queue.release()
      assert sim._take(now) == loop_accepts
      assert set(before) - set(sim.queue) == {group.group_id}
      if policy.orders_by_version:  # the first group of the oldest version queued
        assert group.group_id == min(before, key=lambda g: (versions[g], before.index(g)))
      else:
        assert group.group_id == before[0]
      decisions["out_of_order"] += group.group_id != before[0]
      decisions["accept" if loop_accepts else "discard"] += 1
    elif kind == 3 and len(batch) == rl["groups_per_step"]:
      loop["steps"] += 1
      publish = policy.publishes(loop["steps"])
      loop["version"] += publish
      loop["credit"] += len(batch)
      if policy.releases(loop["steps"]):
        queue.release(loop["credit"])
        loop["credit"] = 0
        decisions["release"] += 1
      batch = []
      sim._trained(now)
      if publish:
        sim._step_done(now, published_s=0.0)
      assert (sim.step, sim.version, sim.trainer_held) == (
          loop["steps"], loop["version"], queue.snapshot()["held"])
    elif kind == 4 and loop["sampler_version"] != loop["version"]:
      loop["sampler_version"] = loop["version"]  # the sampler swaps in the staged weights
      sim.sampler_version, sim.pending_version = sim.pending_version, None
    assert (sim.inflight, len(sim.queue)) == (queue.inflight, queue.snapshot()["depth"])
  assert min(decisions["admit"], decisions["accept"], decisions["release"]) > 10, decisions
  if rl["mode"] == "async" and rl["max_staleness"] == 0:
    assert decisions["discard"] > 0, decisions
  # Only oldest_version in async mode ever takes a group that is not the first to arrive.
  assert (decisions["out_of_order"] > 0) == (rl.get("queue_order") == "oldest_version"
                                             and rl["mode"] == "async"), decisions


def test_next_index_is_the_first_of_the_oldest_version():
  """NumPy reference: np.argmin returns the first minimum, i.e. ties by arrival."""
  rng = np.random.default_rng(1)
  oldest = StalenessPolicy.make(**_rl(queue_order="oldest_version"))
  fifo = StalenessPolicy.make(**_rl())
  sync = StalenessPolicy.make(**_rl(mode="sync", queue_order="oldest_version"))
  assert oldest.orders_by_version and not fifo.orders_by_version and not sync.orders_by_version
  for _ in range(200):
    versions = rng.integers(0, 4, size=int(rng.integers(1, 12))).tolist()
    assert oldest.next_index(versions) == int(np.argmin(versions))
    assert fifo.next_index(versions) == 0 and sync.next_index(versions) == 0
  assert oldest.next_index([]) == 0


def test_queue_hands_out_the_oldest_version_first_and_unget_restores_it():
  """Groups verified out of order (versions 2, 0, 1, 0, 2 by arrival): oldest_version
  hands them out by version, ties by arrival (a stable argsort); fifo by arrival. A
  group put back (a batch cut short) is handed out again first."""
  arrival = [2, 0, 1, 0, 2]
  for order, expected in (("oldest_version", np.argsort(arrival, kind="stable").tolist()),
                          ("fifo", list(range(5)))):
    queue = RolloutQueue(StalenessPolicy.make(**_rl(queue_order=order, queue_maxsize=8,
                                                    groups_per_step=8)))
    queue.admitted(5)
    for gid, version in enumerate(arrival):
      queue.put(_group(gid, version))
    first = queue.get(timeout=0)
    queue.unget([first])
    taken = [queue.get(timeout=0).group_id for _ in range(5)]
    assert first.group_id == expected[0] and taken == expected, order
    assert queue.get(timeout=0) is None and queue.snapshot()["held"] == 5
    assert [g.group_id for g in queue.groups()] == []


def test_group_min_version_is_the_oldest_token_version_of_its_rollouts():
  group = _group(0, 3)
  r = group.rollouts[0]
  group.rollouts.append(dataclasses.replace(r, token_versions=np.array([1, 4], np.int32)))
  assert group.min_version == 1 and group.staleness(5) == 4

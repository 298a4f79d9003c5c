"""SamplerWorker pieces that need no pipeline: the overlong penalty it adds to rewards,
LoRA merge timings."""
import collections
import types

import numpy as np
import pytest

from rl_jax.orchestration.accounting import RunAccounting
from rl_jax.orchestration.sampler_worker import SamplerWorker
from rl_jax.types import Rollout


def _worker(overlong, *, max_new_tokens=32, buffer=8, episodes=None, max_total_tokens=0):
  cfg = types.SimpleNamespace(
      rl=types.SimpleNamespace(overlong=overlong, overlong_buffer=buffer),
      sampler=types.SimpleNamespace(max_new_tokens=max_new_tokens),
      env=types.SimpleNamespace(max_total_tokens=max_total_tokens))
  acc = RunAccounting(mode="async", sampler_devices=1, trainer_devices=1, total_devices=2)
  return types.SimpleNamespace(cfg=cfg, acc=acc, episodes=episodes)


def _rollout(n):
  return Rollout(group_id=0, sample_index=0, prompt_tokens=np.zeros(1, np.int32),
                 completion_tokens=np.zeros(n, np.int32),
                 behavior_logprobs=np.zeros(n, np.float32),
                 token_versions=np.zeros(n, np.int32))


@pytest.mark.parametrize("length, want", [(24, 0.0), (25, -1 / 8), (30, -6 / 8), (32, -1.0)])
def test_overlong_penalty_of_a_rollout_is_counted(length, want):
  w = _worker("penalty")
  assert SamplerWorker._overlong_penalty(w, _rollout(length)) == pytest.approx(want)
  assert w.acc.counts["rollouts_overlong_penalized"] == (want < 0)
  off = _worker("mask")
  assert SamplerWorker._overlong_penalty(off, _rollout(length)) == 0.0
  assert off.acc.counts["rollouts_overlong_penalized"] == 0


def test_overlong_penalty_uses_the_episode_token_limit():
  """Tool episodes end at env.max_total_tokens when it is set: L_max = 16, B = 8."""
  w = _worker("penalty", episodes=object(), max_total_tokens=16)
  assert SamplerWorker._overlong_penalty(w, _rollout(12)) == pytest.approx(-0.5)


def test_lora_merge_seconds_become_the_merge_metric_and_its_summary_mean():
  """Each merge the engine timed (Engine.merger.seconds) is one weight_sync/merge_s,
  taken once; weight_sync_merge_s_mean averages them (0 without LoRA: no merger)."""
  w = _worker("mask")
  merger = types.SimpleNamespace(seconds=collections.deque([0.25, 0.75]))
  w.generator = types.SimpleNamespace(engine=types.SimpleNamespace(merger=merger))
  SamplerWorker._note_merges(w)
  SamplerWorker._note_merges(w)
  assert w.acc.sync["merge_s"] == [0.25, 0.75] and not merger.seconds
  assert w.acc.sync_means()["weight_sync_merge_s_mean"] == pytest.approx(0.5)
  plain = _worker("mask")
  plain.generator = types.SimpleNamespace(engine=types.SimpleNamespace(merger=None))
  SamplerWorker._note_merges(plain)
  assert plain.acc.sync_means()["weight_sync_merge_s_mean"] == 0.0

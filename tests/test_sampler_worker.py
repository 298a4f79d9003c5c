"""SamplerWorker pieces that need no pipeline: the overlong penalty it adds to rewards."""
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

"""The sampler worker with a tool-using task (rl_jax.orchestration.episodes): a scripted
generator (tests/scripted_generator.py) and a tool pool whose results the test delivers
by hand, so every ordering (result before or after a weight swap, a preemption, a
failure) is exact rather than timed."""
import os

import numpy as np

from rl_jax import config as config_lib
from rl_jax import envs
from rl_jax.model.tokenizer import CharTokenizer
from rl_jax.orchestration import multihost
from rl_jax.orchestration.accounting import RunAccounting
from rl_jax.orchestration.episodes import EpisodeDriver
from rl_jax.orchestration.policy import StalenessPolicy
from rl_jax.orchestration.rollout_queue import RolloutQueue
from rl_jax.orchestration.sampler_worker import Publication, SamplerWorker
from rl_jax.tasks import make_task
from rl_jax.tasks.worker_pool import CallResult
from tests.scripted_generator import ScriptedGenerator, logprob

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = CharTokenizer()


class HandPool:
  """Tool pool stand-in: calls wait until the test answers them."""

  def __init__(self):
    self.calls = []

  def submit(self, key, request, callback):
    self.calls.append((key, request, callback))

  def answer(self, k, value, status="ok"):
    key, request, callback = self.calls[k]
    callback(key, CallResult(key=key, value=value, status=status, attempts=1,
                             t_submitted=1.0, t_started=1.5, t_finished=2.0))


class Prompts:
  def __init__(self, task):
    self.task, self.i = task, 0

  def get_state(self):
    return {"i": self.i}

  def __next__(self):
    self.i += 1
    return {"index": self.i - 1,
            "prompt_tokens": TOK.encode(self.task.example(self.i - 1).prompt, add_bos=True)}


def make_worker(script, *, group_size=2):
  cfg, _ = config_lib.parse_args(["--config", os.path.join(ROOT, "configs/calculator.py"),
                                  "--config.rl.groups_per_step=1",
                                  "--config.rl.max_inflight_groups=1",
                                  "--config.sampler.max_new_tokens=96",
                                  "--config.trainer.length_buckets=(128,)",
                                  f"--config.rl.group_size={group_size}",
                                  "--config.verifier.latency=none"])
  task = make_task(cfg.task, seed=cfg.seed)
  policy = StalenessPolicy.from_config(cfg.rl)
  acc = RunAccounting(mode="async", sampler_devices=1, trainer_devices=1, total_devices=2)
  acc.has_env = True
  tools = HandPool()
  driver = EpisodeDriver(env=envs.make_env(task, cfg.env), pool=tools, tokenizer=TOK,
                         accounting=acc, budget=envs.episode_budget(cfg))
  queue = RolloutQueue(policy)
  errors = []
  worker = SamplerWorker(cfg=cfg, task=task, prompts=Prompts(task), tokenizer=TOK, queue=queue,
                         policy=policy, accounting=acc, schedule=multihost.Schedule(None),
                         pool=None, on_error=errors.append, episodes=driver)
  worker.generator = ScriptedGenerator(script, slots=4)
  return worker, tools, acc, errors


def run_steps(worker, n=1):
  finished = []
  for _ in range(n):
    finished += worker.step_once()[1]
  for r in finished:
    worker.on_rollout_finished(r)
  return finished


def test_tool_call_parks_resumes_and_spans_a_weight_update():
  """Sample 0 calls the tool; a new version is swapped in while it waits; sample 1 answers
  at once. Tokens, mask, log-probs and versions against the hand-written transcript."""
  turns = {0: ["<calc>37*48</calc>", "1776"], 1: ["12"]}

  def script(gid, idx, turn, attempt):
    text = turns[idx][turn]
    return TOK.encode(text) + ([] if "calc" in text else [TOK.eos_id])
  worker, tools, acc, errors = make_worker(script)
  gen = worker.generator
  done = run_steps(worker)  # admits group 0, runs turn 0 of both samples
  assert [r.sample_index for r in done] == [1]
  assert gen.added[0][1]["turn_end"] is not None and gen.added[0][1]["max_new_tokens"] == 96
  assert [(c[0], c[1]) for c in tools.calls] == [((0, 0, 0, 0), "37*48")]
  assert (gen.num_parked, gen.num_active) == (1, 0)
  worker.stage(Publication(version=1, params=None, launched=0.0))
  run_steps(worker)  # the swap happens while the sequence is parked; nothing to decode
  assert gen.version == 1 and not worker.step_once()[0]  # the sampler is idle meanwhile
  tools.answer(0, "1776")
  (r,) = run_steps(worker)  # drain -> resume -> turn 1 on the new weights
  call, obs, answer = "<calc>37*48</calc>", "<result>1776</result>", "1776"
  want = TOK.encode(call + obs + answer) + [TOK.eos_id]
  model = [True] * len(call) + [False] * len(obs) + [True] * (len(answer) + 1)
  assert r.completion_tokens.tolist() == want and r.model_mask.tolist() == model
  np.testing.assert_allclose(r.behavior_logprobs, [logprob(t, j) if m else 0.0 for j, (t, m)
                                                   in enumerate(zip(want, model))], rtol=1e-6)
  versions = [0] * len(call) + [-1] * len(obs) + [1] * (len(answer) + 1)
  assert r.token_versions.tolist() == versions
  assert (r.min_version, r.staleness(3), r.mixed_versions) == (0, 3, True)
  assert r.completion_text == call + obs + answer
  assert not errors
  row = acc._env_row(gen, dt=1.0)
  assert row["env/tool_calls_mean"] == 0.5 and row["env/tool_call_rate"] == 0.5
  assert row["env/turns_mean"] == 1.5 and row["env/tool_calls_total"] == 1
  assert row["env/tokens_model_total"] == len(call) + len(answer) + 1 + 3
  assert row["env/tokens_env_total"] == len(obs)
  assert row["latency/tool_p50"] == 1.0


def test_failures_late_results_and_limits():
  """A tool error gives the error observation; a result for an episode the generator
  restarted is dropped; a call in the last allowed turn ends the episode."""
  def script(gid, idx, turn, attempt):
    if idx == 0:  # calls the tool in every turn
      return TOK.encode(f"<calc>{turn}*{attempt}</calc>")
    return TOK.encode("<calc>1*1</calc>") if turn == 0 else TOK.encode("1") + [TOK.eos_id]
  worker, tools, acc, errors = make_worker(script)
  gen = worker.generator
  run_steps(worker)
  assert [c[0] for c in tools.calls] == [(0, 0, 0, 0), (0, 1, 0, 0)]
  gen.restart(0, 0)  # preemption: sample 0 starts again from its prompt (attempt 1)
  tools.answer(1, None, status="error")
  (r1,) = run_steps(worker)  # sample 1 answers after the error observation
  assert r1.completion_text == "<calc>1*1</calc><result>error</result>1"
  assert [c[0] for c in tools.calls][2:] == [(0, 0, 1, 0)]  # the new attempt's first call
  tools.answer(0, "0")  # the old attempt's result: dropped
  run_steps(worker)
  assert acc.counts["tool_results_dropped"] == 1 and len(tools.calls) == 3
  tools.answer(2, "0")
  run_steps(worker)
  assert [c[0] for c in tools.calls][3:] == [(0, 0, 1, 1)]
  tools.answer(3, "1")
  (r0,) = run_steps(worker)  # turn 2 (the third) calls again: max_turns=3 ends it
  assert r0.finish_reason == "length" and r0.num_turns == 3
  assert r0.completion_text == ("<calc>0*1</calc><result>0</result><calc>1*1</calc>"
                                "<result>1</result><calc>2*1</calc>")
  assert (acc.counts["tool_error"], acc.counts["tool_ok"]) == (1, 3)
  assert acc.counts["episodes_ended_max_turns"] == 1
  assert acc.counts["env_tool_calls"] == 1 + 2  # sample 1, and sample 0's second attempt
  assert not errors and not worker.episodes._live and not worker.episodes._examples

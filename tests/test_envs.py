"""Tests for rl_jax.envs (the environment interface, the calculator environment, the tool
pool, run_episodes) and rl_jax.tasks.calculator."""
import numpy as np
import pytest

from configs.base import get_config
from rl_jax import envs
from rl_jax.envs.calculator import CalculatorEnv, CalculatorTool
from rl_jax.envs.episodes import run_episodes
from rl_jax.envs.tools import ToolPool
from rl_jax.model.tokenizer import CharTokenizer
from rl_jax.tasks import TaskError, make_task
from rl_jax.tasks.calculator import evaluate_call
from tests.scripted_generator import ScriptedGenerator, logprob

TOK = CharTokenizer()


def calc_task(**fields):
  cfg = get_config().task
  cfg.name, cfg.operators = "calculator", "*"
  for k, v in fields.items():
    setattr(cfg, k, v)
  return make_task(cfg, seed=3)


def test_calculator_examples():
  task = calc_task(digits=3)
  exs = [task.example(i) for i in range(400)]
  for ex in exs[:50]:
    a, b = ex.meta["expression"].split("*")
    assert ex.prompt == f"{a}*{b}=" and ex.answer == str(int(a) * int(b))
    assert str(int(a)) == a and str(int(b)) == b  # no leading zeros
  sizes = np.asarray([[len(t) for t in ex.meta["expression"].split("*")] for ex in exs])
  # the number of digits of each operand is uniform over 1..3
  assert np.allclose(np.bincount(sizes.ravel(), minlength=4)[1:] / sizes.size, 1 / 3, atol=0.05)
  assert task.example(7) == calc_task(digits=3).example(7)


@pytest.mark.parametrize("text, score, fmt", [
    ("1776", 1.0, 1.0),
    ("<calc>37*48</calc><result>1776</result>1776", 1.0, 1.0),
    ("<calc>37*48</calc><result>1776</result> 1776 ", 1.0, 1.0),
    ("<calc>37*48</calc><result>1776</result>1777", 0.0, 1.0),
    ("<calc>37*48</calc><result>1776</result>", 0.0, 0.0),  # no final answer
    ("<calc>37*48</calc><result>error</result>1776", 1.0, 1.0),
    ("1776<calc>37*48</calc>", 0.0, 0.0),  # cut off inside a call
    ("<calc>1*1</calc><result>1</result><calc>37*48</calc><result>1776</result>1776", 1.0, 1.0),
])
def test_calculator_reward(text, score, fmt):
  task = calc_task(format_reward=0.5)
  ex = task.example(0)
  ex = type(ex)(uid=ex.uid, prompt="37*48=", answer="1776", meta={"expression": "37*48"})
  r = task.reward(ex, text)
  assert (r.score, r.components["format"]) == (score, fmt)
  assert r.total == score + 0.5 * fmt


@pytest.mark.parametrize("expression, value", [
    ("37*48", "1776"), (" 37 * 48 ", "1776"), ("2+3*4", "14"), ("5-7", "-2"), ("0*9", "0")])
def test_evaluate_call(expression, value):
  assert evaluate_call(expression) == value == CalculatorTool()(expression)


@pytest.mark.parametrize("expression", ["", "37*", "a*b", "37/48", "(1+2)", "9" * 19, "1*" * 40 + "1",
                                        "__import__('os')"])
def test_evaluate_call_rejects(expression):
  with pytest.raises(ValueError):
    evaluate_call(expression)


def test_demonstrations_use_the_tool_in_part_of_the_examples():
  task = calc_task(digits=2, tool_demo_fraction=0.3)
  exs = [task.example(i) for i in range(1000)]
  segs = [task.demonstration_segments(ex) for ex in exs]
  with_tool = [s for s in segs if len(s) == 3]
  assert abs(len(with_tool) / len(segs) - 0.3) < 0.05
  for ex, s in zip(exs, segs):
    assert task.demonstration(ex) == "".join(t for t, _ in s)
    assert task.reward(ex, task.demonstration(ex)).score == 1.0
    if len(s) == 3:
      expr = ex.meta["expression"]
      assert s == [(f"<calc>{expr}</calc>", True), (f"<result>{ex.answer}</result>", False),
                   (ex.answer, True)]
    else:
      assert s == [(ex.answer, True)]
  assert all(len(s) == 1 for s in map(calc_task(tool_demo_fraction=0.0).demonstration_segments, exs))
  with pytest.raises(TaskError, match="task.tool_demo_fraction"):
    calc_task(tool_demo_fraction=1.5)


def test_turn_end_finds_the_stop_string():
  turn_end = envs.make_turn_end(TOK, ("</calc>",))
  assert turn_end(np.asarray(TOK.encode("<calc>3*4</calc")), ) is None
  text = "<calc>3*4</calc>99"
  assert turn_end(np.asarray(TOK.encode(text))) == len("<calc>3*4</calc>")

  class Pairs:  # a tokenizer whose tokens are two characters: the tag ends mid-token
    def decode(self, ids):
      return "".join(TOK.decode([i // 1000, i % 1000]) for i in ids)
  text = "x<calc>3*4</calc>9"
  ids = [TOK.encode(text[k])[0] * 1000 + TOK.encode(text[k + 1])[0]
         for k in range(0, len(text), 2)]
  # "</calc>" is characters 10..16: it ends inside the 9th token (characters 16, 17)
  assert envs.make_turn_end(Pairs(), ("</calc>",))(np.asarray(ids)) == 9


def test_episode_limits_and_error_observation():
  env = CalculatorEnv(max_turns=2)
  ep = env.start(calc_task().example(0))
  assert ep.step("<calc>37*48</calc>", turn_index=0) == envs.ToolCall("37*48")
  assert ep.step("x<calc> 2*3 </calc>", turn_index=0) == envs.ToolCall(" 2*3 ")
  assert ep.step("</calc>", turn_index=0) == envs.ToolCall("")
  # a call in the last allowed turn ends the episode
  assert ep.step("<calc>1*2</calc>", turn_index=1) == envs.End("length", "max_turns")
  assert ep.tool_calls == 3
  assert ep.observe("1776") == "<result>1776</result>"
  assert ep.observe(None) == "<result>error</result>"
  assert ep.tool_failures == 1
  assert envs.make_env(calc_task(), get_config().env).max_turns == get_config().env.max_turns
  assert envs.make_env(make_task(get_config().task), get_config().env) is None


def test_tool_pool_results_failures_and_timeouts():
  cfg = get_config().env.tool
  cfg.workers, cfg.retries = 2, 0
  with ToolPool(CalculatorEnv(max_turns=3), cfg, seed=0) as pool:
    pool.submit("a", "37*48")
    pool.submit("b", "37/48")
    got = {r.key: r for r in (pool.get(timeout=60), pool.get(timeout=60))}
  assert (got["a"].status, got["a"].value) == ("ok", "1776")
  assert (got["b"].status, got["b"].value) == ("error", None)
  assert "ValueError" in got["b"].error
  cfg.failure_prob, cfg.retries = 1.0, 1
  with ToolPool(CalculatorEnv(max_turns=3), cfg, seed=0) as pool:
    pool.submit("c", "1*1")
    r = pool.get(timeout=60)
  assert (r.status, r.value, r.attempts) == ("error", None, 2) and "injected tool" in r.error
  cfg.failure_prob, cfg.retries, cfg.timeout_s = 0.0, 0, 0.05
  cfg.latency, cfg.latency_mean_s = "fixed", 5.0
  with ToolPool(CalculatorEnv(max_turns=3), cfg, seed=0) as pool:
    pool.submit("d", "1*1")
    r = pool.get(timeout=60)
  assert (r.status, r.value) == ("timeout", None)
  cfg.latency = "gamma"
  with pytest.raises(TaskError, match=r"env\.tool\.latency must be"):
    ToolPool(CalculatorEnv(max_turns=3), cfg)


def test_run_episodes_on_a_scripted_generator():
  """Two episodes: one calls the tool and answers, one answers at once; the rollout's
  tokens, mask, log-probs and versions follow the script and the observation."""
  turns = {(-(10**9), 0): ["<calc>37*48</calc>", "1776"], (-(10**9) - 1, 0): ["12"]}

  def script(gid, idx, turn, attempt):
    text = turns[(gid, idx)][turn]
    return TOK.encode(text) + ([TOK.eos_id] if "calc" not in text else [])
  gen = ScriptedGenerator(script, version=4)
  task = calc_task()
  exs = [task.example(0), task.example(1)]
  prompts = [TOK.encode(ex.prompt, add_bos=True) for ex in exs]
  out = run_episodes(gen, CalculatorEnv(max_turns=3), TOK, exs, prompts, max_new_tokens=64)
  first, second = out
  call, obs, answer = "<calc>37*48</calc>", "<result>1776</result>", "1776"
  want = TOK.encode(call + obs + answer) + [TOK.eos_id]
  assert first.rollout.completion_tokens.tolist() == want
  model = np.asarray([True] * len(call) + [False] * len(obs) + [True] * (len(answer) + 1))
  assert first.rollout.model_mask.tolist() == model.tolist()
  lp = [logprob(t, j) if m else 0.0 for j, (t, m) in enumerate(zip(want, model))]
  np.testing.assert_allclose(first.rollout.behavior_logprobs, lp, rtol=1e-6)
  assert first.rollout.token_versions.tolist() == [4 if m else -1 for m in model]
  assert (first.tool_calls, first.tool_failures, first.rollout.num_turns) == (1, 0, 2)
  assert second.rollout.completion_tokens.tolist() == TOK.encode("12") + [TOK.eos_id]
  assert (second.tool_calls, second.rollout.num_turns) == (0, 1)
  assert all(kw["max_new_tokens"] == 64 and kw["turn_end"] is not None for _, kw in gen.added)

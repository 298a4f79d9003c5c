"""Tests for rl_jax.tasks: rewards on plain strings, generators, held-out split, registry."""
import json
import re
import time

import pytest

from configs.base import get_config
from rl_jax.data.jsonl import DataError
from rl_jax.tasks import answers
from rl_jax.tasks.arithmetic import evaluate_terms
from rl_jax.tasks.base import (Example, Task, TaskError, evaluate, is_heldout, make_task,
                               task_names)
from rl_jax.tasks.countdown import evaluate_expression, ExpressionError
from rl_jax.tasks.gsm8k import reference_answer

HUGE = "1" + "0" * 100_000


def task_cfg(**fields):
  cfg = get_config().task
  for k, v in fields.items():
    setattr(cfg, k, v)
  return cfg


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def test_registry_lists_allowed_names_on_unknown_task():
  assert set(task_names()) >= {"arithmetic", "countdown", "gsm8k", "jsonl"}
  with pytest.raises(TaskError,
                     match=r"task.name='nope'.*arithmetic, calculator, carries, countdown, gsm8k"):
    make_task(task_cfg(name="nope"))


@pytest.mark.parametrize("fields, message", [
    (dict(operators="+/"), "task.operators"),
    (dict(operators=""), "task.operators"),
    (dict(digits=0), "task.digits"),
    (dict(num_terms=1), "task.num_terms"),
    (dict(heldout_fraction=0.0), "task.heldout_fraction"),
    (dict(heldout_size=0), "task.heldout_size"),
    (dict(format_reward=-1.0), "task.format_reward"),
    (dict(name="gsm8k", path=""), "task.path"),
    (dict(name="jsonl", matcher="fuzzy"), "task.matcher"),
])
def test_bad_task_config_names_the_field(fields, message):
  with pytest.raises(TaskError, match=re.escape(message)):
    make_task(task_cfg(**fields))


def test_builtin_tasks_satisfy_protocol():
  for name in ("arithmetic", "countdown"):
    assert isinstance(make_task(task_cfg(name=name)), Task)


def test_arithmetic_examples_are_deterministic_and_well_formed():
  task = make_task(task_cfg(digits=2, num_terms=3, operators="+-*"), seed=7)
  again = make_task(task_cfg(digits=2, num_terms=3, operators="+-*"), seed=7)
  other = make_task(task_cfg(digits=2, num_terms=3, operators="+-*"), seed=8)
  examples = [task.example(i) for i in range(200)]
  assert examples == [again.example(i) for i in range(200)]
  assert examples != [other.example(i) for i in range(200)]
  for ex in examples:
    assert re.fullmatch(r"[0-9]{1,2}[-+*][0-9]{1,2}[-+*][0-9]{1,2}=", ex.prompt), ex.prompt
    # The prompt is generated, regex-checked arithmetic: a safe test reference.
    assert int(ex.answer) == eval(ex.prompt[:-1])  # pylint: disable=eval-used
    assert task.demonstration(ex) == ex.answer
    assert task.reward(ex, task.demonstration(ex)).score == 1.0
  assert len({ex.uid for ex in examples}) == len({ex.prompt for ex in examples})


def test_evaluate_terms_precedence():
  assert evaluate_terms(terms=[12, 3, 4, 5], operators="-*+") == 12 - 3 * 4 + 5
  assert evaluate_terms(terms=[2, 3, 4], operators="*-") == 2
  assert evaluate_terms(terms=[7, 8], operators="*") == 56


@pytest.mark.parametrize("completion, score, fmt", [
    ("46", 1, 1), (" 46\n", 1, 1), ("+46", 1, 1), ("046", 1, 1),
    ("46 47", 0, 0), ("4 6", 0, 0), ("46.0", 0, 0), ("46\n47", 0, 0), ("47", 0, 1),
    ("", 0, 0), ("   ", 0, 0), ("forty-six", 0, 0), ("-46", 0, 1),
    ("\u0664\u0666", 0, 0),  # Arabic-Indic digits
    ("\uff14\uff16", 0, 0),  # fullwidth digits
    ("__import__('os').system('true')", 0, 0), (HUGE, 0, 1), ("9" * 5000, 0, 1),
])
def test_arithmetic_reward(completion, score, fmt):
  task = make_task(task_cfg(format_reward=0.5))
  ex = Example(uid="u", prompt="12+34=", answer="46")
  reward = task.reward(ex, completion)
  assert (reward.score, reward.components["format"]) == (score, fmt)
  assert reward.total == pytest.approx(score + 0.5 * fmt)


@pytest.mark.parametrize("completion, correct, shown", [
    ("132", 1, 0), (" 132\n", 1, 0), ("7+5=12 4+8+1=13 =132", 1, 1),
    ("7+5=12 =132", 1, 0.5),  # one of the two columns shown
    ("7+5=12 4+8=12 =132", 1, 0.5),  # the carry into the tens column is missing
    ("4+8+1=13 7+5=12 =132", 1, 0),  # steps out of order
    ("7+5=12 4+8+1=13 =131", 0, 1), ("131", 0, 0), ("", 0, 0),
    ("7+5=12 4+8+1=13", 0, 0),  # no final answer: nothing parsed
    ("7+5=12 4+8+1=13 =132 =133", 0, 1), ("=132", 1, 0), (HUGE, 0, 0),
])
def test_carries_reward_pays_for_the_working(completion, correct, shown):
  """total = correct * (1 + shown) / 2, shown = right steps in place / columns."""
  task = make_task(task_cfg(name="carries"))
  ex = Example(uid="u", prompt="47+85=", answer="132",
               meta={"steps": ["7+5=12", "4+8+1=13"]})
  reward = task.reward(ex, completion)
  assert (reward.score, reward.components["working"]) == (correct, shown)
  assert reward.total == pytest.approx(correct * (1 + shown) / 2)


def test_carries_examples_and_demonstrations():
  from rl_jax.tasks.carries import working_steps
  assert working_steps(47, 85) == ["7+5=12", "4+8+1=13"]
  assert working_steps(5, 98) == ["5+8=13", "0+9+1=10"]  # a missing digit is 0
  task = make_task(task_cfg(name="carries", digits=2, working_demo_fraction=0.25), seed=3)
  worked = 0
  for i in range(400):
    ex = task.example(i)
    a, b = (int(x) for x in ex.prompt[:-1].split("+"))
    assert ex.answer == str(a + b) and ex.meta["steps"] == working_steps(a, b)
    demo = task.demonstration(ex)
    worked += demo != ex.answer
    # Every demonstration is correct; the worked ones earn the full reward.
    assert task.reward(ex, demo).total == (1.0 if demo != ex.answer else 0.5)
  assert 60 <= worked <= 140  # about a quarter
  with pytest.raises(TaskError, match="task.num_terms must be 2"):
    make_task(task_cfg(name="carries", num_terms=3))


def test_arithmetic_negative_answer():
  task = make_task(task_cfg(operators="-"))
  ex = Example(uid="u", prompt="12-34=", answer="-22")
  assert task.reward(ex, "-22").score == 1.0
  assert task.reward(ex, "\u221222").score == 1.0  # Unicode minus is a sign
  assert task.reward(ex, "22").score == 0.0


def test_countdown_demonstrations_hit_their_targets():
  task = make_task(task_cfg(name="countdown", num_terms=4, operators="+-*/"), seed=3)
  for i in range(300):
    ex = task.example(i)
    numbers = ex.meta["numbers"]
    assert ex.prompt == " ".join(map(str, numbers)) + f" -> {ex.answer}:"
    reward = task.reward(ex, task.demonstration(ex))
    assert reward.score == 1.0, (ex, reward)
    assert sorted(reward.info["used"]) == sorted(numbers)


COUNTDOWN = Example(uid="c", prompt="3 5 7 -> 22:", answer="22",
                    meta={"numbers": [3, 5, 7], "solution": "3*5+7"})


@pytest.mark.parametrize("completion, score, fmt", [
    ("3*5+7", 1, 1), (" 7 + 5 * 3 \n", 1, 1), ("(3*5)+7", 1, 1), ("((7))+(5*3)", 1, 1),
    ("3*5+7+3-3", 0, 0),  # 3 used three times
    ("5*5-3", 0, 0),  # 5 reused
    ("22", 0, 0),  # not a given number
    ("3*7", 0, 1),  # subset is allowed, value wrong
    ("3*5+7=22", 0, 0), ("-3+25", 0, 0), ("3 5", 0, 0), ("3*(5+7", 0, 0),
    ("", 0, 0), ("9**9**9", 0, 0), ("3**5", 0, 0), ("__import__('os')", 0, 0),
    ("exec('import os')", 0, 0), ("3*5+7;", 0, 0), ("\uff13*\uff15+\uff17", 0, 0),
    ("3.0*5+7", 0, 0), ("7/(5-5)", 0, 0), (HUGE, 0, 0), ("(" * 5000 + "3" + ")" * 5000, 0, 0),
    ("(" * 40 + "3" + ")" * 40 + "*5+7", 0, 0),
])
def test_countdown_reward(completion, score, fmt):
  task = make_task(task_cfg(name="countdown", format_reward=1.0))
  reward = task.reward(COUNTDOWN, completion)
  assert (reward.score, reward.components["format"]) == (score, fmt), reward.info


def test_countdown_number_multiset_and_exact_fractions():
  assert evaluate_expression(text="3*3+5", numbers=[3, 3, 5])[0] == 14
  with pytest.raises(ExpressionError, match="used too often"):
    evaluate_expression(text="3*3*3", numbers=[3, 3, 5])
  assert evaluate_expression(text="(1/3)*3", numbers=[1, 3, 3])[0] == 1
  value, used = evaluate_expression(text="(6+4)/3", numbers=[6, 4, 3])
  assert value.denominator == 3 and used == [3, 4, 6]
  with pytest.raises(ExpressionError, match="division by zero"):
    evaluate_expression(text="5/(3-3)", numbers=[5, 3, 3])
  big = [10**17] * 4
  with pytest.raises(ExpressionError, match="too large"):
    evaluate_expression(text="*".join(map(str, big)), numbers=big)
  with pytest.raises(ExpressionError, match="nested deeper"):
    evaluate_expression(text="(" * 40 + "3" + ")" * 40, numbers=[3])


def test_adversarial_completions_are_cheap():
  countdown = make_task(task_cfg(name="countdown"))
  arithmetic = make_task(task_cfg())
  start = time.perf_counter()
  for text in (HUGE, "9" * 10**6, "(" * 10**5, "1+" * 10**5 + "1", "\u0665" * 10**5):
    countdown.reward(COUNTDOWN, text)
    arithmetic.reward(Example("u", "1+1=", "2"), text)
    answers.extract_final_answer(text)
  # Linear scans take well under a second here; a quadratic one over 10**6 characters takes
  # hours. The bound sits between the two, far from both, so machine load cannot flip it.
  assert time.perf_counter() - start < 120.0


@pytest.mark.parametrize("text, expected", [
    ("so 5+37 = 42\n#### 42", ("42", "####")),
    ("#### 1\n#### 2", ("2", "####")),
    ("\\boxed{17} then #### 18", ("18", "####")),
    ("#### 18 then \\boxed{17}", ("17", "boxed")),
    ("The answer is \\boxed{-3.50}.", ("-3.5", "boxed")),
    ("It costs $1,234.50 total.", ("1234.5", "last_number")),
    ("first 3, then 4, finally 12.", ("12", "last_number")),
    ("####", (None, "####")), ("#### none", (None, "####")), ("\\boxed{x}", (None, "boxed")),
    ("no numbers here", (None, "none")), ("", (None, "none")),
    ("#### +7", ("7", "####")), ("#### \u22125", ("-5", "####")), ("#### 0.0", ("0", "####")),
    ("#### -0", ("0", "####")), ("#### 007", ("7", "####")), ("5-3", ("3", "last_number")),
    ("#### \u0664\u0662", (None, "####")), ("\uff14\uff12", (None, "none")),
    ("#### " + HUGE, (HUGE, "####")),
    # A marked answer is one number: alternatives, more arithmetic or an exponent after
    # it are no answer (not the first number), while words, "$", commas and a full
    # stop around it are fine.
    ("#### 1234 or 1235", (None, "####")), ("#### 1234 * 2", (None, "####")),
    ("#### 1234e5", (None, "####")), ("#### 1234E-5", (None, "####")),
    ("#### 1234/2", (None, "####")), ("#### 1234 = x", (None, "####")),
    ("#### 1234 \u00d7 y", (None, "####")), ("#### 1,2345", (None, "####")),
    ("#### 1234.5.6", (None, "####")), ("\\boxed{12 or 13}", (None, "boxed")),
    ("#### 2 * 617 = 1234", (None, "####")),
    ("#### 1,234", ("1234", "####")), ("#### $1234", ("1234", "####")),
    ("#### 1234.", ("1234", "####")), ("#### $1,234.50 dollars.", ("1234.5", "####")),
    ("#### The answer is 1234", ("1234", "####")), ("#### 1234 apples\nthen 5", ("1234", "####")),
    ("#### 1234 - done", ("1234", "####")), ("\\boxed{ 1,234. }", ("1234", "boxed")),
])
def test_extract_final_answer(text, expected):
  assert answers.extract_final_answer(text) == expected


@pytest.mark.parametrize("text, canonical", [
    ("3.50", "3.5"), ("3.5", "3.5"), ("+3", "3"), ("$3", "3"), ("-$3", "-3"), ("1,234", "1234"),
    ("  12 ", "12"), (".5", "0.5"), ("5.", "5"), ("1,2", None), ("1 2", None), ("3e5", None),
    ("\u0663", None), ("", None),
])
def test_canonical_number(text, canonical):
  assert answers.canonical_number(text) == canonical


def gsm8k_records(n):
  return [{"question": f"Tom has {i} apples and buys {i + 3} more. How many?",
           "answer": f"{i}+{i + 3}={2 * i + 3}\n#### {2 * i + 3:,}"} for i in range(n)]


def test_gsm8k_task(tmp_path):
  path = write_jsonl(tmp_path / "gsm.jsonl", gsm8k_records(300))
  task = make_task(task_cfg(name="gsm8k", path=path, heldout_size=10, format_reward=0.2))
  assert task.num_train + len(task.heldout_examples()) <= 300
  assert len(task.heldout_examples()) == 10
  ex = task.example(0)
  assert ex.prompt.endswith("\nAnswer:")
  assert task.reward(ex, task.demonstration(ex)).score == 1.0
  answer = ex.answer
  assert task.reward(ex, f"I think... #### {answer}").total == pytest.approx(1.2)
  assert task.reward(ex, f"so the total is {answer}").total == pytest.approx(1.0)
  assert task.reward(ex, f"#### {int(answer) + 1}").total == pytest.approx(0.2)
  assert task.reward(ex, f"#### {answer} and #### {int(answer) + 1}").score == 0.0
  for more in (" or 1235", " * 2", "e5"):  # not scored as its first number
    assert task.reward(ex, f"#### {answer}{more}").score == 0.0
  assert task.reward(ex, "").total == 0.0
  digits = "".join(chr(0x0660 + int(d)) for d in answer)
  assert task.reward(ex, f"#### {digits}").score == 0.0
  assert task.reward(ex, "#### " + HUGE).score == 0.0


def test_gsm8k_reference_answer():
  assert reference_answer("work\n#### 1,234") == "1234"
  assert reference_answer("#### $5.50") == "5.5"
  with pytest.raises(ValueError, match="####"):
    reference_answer("the answer is 5")


def test_gsm8k_missing_reference_is_reported_with_line(tmp_path):
  records = gsm8k_records(20)
  records[4]["answer"] = "no marker"
  path = write_jsonl(tmp_path / "gsm.jsonl", records)
  with pytest.raises(DataError, match=r"gsm\.jsonl:5: answer has no '#### <number>'"):
    make_task(task_cfg(name="gsm8k", path=path))
  task = make_task(task_cfg(name="gsm8k", path=path, heldout_fraction=0.3),
                   on_bad_line="skip")
  assert task.skipped_lines == 1


def test_jsonl_matchers(tmp_path):
  records = [{"prompt": f"q{i}", "answer": f"{i}.50"} for i in range(200)]
  path = write_jsonl(tmp_path / "p.jsonl", records)
  numeric = make_task(task_cfg(name="jsonl", path=path, matcher="numeric"))
  exact = make_task(task_cfg(name="jsonl", path=path, matcher="exact"))
  ex_n, ex_e = numeric.example(0), exact.example(0)
  value = ex_e.answer
  assert numeric.reward(ex_n, f"it is {value[:-1]}").score == 1.0
  assert exact.reward(ex_e, f" {value}\n").score == 1.0
  assert exact.reward(ex_e, value[:-1]).score == 0.0
  with pytest.raises(TaskError, match="no demonstrations"):
    exact.demonstration(ex_e)

  regex_records = [{"prompt": f"name {i}", "answer": r"(?i)yes|y"} for i in range(50)]
  regex = make_task(task_cfg(name="jsonl", matcher="regex", heldout_fraction=0.3,
                             path=write_jsonl(tmp_path / "r.jsonl", regex_records)))
  ex = regex.example(0)
  assert [regex.reward(ex, t).score for t in ("YES", " y\n", "yes!", "no", "")] == [1, 1, 0, 0, 0]


def test_jsonl_bad_answers_are_reported_with_line(tmp_path):
  bad_regex = [{"prompt": "a", "answer": "x"}, {"prompt": "b", "answer": "(unclosed"}]
  with pytest.raises(DataError, match=r"r\.jsonl:2: answer is not a valid regex"):
    make_task(task_cfg(name="jsonl", matcher="regex",
                       path=write_jsonl(tmp_path / "r.jsonl", bad_regex)))
  bad_number = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "one"}]
  with pytest.raises(DataError, match=r"n\.jsonl:2: answer 'one' is not a number"):
    make_task(task_cfg(name="jsonl", matcher="numeric",
                       path=write_jsonl(tmp_path / "n.jsonl", bad_number)))
  with pytest.raises(DataError, match=r"m\.jsonl:1: missing field 'prompt'"):
    make_task(task_cfg(name="jsonl", path=write_jsonl(tmp_path / "m.jsonl", [{"q": 1}])))


def test_format_reward_component():
  task = make_task(task_cfg(format_reward=0.25))
  ex = Example("u", "1+1=", "2")
  assert task.reward(ex, "3").components == {"correct": 0.0, "format": 1.0}
  assert task.reward(ex, "3").total == 0.25
  assert task.reward(ex, "2").total == 1.25
  assert make_task(task_cfg()).reward(ex, "3").total == 0.0


def test_procedural_heldout_is_fixed_and_disjoint_from_training():
  cfg = task_cfg(heldout_size=100)
  task, other_seed = make_task(cfg, seed=0), make_task(cfg, seed=123)
  heldout = task.heldout_examples()
  assert len(heldout) == 100 and len({ex.prompt for ex in heldout}) == 100
  assert heldout == other_seed.heldout_examples()  # independent of the run seed
  assert all(is_heldout(ex.prompt, fraction=cfg.heldout_fraction) for ex in heldout)
  heldout_prompts = {ex.prompt for ex in heldout}
  for t in (task, other_seed):
    train = {t.example(i).prompt for i in range(3000)}
    assert not train & heldout_prompts
    assert not any(is_heldout(p, fraction=cfg.heldout_fraction) for p in train)


def test_small_prompt_space_gives_smaller_heldout():
  task = make_task(task_cfg(digits=1, heldout_size=256))
  heldout = task.heldout_examples()
  assert 0 < len(heldout) < 100  # 100 distinct 1-digit sums, ~10% held out
  assert not {task.example(i).prompt for i in range(500)} & {ex.prompt for ex in heldout}


def test_dataset_heldout_is_disjoint(tmp_path):
  records = gsm8k_records(200) + gsm8k_records(200)  # duplicates land on one side
  task = make_task(task_cfg(name="gsm8k", path=write_jsonl(tmp_path / "g.jsonl", records),
                            heldout_size=5))
  train = {task.example(i).prompt for i in range(task.num_train)}
  assert len(task.heldout_examples()) == 5
  assert not train & {ex.prompt for ex in task.heldout_examples()}
  assert task.train_examples()[0] == task.example(0)


def test_evaluate():
  task = make_task(task_cfg(format_reward=0.5))
  examples = [Example("a", "1+1=", "2"), Example("b", "2+2=", "4"), Example("c", "1+2=", "3")]
  result = evaluate(task, examples, ["2", "5", "x"])
  assert result == {"reward_mean": pytest.approx((1.5 + 0.5 + 0) / 3),
                    "accuracy": pytest.approx(1 / 3), "n": 3}
  with pytest.raises(ValueError, match="3 examples but 2 completions"):
    evaluate(task, examples, ["2", "4"])

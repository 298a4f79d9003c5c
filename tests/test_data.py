"""Tests for rl_jax.data: JSONL reading and grain prompt pipelines."""
import itertools
import json
import logging

import numpy as np
import pytest

from configs.base import get_config
from rl_jax.data.jsonl import DataError, read_jsonl, require_str
from rl_jax.data.prompts import (chat_format, demonstration_tokens, encode_prompt,
                                 heldout_records, make_prompt_source)
from rl_jax.tasks.base import make_task


class CharTokenizer:
  """ord-based test tokenizer: bos 1, eos 2, characters as their code points."""
  bos_id, eos_id = 1, 2

  def encode(self, text, add_bos=False):
    return ([self.bos_id] if add_bos else []) + [ord(c) for c in text]


TOK = CharTokenizer()


def configs(**data_fields):
  cfg = get_config()
  for k, v in data_fields.items():
    setattr(cfg.data, k, v)
  return cfg


def jsonl_task(tmp_path, n=60, prompt=lambda i: f"question {i}?", **task_fields):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps({"prompt": prompt(i), "answer": str(i)}) + "\n"
                          for i in range(n)))
  cfg = get_config().task
  cfg.name, cfg.path, cfg.matcher, cfg.heldout_fraction = "jsonl", str(path), "exact", 0.1
  for k, v in task_fields.items():
    setattr(cfg, k, v)
  return make_task(cfg)


def take(source, n):
  return [next(source) for _ in range(n)]


def test_records_and_determinism():
  cfg = configs()
  task = make_task(cfg.task, seed=0)
  a = take(make_prompt_source(task, cfg.data, TOK, seed=11), 50)
  b = take(make_prompt_source(task, cfg.data, TOK, seed=11), 50)
  c = take(make_prompt_source(task, cfg.data, TOK, seed=12), 50)
  assert [r["index"] for r in a] == [r["index"] for r in b]
  assert [r["index"] for r in a] != [r["index"] for r in c]
  record = a[0]
  example = task.example(record["index"])
  assert record["uid"] == example.uid
  assert record["prompt_tokens"].dtype == np.int32
  assert record["prompt_tokens"].tolist() == [1] + [ord(ch) for ch in example.prompt]


def test_process_shards_are_disjoint_and_cover_an_epoch(tmp_path):
  task = jsonl_task(tmp_path, n=80)
  cfg = configs(num_epochs=1)
  shards = [[r["index"] for r in make_prompt_source(task, cfg.data, TOK, seed=3,
                                                    process_index=p, process_count=3)]
            for p in range(3)]
  flat = list(itertools.chain(*shards))
  assert sorted(flat) == list(range(task.num_train))  # disjoint union of all indices
  assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_epochs_repeat_with_fresh_order(tmp_path):
  task = jsonl_task(tmp_path, n=80)
  cfg = configs(num_epochs=2)
  indices = [r["index"] for r in make_prompt_source(task, cfg.data, TOK, seed=3)]
  n = task.num_train
  assert len(indices) == 2 * n
  assert sorted(indices[:n]) == sorted(indices[n:]) == list(range(n))
  assert indices[:n] != indices[n:]
  unshuffled = configs(num_epochs=1, shuffle=False)
  assert [r["index"] for r in make_prompt_source(task, unshuffled.data, TOK, seed=3)] == \
      list(range(n))


@pytest.mark.parametrize("procedural", [True, False])
def test_exact_resume_from_saved_state(tmp_path, procedural):
  cfg = configs(on_long_prompt="drop", max_prompt_length=12)
  task = (make_task(cfg.task, seed=1) if procedural else
          jsonl_task(tmp_path, n=50, prompt=lambda i: "x" * (i % 15)))
  source = make_prompt_source(task, cfg.data, TOK, seed=5, process_index=1, process_count=2)
  take(source, 37)
  state = json.loads(json.dumps(source.get_state()))  # must survive a JSON checkpoint
  expected = take(source, 40)
  resumed = make_prompt_source(task, cfg.data, TOK, seed=5, process_index=1, process_count=2)
  resumed.set_state(state)
  got = take(resumed, 40)
  assert [r["uid"] for r in got] == [r["uid"] for r in expected]
  assert all(np.array_equal(g["prompt_tokens"], e["prompt_tokens"])
             for g, e in zip(got, expected))
  assert resumed.counters == source.counters


def test_training_stream_excludes_heldout_prompts():
  cfg = configs()
  task = make_task(cfg.task, seed=0)
  heldout = {ex.prompt for ex in task.heldout_examples()}
  stream = {task.example(r["index"]).prompt
            for r in take(make_prompt_source(task, cfg.data, TOK, seed=0), 3000)}
  assert len(stream) > 1000 and not stream & heldout
  records = heldout_records(task, cfg.data, TOK)
  assert [r["uid"] for r in records] == [ex.uid for ex in task.heldout_examples()]


def test_long_prompts_truncate_keeping_the_end(tmp_path):
  tokens, truncated = encode_prompt("abcdefgh", tokenizer=TOK, max_length=4)
  assert truncated and tokens.tolist() == [1, ord("f"), ord("g"), ord("h")]
  tokens, truncated = encode_prompt("abc", tokenizer=TOK, max_length=4)
  assert not truncated and tokens.tolist() == [1, ord("a"), ord("b"), ord("c")]
  task = jsonl_task(tmp_path, n=40, prompt=lambda i: "y" * (i % 10))
  cfg = configs(max_prompt_length=6, num_epochs=1)
  source = make_prompt_source(task, cfg.data, TOK, seed=0)
  records = list(source)
  long = sum(len(task.example(r["index"]).prompt) > 5 for r in records)
  assert len(records) == task.num_train and all(len(r["prompt_tokens"]) <= 6 for r in records)
  assert source.counters == {"skipped_lines": 0, "truncated": long, "dropped": 0}


def test_long_prompts_dropped_and_counted(tmp_path):
  task = jsonl_task(tmp_path, n=40, prompt=lambda i: "y" * (i % 10))
  cfg = configs(max_prompt_length=6, num_epochs=1, on_long_prompt="drop")
  source = make_prompt_source(task, cfg.data, TOK, seed=0)
  records = list(source)
  assert all(len(task.example(r["index"]).prompt) <= 5 for r in records)
  assert source.counters["dropped"] == task.num_train - len(records) > 0
  all_long = jsonl_task(tmp_path, n=40, prompt=lambda i: "z" * (20 + i))
  cfg = configs(max_prompt_length=6, on_long_prompt="drop")
  with pytest.raises(DataError, match="data.max_prompt_length=6"):
    next(make_prompt_source(all_long, cfg.data, TOK, seed=0))
  with pytest.raises(DataError, match="every held-out prompt"):
    heldout_records(all_long, cfg.data, TOK)


@pytest.mark.parametrize("fields, kwargs, message", [
    (dict(num_epochs=-1), {}, "data.num_epochs"),
    (dict(max_prompt_length=1), {}, "data.max_prompt_length"),
    (dict(on_long_prompt="wrap"), {}, "data.on_long_prompt"),
    ({}, dict(process_index=2, process_count=2), "process_index=2"),
])
def test_bad_data_config(fields, kwargs, message):
  cfg = configs(**fields)
  with pytest.raises(DataError, match=message):
    make_prompt_source(make_task(cfg.task), cfg.data, TOK, seed=0, **kwargs)


def parse_prompt(obj, line_no):
  del line_no
  return require_str(obj, "prompt")


def test_jsonl_bad_lines_fail_with_file_and_line(tmp_path):
  path = tmp_path / "file.jsonl"
  path.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n[1, 2]\n{"prompt": ["c"]}\n')
  with pytest.raises(DataError, match=r"file\.jsonl:3: invalid JSON"):
    read_jsonl(str(path), parse=parse_prompt, on_bad_line="fail")


def test_jsonl_bad_lines_skipped_counted_and_logged(tmp_path, caplog):
  path = tmp_path / "file.jsonl"
  path.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"\n[1]\n{"prompt": ["c"]}\n'
                   b'\xff\xfe\n{"other": 1}\n{"prompt": 7}\n')
  with caplog.at_level(logging.WARNING):
    records, skipped = read_jsonl(str(path), parse=parse_prompt, on_bad_line="skip")
  assert records == ["a", "7"] and skipped == 5
  text = caplog.text
  assert "file.jsonl:2: invalid JSON" in text and "file.jsonl:3: expected a JSON object" in text
  assert "file.jsonl:4: field 'prompt' must be a string" in text
  assert "skipped 5 bad lines" in text


def test_skipped_lines_reach_the_prompt_source_counters(tmp_path):
  path = tmp_path / "p.jsonl"
  lines = [json.dumps({"prompt": f"q{i}", "answer": "a"}) for i in range(60)]
  lines[10] = "not json"
  path.write_text("\n".join(lines) + "\n")
  cfg = configs()
  cfg.task.name, cfg.task.path, cfg.task.matcher = "jsonl", str(path), "exact"
  task = make_task(cfg.task, on_bad_line="skip")
  assert make_prompt_source(task, cfg.data, TOK, seed=0).counters["skipped_lines"] == 1


def test_missing_empty_and_unknown_inputs(tmp_path):
  with pytest.raises(DataError, match="does not exist"):
    read_jsonl(str(tmp_path / "nope.jsonl"), parse=parse_prompt, on_bad_line="fail")
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n\n")
  with pytest.raises(DataError, match="contains no valid records"):
    read_jsonl(str(empty), parse=parse_prompt, on_bad_line="skip")
  with pytest.raises(DataError, match="data.on_bad_line"):
    read_jsonl(str(empty), parse=parse_prompt, on_bad_line="ignore")


def test_chat_prompts_match_transformers_apply_chat_template(tmp_path):
  import transformers
  import tiny_hf
  from rl_jax.model.tokenizer import HFTokenizer
  tiny_hf.write_tokenizer(tmp_path / "tok")
  tok = HFTokenizer(str(tmp_path / "tok"))
  reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
  task = jsonl_task(tmp_path, n=40)
  cfg = configs(chat=True, system_prompt="Be brief.", max_prompt_length=200)

  def want(prompt):
    ids = reference.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}],
        tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"])

  held = task.heldout_examples()
  pairs = [(r, task.example(r["index"]))
           for r in take(make_prompt_source(task, cfg.data, tok, seed=0), 5)]
  pairs += [(r, held[r["index"]]) for r in heldout_records(task, cfg.data, tok)]
  for record, example in pairs:
    assert record["prompt_tokens"].tolist() == want(example.prompt)
    assert not record["truncated"]
  # Too long: the end (user turn and generation prompt) is kept, no bos is added.
  short = configs(chat=True, system_prompt="Be brief.", max_prompt_length=12).data
  tokens, truncated = encode_prompt("question 1?", tokenizer=tok, max_length=12,
                                    chat=chat_format(short, tok))
  assert truncated and tokens.tolist() == want("question 1?")[-12:]


def test_chat_needs_a_template():
  with pytest.raises(DataError, match="data.chat=True needs a tokenizer with a chat template"):
    chat_format(configs(chat=True).data, TOK)
  assert chat_format(configs().data, TOK) is None


def test_demonstration_tokens_mask_observations():
  cfg = get_config().task
  cfg.name, cfg.operators, cfg.tool_demo_fraction = "calculator", "*", 1.0
  task = make_task(cfg)
  ex = task.example(0)
  tokens, mask = demonstration_tokens(task, ex, tokenizer=TOK)
  call, obs = f"<calc>{ex.meta['expression']}</calc>", f"<result>{ex.answer}</result>"
  assert tokens == TOK.encode(call + obs + ex.answer) + [TOK.eos_id]
  assert mask.tolist() == [True] * len(call) + [False] * len(obs) + [True] * (len(ex.answer) + 1)
  plain = make_task(get_config().task)  # no segments: the whole demonstration, eos
  tokens, mask = demonstration_tokens(plain, plain.example(0), tokenizer=TOK)
  assert tokens == TOK.encode(plain.example(0).answer) + [TOK.eos_id] and mask.all()

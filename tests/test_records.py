"""rl_jax.data.records: GSM8K from the Hugging Face Parquet split and from JSON lines."""
import json

import pytest

import tiny_hf
from configs.base import get_config
from rl_jax.data.jsonl import DataError
from rl_jax.data.records import read_records
from rl_jax.tasks.base import make_task


def gsm8k_cfg(path, **fields):
  cfg = get_config().task
  cfg.name, cfg.path, cfg.heldout_fraction = "gsm8k", str(path), 0.2
  for k, v in fields.items():
    setattr(cfg, k, v)
  return cfg


def test_parquet_and_jsonl_give_the_same_task(tmp_path):
  rows = tiny_hf.gsm8k_rows(40)
  tiny_hf.write_parquet(tmp_path / "train.parquet", rows)
  tiny_hf.write_jsonl(tmp_path / "train.jsonl", rows)
  a = make_task(gsm8k_cfg(tmp_path / "train.parquet"))
  b = make_task(gsm8k_cfg(tmp_path / "train.jsonl"))
  assert a.num_train == b.num_train and 0 < a.num_train < 40
  for x, y in zip(list(a.train_examples()) + a.heldout_examples(),
                  list(b.train_examples()) + b.heldout_examples()):
    assert (x.prompt, x.answer) == (y.prompt, y.answer)
  first = a.example(0)
  row = next(r for r in rows if r["question"] + "\nAnswer:" == first.prompt)
  assert first.answer == row["answer"].rsplit("#### ", 1)[1]
  assert first.uid.startswith("gsm8k:train.parquet:")


def test_prompt_template_and_eval_path(tmp_path):
  tiny_hf.write_parquet(tmp_path / "train.parquet", tiny_hf.gsm8k_rows(30))
  tiny_hf.write_jsonl(tmp_path / "test.jsonl", tiny_hf.gsm8k_rows(7, start=100))
  task = make_task(gsm8k_cfg(tmp_path / "train.parquet", eval_path=str(tmp_path / "test.jsonl"),
                             prompt_template="Q: {question} {braces}", heldout_size=5))
  # With a separate eval file every training record trains; held-out = its first 5.
  assert task.num_train == 30
  held = task.heldout_examples()
  assert [e.uid for e in held] == [f"gsm8k:test.jsonl:{i}" for i in range(1, 6)]
  q = tiny_hf.gsm8k_rows(1, start=100)[0]["question"]
  assert held[0].prompt == f"Q: {q} {{braces}}" and held[0].answer == str(103 + 740)
  with pytest.raises(ValueError, match=r"task.prompt_template 'Q' has no \{question\}"):
    make_task(gsm8k_cfg(tmp_path / "train.parquet", prompt_template="Q"))


def test_bad_rows_name_the_file_and_row(tmp_path):
  rows = tiny_hf.gsm8k_rows(10)
  rows[3] = {"question": "no marker", "answer": "42"}
  rows[6] = {"question": None, "answer": "#### 1"}
  path = tmp_path / "t.parquet"
  tiny_hf.write_parquet(path, rows)
  with pytest.raises(DataError, match=r"t.parquet: row 4: answer has no '#### <number>' line"):
    make_task(gsm8k_cfg(path), on_bad_line="fail")
  task = make_task(gsm8k_cfg(path, heldout_fraction=0.3), on_bad_line="skip")
  assert task.skipped_lines == 2 and task.num_train + len(task.heldout_examples()) <= 8
  # A table without the columns: every row is bad, the error lists the columns it has.
  tiny_hf.write_parquet(tmp_path / "other.parquet", [{"prompt": "x", "solution": "y"}] * 3)
  with pytest.raises(DataError, match=r"no valid records \(3 rows, 3 bad; columns: prompt, "
                                      r"solution\)"):
    make_task(gsm8k_cfg(tmp_path / "other.parquet"), on_bad_line="skip")
  with pytest.raises(DataError, match=r"other.parquet: row 1: missing field 'question'"):
    make_task(gsm8k_cfg(tmp_path / "other.parquet"), on_bad_line="fail")


def test_jsonl_bad_line_and_unreadable_files(tmp_path):
  path = tmp_path / "t.jsonl"
  lines = [json.dumps(r) for r in tiny_hf.gsm8k_rows(5)]
  lines.insert(2, "{not json")
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(DataError, match=r"t.jsonl:3: invalid JSON"):
    make_task(gsm8k_cfg(path), on_bad_line="fail")
  parse = lambda obj, n: obj  # noqa: E731
  (tmp_path / "t.csv").write_text("question,answer\n")
  with pytest.raises(DataError, match=r"t.csv' has extension '.csv'; rl_jax reads JSON lines"):
    read_records(str(tmp_path / "t.csv"), parse=parse, on_bad_line="fail")
  (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
  with pytest.raises(DataError, match=r"broken.parquet' is not a readable Parquet file"):
    read_records(str(tmp_path / "broken.parquet"), parse=parse, on_bad_line="fail")
  with pytest.raises(DataError, match=r"is a directory; give one .parquet or .jsonl file"):
    read_records(str(tmp_path), parse=parse, on_bad_line="fail")
  with pytest.raises(DataError, match=r"missing.parquet' does not exist"):
    read_records(str(tmp_path / "missing.parquet"), parse=parse, on_bad_line="fail")

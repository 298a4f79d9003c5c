"""Every user mistake and environment fault at start-up ends in one `error:` line naming the
field, file or path, with a non-zero exit and no traceback (rl_jax/cli.py, launch/*.py).

Most cases run launch/train.py's main in-process (the errors fire before any device work);
a few run the real script in a subprocess to see the exit status and the whole stderr.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from rl_jax import cli
from rl_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.py")


def _script(name):
  spec = importlib.util.spec_from_file_location(f"launch_{name}",
                                                os.path.join(ROOT, "launch", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def train():
  return _script("train")


@pytest.fixture
def files(tmp_path):
  """Bad inputs on disk, by name."""
  (tmp_path / "all_bad.jsonl").write_text("not json\n[1, 2]\n")
  (tmp_path / "one_bad.jsonl").write_text(
      '{"question": "1+1?", "answer": "#### 2"}\n{"question": "no answer"}\n')
  (tmp_path / "raises_at_import.py").write_text("import configs.base\nraise RuntimeError('boom')\n")
  (tmp_path / "raises_in_get_config.py").write_text(
      "def get_config(arg=None):\n  return {}['missing']\n")
  (tmp_path / "plain_file").write_text("")
  (tmp_path / "model_without_config").mkdir()
  return tmp_path


def _stderr_line(capsys):
  err = capsys.readouterr().err
  assert "Traceback" not in err, err
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1, err
  return lines[0]


# (overrides, words the one line must contain); {d} is the files fixture's folder.
CASES = [
    (["--config.task.name=nope"], ["task.name", "'nope'", "arithmetic"]),
    (["--config.task.digits=0"], ["task.digits", "got 0"]),
    (["--config.task.num_terms=1"], ["task.num_terms"]),
    (["--config.task.operators=^"], ["task.operators", "'^'"]),
    (["--config.seed=-1"], ["'seed'", ">= 0"]),
    (["--config.task.name=gsm8k", "--config.task.path={d}/missing.jsonl"],
     ["task.path", "missing.jsonl", "does not exist"]),
    (["--config.task.name=gsm8k", "--config.task.path={d}"], ["task.path", "not a regular file"]),
    (["--config.task.name=gsm8k"], ["task.path"]),
    (["--config.model.preset=gpt5"], ["model.preset", "'gpt5'", "tiny_char"]),
    (["--config.model.path={d}/no_such_model"], ["model.path", "no_such_model"]),
    (["--config.model.path={d}/model_without_config"], ["model.path", "config.json"]),
    (["--config.data.max_prompt_length=0"], ["data.max_prompt_length", ">= 1"]),
    (["--config.verifier.retries=-1"], ["verifier.retries", ">= 0"]),
    (["--config.sampler.kv_cache_bytes=0"], ["sampler.kv_cache_bytes"]),
    (["--config.trainer.loss_norm_len=-5"], ["trainer.loss_norm_len", "-5"]),
    (["--config.trainer.b1=1.5"], ["trainer.b1", "[0, 1)"]),
    (["--config.trainer.b2=1.0"], ["trainer.b2"]),
    (["--config.warmstart.batch_size=0"], ["warmstart.batch_size"]),
    (["--config.metrics.log_every=0"], ["metrics.log_every"]),
    (["--config.trainer.learning_rate=1e400"], ["trainer.learning_rate", "finite"]),
    (["--config.verifier.latency=empirical"], ["verifier.latency_file"]),
    (["--workdir", "{d}/plain_file/run"], ["workdir", "plain_file/run", "cannot be created"]),
    (["--workdir", "{d}/plain_file"], ["workdir", "plain_file", "not a directory"]),
    (["--no-such-flag"], ["--no-such-flag"]),
]


@pytest.mark.parametrize("overrides, words", CASES, ids=[" ".join(c[0])[:50] for c in CASES])
def test_train_startup_mistakes_are_one_line(train, files, capsys, overrides, words):
  args = [a.replace("{d}", str(files)) for a in overrides]
  if "--workdir" not in args:
    args += ["--workdir", str(files / "run")]
  status = train.main(["--config", DEFAULT, *args])
  line = _stderr_line(capsys)
  assert status != 0
  assert line.startswith("error: "), line
  for w in words:
    assert w.replace("{d}", str(files)) in line, line


@pytest.mark.parametrize("spec, words", [
    ("raises_at_import.py", ["importing", "raises_at_import.py:2", "RuntimeError: boom"]),
    ("raises_in_get_config.py", ["get_config() failed", "'missing'", "raises_in_get_config.py:2"]),
    ("missing.py", ["missing.py", "does not exist"]),
])
def test_train_bad_config_files_are_one_line(train, files, capsys, spec, words):
  status = train.main(["--config", str(files / spec), "--workdir", str(files / "run")])
  line = _stderr_line(capsys)
  assert status == cli.EXIT_ERROR
  for w in words:
    assert w in line, line


@pytest.mark.parametrize("path, more, words", [
    ("all_bad.jsonl", [], ["all_bad.jsonl", "no valid records", "2 bad lines",
                           "all_bad.jsonl:1: invalid JSON"]),
    ("one_bad.jsonl", ["--config.data.on_bad_line=fail"],
     ["one_bad.jsonl:2", "missing field 'answer'", "data.on_bad_line"]),
])
def test_train_bad_data_files_are_one_line(train, files, capsys, path, more, words):
  """Read when the run starts (in-process here, with the test session's 8 devices)."""
  status = train.main(["--config", DEFAULT, "--config.task.name=gsm8k",
                       f"--config.task.path={files / path}", *more,
                       "--workdir", str(files / "run")])
  line = _stderr_line(capsys)
  assert status == cli.EXIT_ERROR
  for w in words:
    assert w in line, line


def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(capsys):
  def fails(argv):
    raise KeyError("x")
  assert cli.run(fails, []) == cli.EXIT_ERROR
  assert _stderr_line(capsys) == "error: KeyError: 'x' (rerun with --debug for the traceback)"
  assert cli.run(fails, ["--debug"]) == cli.EXIT_ERROR
  err = capsys.readouterr().err
  assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: KeyError")

  def user(argv):
    assert argv == ["a"]  # --debug is taken out
    raise UserError("two\nlines")
  assert cli.run(user, ["--debug", "a"]) == cli.EXIT_ERROR
  assert capsys.readouterr().err.strip().splitlines()[-1] == "error: two | lines"

  def oserror(argv):
    open("/nonexistent/dir/file")
  assert cli.run(oserror, []) == cli.EXIT_ERROR
  assert _stderr_line(capsys) == "error: /nonexistent/dir/file: No such file or directory"
  assert cli.run(lambda argv: None, []) == 0
  assert cli.run(lambda argv: cli.EXIT_PREEMPTED, []) == 143


def _run(script, *args, cwd=ROOT):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, os.path.join(ROOT, "launch", script), *args],
                        cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, words", [
    (["--config.seed=-1"], ["'seed'"]),
    (["--config.trainer.b1=1.5"], ["trainer.b1"]),
    (["--workdir", "{d}/plain_file/run"], ["plain_file/run"]),
])
def test_train_script_exit_status_and_stderr(files, args, words):
  """The real process: non-zero status, exactly one stderr line, no traceback."""
  args = [a.replace("{d}", str(files)) for a in args]
  if "--workdir" not in args:
    args += ["--workdir", str(files / "run")]
  p = _run("train.py", "--config", DEFAULT, *args)
  assert p.returncode == cli.EXIT_ERROR, p.stderr
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in p.stderr
  for w in words:
    assert w in lines[0], lines


def test_train_debug_flag_shows_the_traceback(files):
  p = _run("train.py", "--config", str(files / "raises_at_import.py"), "--debug")
  assert p.returncode == cli.EXIT_ERROR
  assert "Traceback" in p.stderr and p.stderr.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize("script, args, words", [
    ("evaluate.py", ["--workdir", "{d}/nothing"], ["nothing", "config.json"]),
    ("evaluate.py", ["--hf", "{d}/model_without_config", "--config", DEFAULT],
     ["config.json"]),
    ("export.py", ["--workdir", "{d}/nothing", "--out", "{d}/out"], ["no checkpoints"]),
    ("plan.py", ["--config", DEFAULT, "--devices", "8", "--config.task.digits=0"],
     ["task.digits"]),
    ("report.py", ["{d}/nothing"], ["nothing"]),
    ("serve.py", ["--config", DEFAULT, "--config.model.preset=gpt5"], ["model.preset"]),
])
def test_other_launch_scripts_are_one_line(train, files, capsys, script, args, words):
  module = _script(script[:-3])
  args = [a.replace("{d}", str(files)) for a in args]
  status = module.main(args)
  line = _stderr_line(capsys)
  assert status == cli.EXIT_ERROR and line.startswith("error: "), line
  for w in words:
    assert w in line, line


def test_train_refuses_a_workdir_of_another_run_and_a_locked_one(train, files, capsys):
  from rl_jax import workdir as workdir_lib
  run = files / "other"
  run.mkdir()
  (run / "config.json").write_text(json.dumps({"seed": 7, "rl": {"mode": "async"}}))
  (run / "metrics.jsonl").write_text('{"step": 1}\n')
  assert train.main(["--config", DEFAULT, "--workdir", str(run)]) == cli.EXIT_ERROR
  line = _stderr_line(capsys)
  assert "holds another run" in line and "seed=7" in line and "--overwrite" in line, line
  lock = workdir_lib.Lock(str(run)).acquire()
  try:
    assert train.main(["--config", DEFAULT, "--workdir", str(run)]) == cli.EXIT_ERROR
    assert f"in use by another run (pid {os.getpid()}" in _stderr_line(capsys)
  finally:
    lock.release()


def test_dry_run_checks_flags_and_config_and_stops_before_the_workdir(train, files, capsys):
  run = files / "dry"
  assert train.main(["--config", DEFAULT, "--workdir", str(run), "--dry-run"]) == 0
  assert "dry run" in capsys.readouterr().out and not run.exists()
  assert train.main(["--config", DEFAULT, "--config.task.digits=0", "--dry-run"]) == cli.EXIT_ERROR
  assert "task.digits" in _stderr_line(capsys)
  # the checks that need no devices run too: a bad choice is one line
  assert train.main(["--config", DEFAULT, "--config.rl.queue_order=newest", "--dry-run"]) == cli.EXIT_ERROR
  assert "'rl.queue_order' must be one of 'fifo', 'oldest_version'" in _stderr_line(capsys)
  assert train.main(["--config", DEFAULT, "--wokdir", str(run), "--dry-run"]) == cli.EXIT_USAGE
  assert "--wokdir" in _stderr_line(capsys) and not run.exists()


def test_dry_run_passes_on_only_config_overrides(files, capsys):
  """compare.py passes what its flags leave on to train.py."""
  compare = _script("compare")
  args = ["--dry-run", "--config", DEFAULT, "--workdir", str(files / "compare"),
          "--config.seed=3", "--config.rl.mode", "sync"]
  assert compare.main(args) == 0
  assert compare.main(args + ["--sedes", "2"]) == cli.EXIT_USAGE
  assert "'--sedes'" in _stderr_line(capsys)
  assert compare.main(args + ["--config.seed"]) == cli.EXIT_USAGE
  assert not (files / "compare").exists()


def test_dry_run_stops_at_the_outermost_parse_only(capsys):
  parsed = []

  def main(argv):
    p = cli.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("go").add_argument("--n", type=int)
    parsed.append(p.parse_args(argv))
    return 5

  assert cli.run(main, ["go", "--n", "2", "--dry-run"]) == 0 and not parsed
  assert cli.run(main, ["go", "--n", "x", "--dry-run"]) == cli.EXIT_USAGE
  assert "invalid int value" in _stderr_line(capsys)
  assert cli.run(main, ["go", "--n", "2"]) == 5 and parsed[0].n == 2  # no dry run left over

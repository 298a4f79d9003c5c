"""configs/gsm8k_hf.py end to end on CPU: the path a GPU user takes, at toy sizes.

A random Qwen2ForCausalLM written by transformers' save_pretrained, a BPE tokenizer with a
ChatML chat template, GSM8K-shaped train (Parquet) and test (JSON lines) files; only the
sizes are overridden.
"""
import contextlib
import importlib.util
import io
import os

import pytest
import transformers

import tiny_hf
from rl_jax import config as config_lib
from rl_jax.orchestration import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "gsm8k_hf.py")
CPU_SIZES = [
    "--config.rl.total_steps=3", "--config.rl.groups_per_step=4", "--config.rl.group_size=4",
    "--config.rl.eval_every=2", "--config.task.heldout_size=4",
    "--config.trainer.micro_batch_size=8", "--config.trainer.length_buckets=(176,)",
    "--config.data.max_prompt_length=160", "--config.sampler.max_prefill_length=160",
    "--config.sampler.max_new_tokens=16", "--config.sampler.max_concurrent_decodes=16",
    "--config.sampler.page_size=16", "--config.sampler.kv_cache_bytes=4194304",
    "--config.sampler.steps_per_call=4", "--config.verifier.workers=2",
    "--config.checkpoint.every=0", "--config.metrics.console=false",
    "--config.metrics.tensorboard=false",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("gsm8k_hf")
  tiny_hf.write_checkpoint(str(root / "ckpt"))
  tiny_hf.write_parquet(root / "train.parquet", tiny_hf.gsm8k_rows(40))
  tiny_hf.write_jsonl(root / "test.jsonl", tiny_hf.gsm8k_rows(6, start=100))
  return root


def _args(files, *extra, spec=CONFIG):
  return ["--config", spec, f"--config.model.path={files / 'ckpt'}",
          f"--config.task.path={files / 'train.parquet'}", *CPU_SIZES, *extra]


def test_async_run_on_a_hugging_face_checkpoint(files, tmp_path):
  cfg, _ = config_lib.parse_args(_args(files, f"--config.task.eval_path={files / 'test.jsonl'}"))
  config_lib.validate(cfg)
  pipe = loop.Pipeline(cfg, str(tmp_path))
  rollouts = []
  original = pipe.worker.on_rollout_finished
  pipe.worker.on_rollout_finished = lambda r: (rollouts.append(r), original(r))
  summary = pipe.run()
  assert summary["mode"] == "async" and summary["optimizer_steps"] == 3
  assert summary["policy_version"] == 3 and summary["rollouts_trained"] == 3 * 4 * 4
  assert len(summary["heldout_curve"]) >= 2
  # Numerics: fp32 master params, bf16 compute and sampler.
  assert (pipe.model_cfg.param_dtype, pipe.model_cfg.dtype) == ("float32", "bfloat16")
  assert str(pipe.engine.kv_dtype) == "bfloat16"
  # Stop tokens: the template's <|im_end|> and generation_config's <|endoftext|>.
  ref = transformers.AutoTokenizer.from_pretrained(str(files / "ckpt"))
  assert set(pipe.engine.stop_ids) == {ref.convert_tokens_to_ids("<|im_end|>"),
                                       ref.convert_tokens_to_ids("<|endoftext|>")}
  # Prompts are the chat template of the checkpoint, as transformers renders it.
  system = cfg.data.system_prompt
  expected = {tuple(_chat_ids(ref, system, e.prompt)) for e in pipe.task.train_examples()}
  assert rollouts and all(tuple(r.prompt_tokens.tolist()) in expected for r in rollouts)
  assert all(e.prompt.endswith("holds only the final numeric answer.")
             for e in pipe.task.train_examples())
  held = pipe.task.heldout_examples()
  assert [e.uid for e in held] == [f"gsm8k:test.jsonl:{i}" for i in range(1, 5)]
  assert [list(p) for p in pipe.heldout.prompts] == [
      _chat_ids(ref, system, e.prompt) for e in held]


def _chat_ids(ref, system, prompt):
  ids = ref.apply_chat_template(
      [{"role": "system", "content": system}, {"role": "user", "content": prompt}],
      tokenize=True, add_generation_prompt=True)
  return list(ids["input_ids"])


def test_evaluate_on_the_test_split(files):
  spec = importlib.util.spec_from_file_location("rl_jax_launch_evaluate",
                                                os.path.join(ROOT, "launch", "evaluate.py"))
  evaluate = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(evaluate)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    evaluate.main(["--hf", str(files / "ckpt"), "--config", CONFIG,
                   f"--config.task.path={files / 'train.parquet'}",
                   f"--config.task.eval_path={files / 'test.jsonl'}",
                   "--config.task.heldout_size=1319", *CPU_SIZES[5:]])
  assert "on 6 prompts (greedy)" in out.getvalue(), out.getvalue()


def test_config_variants_and_one_line_errors(files):
  cfg = config_lib.load_file(CONFIG + ":mode=sync,size=1.5b")
  assert (cfg.rl.mode, cfg.model.preset, cfg.trainer.micro_batch_size) == (
      "sync", "qwen2_1_5b", 8)
  cfg = config_lib.load_file(CONFIG + ":devices=4")
  assert (cfg.mesh.sampler.data, cfg.mesh.trainer.fsdp, cfg.trainer.micro_batch_size) == (4, 4, 64)
  with pytest.raises(config_lib.ConfigError, match=r"unknown variant 'model'; known: mode"):
    config_lib.load_file(CONFIG + ":model=x")
  cfg = config_lib.load_file(CONFIG + ":mode=sync,lora=8")
  assert (cfg.rl.mode, cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.param_dtype) == (
      "sync", 8, 32.0, "bfloat16")
  # Full fine-tuning's 2e-6 times sqrt(rank * hidden) / alpha = sqrt(8 * 896) / 32.
  assert cfg.trainer.learning_rate == pytest.approx(2e-6 * 2.6458, rel=1e-4)
  with pytest.raises(config_lib.ConfigError, match=r"variant lora='-1' must be an integer >= 0"):
    config_lib.load_file(CONFIG + ":lora=-1")
  cfg, _ = config_lib.parse_args(["--config", CONFIG, f"--config.task.path={files / 'train.parquet'}"])
  with pytest.raises(config_lib.ConfigError,
                     match=r"^config field 'model.path' is empty; .*--config.model.path="):
    config_lib.validate(cfg, num_devices=1)
  cfg.model.path = str(files / "nope")
  with pytest.raises(config_lib.ConfigError, match=r"^config field 'model.path': '.*nope' is not "
                                                    r"a directory \(a Hugging Face checkpoint"):
    config_lib.validate(cfg, num_devices=1)
  cfg.model.path, cfg.task.path = str(files / "ckpt"), ""
  with pytest.raises(config_lib.ConfigError, match=r"^config field 'task.path' is empty"):
    config_lib.validate(cfg, num_devices=1)
  cfg.task.path = str(files / "train.parquet")
  config_lib.validate(cfg, num_devices=1)


def test_cpu_smoke_run_notes_accelerator_sizes_in_one_line(files):
  """Issue 29: the GPU config run as a CPU smoke test says in one line at start-up that
  its sizes are an accelerator's (a 4 GiB KV pool, bf16 compute); sizes that suit the
  backend get no note."""
  from rl_jax.model import hf_io
  from rl_jax.orchestration import runtime
  cfg, _ = config_lib.parse_args(_args(files)[:4])  # the config's own sizes
  model_cfg, _ = hf_io.from_pretrained(str(files / "ckpt"))
  note = runtime.cpu_size_note(cfg, model_cfg, "cpu")
  # A page: 64 tokens x 2 (K, V) x 2 layers x 2 KV heads x 8 dims x 2 bytes = 8 KiB;
  # 256 slots x 14 pages + the null page = 3,585 pages = 28.0 MiB.
  assert note.count("\n") == 0 and "4,096 MiB (sampler.kv_cache_bytes)" in note, note
  assert "at most 28.0 MiB" in note and "model.dtype, sampler.dtype" in note, note
  assert runtime.cpu_size_note(cfg, model_cfg, "gpu") is None
  cfg.sampler.kv_cache_bytes, cfg.model.dtype, cfg.sampler.dtype = 2 ** 24, "float32", "auto"
  assert runtime.cpu_size_note(cfg, model_cfg, "cpu") is None


def test_console_heartbeat_reports_a_silent_wait():
  """Issue 29: while a long evaluation or compilation prints nothing, the console says
  what is running and how many programs XLA compiled."""
  import threading
  from rl_jax import metrics
  out, beat = io.StringIO(), threading.Event()

  def describe():
    beat.set()
    return "held-out evaluation: 3/16 done"
  console = metrics.Console(stream=out)
  with console.heartbeat(describe, every_s=0.01):
    assert beat.wait(60)
  line = out.getvalue().splitlines()[0]
  assert "held-out evaluation: 3/16 done (XLA has compiled" in line, line
  with metrics.Console(enabled=False).heartbeat(describe, every_s=0.01):
    pass

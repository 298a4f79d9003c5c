"""Config loading, overrides and validation: every user mistake is one ConfigError sentence."""
import os

import pytest

from rl_jax import config as config_lib
from rl_jax.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.py")


def load(*overrides, spec=DEFAULT):
  cfg, rest = config_lib.parse_args(["--config", spec, *overrides])
  return cfg, rest


def test_default_loads_and_validates():
  cfg, rest = load("--workdir", "/tmp/x")
  assert rest == ["--workdir", "/tmp/x"]
  assert cfg.rl.mode == "async"
  config_lib.validate(cfg, num_devices=8)


def test_variant_and_overrides():
  cfg, _ = load("--config.rl.max_staleness=3", "--config.trainer.learning_rate", "3e-4",
                "--config.rl.inflight_weight_updates=false", "--config.trainer.length_buckets=(128,256)",
                spec=DEFAULT + ":mode=sync")
  assert cfg.rl.mode == "sync"
  assert cfg.rl.max_staleness == 3
  assert cfg.trainer.learning_rate == pytest.approx(3e-4)
  assert cfg.rl.inflight_weight_updates is False
  assert cfg.trainer.length_buckets == (128, 256)
  # an int given for a float field is accepted as a float
  cfg, _ = load("--config.trainer.learning_rate=1")
  assert isinstance(cfg.trainer.learning_rate, float)


def test_default_lora_variant_combines_with_mode():
  cfg, _ = load(spec=DEFAULT + ":mode=sync,lora=8")
  assert (cfg.rl.mode, cfg.model.lora.rank, cfg.model.lora.alpha) == ("sync", 8, 32.0)
  # sqrt(rank * hidden) / alpha = sqrt(8 * 128) / 32 = 1: full fine-tuning's 2e-4.
  assert cfg.trainer.learning_rate == pytest.approx(2e-4)
  assert cfg.model.lora.targets == "q,k,v,o,gate,up,down"
  config_lib.validate(cfg, num_devices=8)
  cfg, _ = load(spec=DEFAULT + ":lora=32")
  assert cfg.trainer.learning_rate == pytest.approx(4e-4)  # sqrt(32 * 128) / 32 = 2


def test_calculator_config_and_its_sync_variant():
  spec = os.path.join(ROOT, "configs", "calculator.py")
  cfg, _ = load(spec=spec)
  sync, _ = load(spec=spec + ":mode=sync")
  assert (cfg.rl.mode, sync.rl.mode, cfg.task.name) == ("async", "sync", "calculator")
  assert cfg.env.tool.latency == "lognormal"
  sync.rl.mode = "async"
  assert sync.to_dict() == cfg.to_dict()
  config_lib.validate(cfg, num_devices=8)
  with pytest.raises(ConfigError, match="unknown variant 'turns'"):
    load(spec=spec + ":turns=2")


def test_sync_baseline_is_default_in_sync_mode():
  cfg, _ = load(spec=os.path.join(ROOT, "configs", "sync_baseline.py"))
  base, _ = load()
  assert cfg.rl.mode == "sync"
  cfg.rl.mode = "async"
  assert cfg.to_dict() == base.to_dict()


def test_length_drift_config_and_its_variants():
  for spec, mode, control in (("", "async", "auto"), (":control=off", "async", "off"),
                              (":mode=sync,control=admission", "sync", "admission")):
    cfg, _ = load(spec=os.path.join(ROOT, "configs", "length_drift.py") + spec)
    config_lib.validate(cfg, num_devices=8)
    assert (cfg.task.name, cfg.rl.mode, cfg.rl.control) == ("carries", mode, control)
  with pytest.raises(ConfigError, match="unknown variant 'speed'"):
    load(spec=os.path.join(ROOT, "configs", "length_drift.py") + ":speed=2")


def test_no_tool_latency_is_default_without_verifier_latency():
  """The compute-bound workload differs from the default in the injected verifier
  latency only, in both modes (compare.py overrides rl.mode)."""
  base, _ = load()
  for mode in ("", ":mode=sync"):
    cfg, _ = load(spec=os.path.join(ROOT, "configs", "no_tool_latency.py") + mode)
    config_lib.validate(cfg, num_devices=8)
    assert cfg.verifier.latency == "none" and base.verifier.latency == "lognormal"
    assert cfg.rl.mode == ("sync" if mode else "async")
    mine, theirs = cfg.to_dict(), base.to_dict()
    for d in (mine, theirs):
      d["verifier"] = {k: v for k, v in d["verifier"].items() if not k.startswith("latency")}
      d["rl"] = {k: v for k, v in d["rl"].items() if k != "mode"}
    assert mine == theirs


@pytest.mark.parametrize("args, words", [
    (["--config.rl.max_stalenes=2"], ["rl.max_stalenes", "max_staleness"]),
    (["--config.nope.x=1"], ["nope"]),
    (["--config.rl.max_staleness=two"], ["rl.max_staleness", "int"]),
    (["--config.rl.inflight_weight_updates=maybe"], ["rl.inflight_weight_updates", "true or false"]),
    (["--config.rl=3"], ["group of fields"]),
])
def test_bad_overrides(args, words):
  with pytest.raises(ConfigError) as e:
    load(*args)
  msg = str(e.value)
  assert "\n" not in msg
  for w in words:
    assert w in msg


def test_bad_file_and_variant(tmp_path):
  with pytest.raises(ConfigError, match="does not exist"):
    load(spec=str(tmp_path / "missing.py"))
  with pytest.raises(ConfigError, match="unknown variant 'colour'"):
    load(spec=DEFAULT + ":colour=red")
  bad = tmp_path / "bad.py"
  bad.write_text("from configs import base\n"
                 "def get_config(arg=None):\n"
                 "  c = base.get_config()\n"
                 "  c.rl.stalenes = 2\n"
                 "  return c\n")
  with pytest.raises(ConfigError, match="unknown config field 'rl.stalenes'"):
    load(spec=str(bad))
  wrong_type = tmp_path / "wrong.py"
  wrong_type.write_text("from configs import base\n"
                        "def get_config(arg=None):\n"
                        "  c = base.get_config()\n"
                        "  c.rl.mode = 3\n"
                        "  return c\n")
  with pytest.raises(ConfigError, match=r"get_config\(\) failed: .*'mode'.*cannot be cast"):
    load(spec=str(wrong_type))
  syntax = tmp_path / "syntax.py"
  syntax.write_text("def get_config(arg=None):\n  return (\n")
  with pytest.raises(ConfigError, match=r"syntax.py:\d+: syntax error"):
    load(spec=str(syntax))


@pytest.mark.parametrize("field, value, words", [
    ("rl.max_staleness", -1, ["rl.max_staleness", ">= 0"]),
    ("rl.mode", "fast", ["rl.mode", "'sync', 'async'"]),
    ("rl.group_size", 1, ["rl.group_size"]),
    ("mesh.sampler.data", 8, ["mesh", "12 devices", "8 exist"]),
    ("rl.groups_per_step", 3, ["divide", "data x fsdp = 2"]),
    ("rl.max_inflight_groups", 4, ["rl.max_inflight_groups", "rl.groups_per_step"]),
    ("sampler.top_p", 0.0, ["sampler.top_p"]),
    ("trainer.loss_agg", "sum", ["trainer.loss_agg", "token_mean"]),
    ("trainer.length_buckets", (8, 16), ["trainer.length_buckets", "max_prompt_length"]),
    ("verifier.failure_prob", 1.5, ["verifier.failure_prob"]),
    ("sampler.max_concurrent_decodes", 6, ["sampler.max_concurrent_decodes", "4"]),
    ("mesh.trainer.pipeline", 2, ["mesh.trainer.pipeline", "data, fsdp, tensor"]),
    ("model.attention", "flash", ["model.attention", "'cudnn'", "'splash'"]),
    ("model.remat", "some", ["model.remat", "'none', 'full', 'dots'"]),
    ("model.dtype", "float16", ["model.dtype", "'auto', 'float32', 'bfloat16'"]),
    ("model.param_dtype", "auto", ["model.param_dtype", "'float32', 'bfloat16'"]),
    ("trainer.logprob_save_bytes", -1, ["trainer.logprob_save_bytes", ">= 0",
                                        "always recompute"]),
    ("trainer.logprob_chunk_len", -1, ["trainer.logprob_chunk_len", ">= 0"]),
    ("env.max_total_tokens", 64, ["env.max_total_tokens", "sampler.max_new_tokens (8)"]),
    ("env.tool.latency", "gamma", ["env.tool.latency", "'lognormal'"]),
    ("env.tool.backend", "fibers", ["env.tool.backend", "'threads'"]),
    ("env.tool.latency_alpha", 1.0, ["env.tool.latency_alpha", "> 1"]),
    ("env.tool.latency_file", "/nonexistent", ["env.tool.latency_file", "does not exist"]),
    ("rl.filter_groups", "uniform", ["rl.filter_groups", "'none', 'zero_variance'"]),
    ("rl.max_oversample", 0, ["rl.max_oversample", ">= 1"]),
    ("rl.overlong", "clip", ["rl.overlong", "'none', 'mask', 'penalty'"]),
    ("rl.control", "on", ["rl.control", "'auto', 'off', 'admission'"]),
    ("rl.queue_order", "lifo", ["rl.queue_order", "'fifo', 'oldest_version'", "'lifo'"]),
    ("model.lora.rank", -1, ["model.lora.rank", ">= 0"]),
    ("model.lora.alpha", 0.0, ["model.lora.alpha", "> 0"]),
    ("model.lora.dropout", 1.0, ["model.lora.dropout", "[0, 1)"]),
    ("model.lora.targets", "q,mlp", ["model.lora.targets", "q,k,v,o,gate,up,down", "'q,mlp'"]),
    ("model.lora.targets", "q,q", ["model.lora.targets", "distinct"]),
    ("rl.control_every", 2, ["rl.control_every", ">= 3", "3 logged steps"]),
    ("rl.overlong_buffer", 0, ["rl.overlong_buffer", "[1, sampler.max_new_tokens"]),
])
def test_validation_errors(field, value, words):
  cfg, _ = load()
  group, key = field.rsplit(".", 1)
  node = cfg
  for p in group.split("."):
    node = node[p]
  with node.ignore_type():
    node[key] = value
  if field in ("env.tool.latency_alpha", "env.tool.latency_file"):
    cfg.env.tool.latency = "pareto" if field.endswith("alpha") else "empirical"
    cfg.env.tool.latency_mean_s = 1.0
  if field == "rl.overlong_buffer":
    cfg.rl.overlong = "penalty"
  if field == "sampler.max_concurrent_decodes":
    cfg.mesh.sampler.data = 4  # 6 slots over 4 data-parallel sampler devices
  if field == "rl.groups_per_step":
    cfg.mesh.trainer.update(data=1, fsdp=2, tensor=2)
    cfg.rl.group_size = 3  # 3 x 3 = 9 rollouts over 2 data-parallel trainer devices
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg, num_devices=8)
  msg = str(e.value)
  assert "\n" not in msg
  for w in words:
    assert w in msg, msg


def test_colocated_single_device():
  cfg, _ = load("--config.mesh.colocated=true", "--config.mesh.sampler.data=1",
                "--config.mesh.trainer.data=1", "--config.mesh.trainer.fsdp=1",
                "--config.mesh.trainer.tensor=1")
  config_lib.validate(cfg, num_devices=1)
  from rl_jax.orchestration.policy import StalenessPolicy
  assert (StalenessPolicy.from_config(cfg.rl).max_inflight ==
          (cfg.rl.max_staleness + 1) * cfg.rl.groups_per_step)


def _flat(d, prefix=""):
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
  return out


def test_every_numeric_field_has_a_domain():
  numeric = {k for k, v in _flat(config_lib.base_config().to_dict()).items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
  # The mesh axes are checked per axis (>= 1, and the device count) in validate.
  assert numeric - {k for k in numeric if k.startswith("mesh.")} == set(config_lib.DOMAINS)


def _outside(spec, default):
  """A value just outside a DOMAINS spec, of the default's type."""
  if spec[0] in "[(":
    lo, hi = (float(x) for x in spec[1:-1].split(","))
    value = hi if spec[-1] == ")" else (lo if spec[0] == "(" else hi + 1)
  else:
    op, bound = spec.split()
    value = float(bound) - 1 if op == ">=" else float(bound)
  return type(default)(value)


@pytest.mark.parametrize("field", sorted(config_lib.DOMAINS))
def test_each_numeric_field_rejects_a_value_outside_its_domain(field):
  cfg, _ = load()
  group, key = field.rsplit(".", 1) if "." in field else ("", field)
  node = cfg[group] if group else cfg
  bad = _outside(config_lib.DOMAINS[field], node[key])
  node[key] = bad
  with pytest.raises(ConfigError) as e:
    config_lib.validate(cfg, num_devices=8)
  assert f"'{field}'" in str(e.value) and repr(bad) in str(e.value), str(e.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_floats_are_rejected(value):
  cfg, _ = load()
  cfg.trainer.learning_rate = value
  with pytest.raises(ConfigError, match="'trainer.learning_rate' must be finite"):
    config_lib.validate(cfg, num_devices=8)


def test_config_file_failures_name_the_file_and_line(tmp_path):
  boom = tmp_path / "boom.py"
  boom.write_text("x = 1\nraise RuntimeError('at import')\n")
  with pytest.raises(ConfigError, match=r"importing .*boom.py failed: RuntimeError: at import "
                                        r"\(.*boom.py:2\)"):
    load(spec=str(boom))
  inside = tmp_path / "inside.py"
  inside.write_text("def get_config(arg=None):\n  return 1 / 0\n")
  with pytest.raises(ConfigError, match=r"get_config\(\) failed: ZeroDivisionError: .*inside.py:2"):
    load(spec=str(inside))
  not_a_config = tmp_path / "not_a_config.py"
  not_a_config.write_text("def get_config(arg=None):\n  return {}\n")
  with pytest.raises(ConfigError, match="returned dict, not an ml_collections.ConfigDict"):
    load(spec=str(not_a_config))


def test_legacy_boolean_remat_maps_to_a_policy(tmp_path):
  old = tmp_path / "old.py"
  old.write_text("from configs import default\n"
                 "def get_config(arg=None):\n"
                 "  c = default.get_config(arg)\n"
                 "  c.model.remat = True\n"
                 "  return c\n")
  cfg, _ = load(spec=str(old))
  assert cfg.model.remat == "full"
  cfg, _ = load("--config.model.remat=false")
  config_lib.validate(cfg, num_devices=8)
  assert cfg.model.remat == "none"
  cfg, _ = load("--config.model.remat=dots", "--config.model.attention=xla")
  config_lib.validate(cfg, num_devices=8)
  assert (cfg.model.remat, cfg.model.attention) == ("dots", "xla")


def test_model_dtype_auto_resolves_by_backend():
  """The default compute dtype is auto: bf16 on GPU / TPU, float32 on CPU (this host)."""
  from rl_jax import model as model_lib
  from rl_jax.model.presets import resolve_dtype
  cfg, _ = load()
  assert cfg.model.dtype == "auto" and cfg.model.param_dtype == "float32"
  assert [resolve_dtype("auto", b) for b in ("gpu", "tpu", "cpu")] == [
      "bfloat16", "bfloat16", "float32"]
  assert resolve_dtype("float32", "gpu") == "float32"
  model_cfg, _ = model_lib.from_run_config(cfg.model)
  assert (model_cfg.dtype, model_cfg.param_dtype) == ("float32", "float32")


def test_steps_per_call_is_auto_or_a_positive_integer(tmp_path):
  from rl_jax.sampler import engine
  cfg, _ = load()
  assert cfg.sampler.steps_per_call == "auto"
  config_lib.validate(cfg, num_devices=8)
  assert engine.resolve_steps_per_call("auto", "gpu") == engine.ACCELERATOR_STEPS_PER_CALL
  assert engine.resolve_steps_per_call("auto", "cpu") == engine.CPU_STEPS_PER_CALL
  cfg, _ = load("--config.sampler.steps_per_call=3")
  assert cfg.sampler.steps_per_call == 3 and engine.resolve_steps_per_call(3, "gpu") == 3
  config_lib.validate(cfg, num_devices=8)
  for text in ("0", "fast", "2.5", "True"):
    with pytest.raises(ConfigError, match=r"^config field 'sampler.steps_per_call' must be "
                                          r"'auto' or an integer >= 1; got .+$"):
      load(f"--config.sampler.steps_per_call={text}")
  # A config file may set an integer, or a bad value that validate names.
  path = tmp_path / "spc.py"
  path.write_text("from configs import default\n"
                  "def get_config(arg=None):\n"
                  "  c = default.get_config()\n"
                  "  c.sampler.steps_per_call = int(arg or 8)\n"
                  "  return c\n")
  cfg, _ = load(spec=str(path))
  assert cfg.sampler.steps_per_call == 8
  cfg, _ = load("--config.sampler.steps_per_call=auto", spec=str(path))
  assert cfg.sampler.steps_per_call == "auto"
  cfg.sampler.steps_per_call = -2
  with pytest.raises(ConfigError, match="'sampler.steps_per_call' must be 'auto' or an integer"):
    config_lib.validate(cfg, num_devices=8)

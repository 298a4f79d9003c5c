"""Loading, overriding and validating experiment configs.

A config file defines `get_config(arg=None) -> ml_collections.ConfigDict`. On the command
line:

  --config configs/default.py                 the file's get_config()
  --config configs/default.py:mode=sync       get_config("mode=sync")
  --config.rl.max_staleness=2                 one field (also `--config.rl.max_staleness 2`)

Every field must exist in configs/base.py with the same type. `validate` checks values
and the device count; each problem is one `ConfigError` sentence naming the field.
"""
from __future__ import annotations

import ast
import importlib.util
import math
import os
import sys
from typing import Any, Sequence

import ml_collections

from rl_jax.errors import UserError

_BASE_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "configs", "base.py")


class ConfigError(UserError, ValueError):
  """A user mistake in a config file or override: one sentence naming the field."""


def _load_module(path: str):
  # Config files import each other as `configs.<name>`: make the repo root importable.
  root = os.path.dirname(os.path.dirname(_BASE_PATH))
  if root not in sys.path:
    sys.path.insert(0, root)
  if not os.path.isfile(path):
    raise ConfigError(f"--config: file {path!r} does not exist")
  name = "rl_jax_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ConfigError(f"--config: {path}:{e.lineno}: syntax error: {e.msg}") from None
  except Exception as e:  # noqa: BLE001  (whatever the user's file raises)
    raise ConfigError(f"--config: importing {path} failed: {type(e).__name__}: {e}"
                      f"{_where_in(e, path)}") from None
  if not hasattr(module, "get_config"):
    raise ConfigError(f"--config: {path} defines no get_config(arg=None)")
  return module


def _where_in(e: BaseException, path: str) -> str:
  """" (<path>:<line>)" of the innermost traceback frame in `path`, else ""."""
  line = None
  tb = e.__traceback__
  while tb is not None:
    if os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(path):
      line = tb.tb_lineno
    tb = tb.tb_next
  return "" if line is None else f" ({path}:{line})"


def base_config() -> ml_collections.ConfigDict:
  return _load_module(_BASE_PATH).get_config()


def load_file(spec: str) -> ml_collections.ConfigDict:
  """Loads `path[:arg]` and checks its fields against the base tree."""
  path, _, arg = spec.partition(":")
  module = _load_module(path)
  try:
    cfg = module.get_config(arg or None)
  except ConfigError:
    raise
  except Exception as e:  # noqa: BLE001  (whatever the user's get_config raises)
    call = f"get_config({arg!r})" if arg else "get_config()"
    kind = "" if isinstance(e, (ValueError, KeyError, TypeError, AttributeError)) else (
        f"{type(e).__name__}: ")
    raise ConfigError(f"--config {spec}: {call} failed: {kind}{e}{_where_in(e, path)}") from None
  if not isinstance(cfg, ml_collections.ConfigDict):
    raise ConfigError(f"--config {spec}: get_config returned {type(cfg).__name__}, "
                      "not an ml_collections.ConfigDict")
  check_fields(cfg, base_config())
  return cfg


def _type_name(v) -> str:
  return type(v).__name__


def check_fields(cfg, base, prefix: str = "") -> None:
  """Every field of `cfg` exists in `base` with a compatible type."""
  for key in cfg.keys():
    name = prefix + key
    if key not in base:
      allowed = ", ".join(sorted(base.keys()))
      raise ConfigError(f"unknown config field {name!r}; fields here are: {allowed}")
    v, b = cfg[key], base[key]
    if name == "model.remat" and (isinstance(v, bool) or str(v).lower() in ("true", "false")):
      # Configs written when remat was a boolean keep working.
      with cfg.ignore_type():
        cfg[key] = v = "full" if str(v).lower() == "true" else "none"
    if isinstance(b, ml_collections.ConfigDict):
      if not isinstance(v, ml_collections.ConfigDict):
        raise ConfigError(f"config field {name!r} must be a group of fields, got {v!r}")
      check_fields(v, b, name + ".")
    elif name in INT_OR_AUTO:
      _check_int_or_auto(name, v)
    elif not _compatible(v, b):
      raise ConfigError(
          f"config field {name!r} must be {_type_name(b)}, got {_type_name(v)} {v!r}")


def _compatible(v, b) -> bool:
  if isinstance(b, bool) or isinstance(v, bool):
    return isinstance(v, bool) and isinstance(b, bool)
  if isinstance(b, float):
    return isinstance(v, (int, float))
  if isinstance(b, (tuple, list)):
    return isinstance(v, (tuple, list))
  return isinstance(v, type(b))


def _parse_value(text: str, default: Any, name: str):
  if isinstance(default, bool):
    low = text.strip().lower()
    if low in ("true", "1", "yes"):
      return True
    if low in ("false", "0", "no"):
      return False
    raise ConfigError(f"--config.{name} must be true or false, got {text!r}")
  if isinstance(default, str):
    return text
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    raise ConfigError(
        f"--config.{name} must be {_type_name(default)}, got {text!r}") from None
  if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if isinstance(default, tuple) and isinstance(value, list):
    value = tuple(value)
  if isinstance(default, tuple) and isinstance(value, (int, float)):
    value = (value,)
  if not _compatible(value, default):
    raise ConfigError(
        f"--config.{name} must be {_type_name(default)}, got {_type_name(value)} {text!r}")
  return value


def apply_override(cfg, dotted: str, text: str) -> None:
  """Sets `cfg.<dotted>` from the command-line string `text`, typed by the default."""
  parts = dotted.split(".")
  node = cfg
  for i, part in enumerate(parts):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      where = ".".join(parts[:i]) or "the config"
      allowed = ", ".join(sorted(node.keys())) if isinstance(node, ml_collections.ConfigDict) else ""
      raise ConfigError(f"unknown config field {dotted!r}: {where} has no field {part!r}"
                        + (f" (fields: {allowed})" if allowed else ""))
    if i < len(parts) - 1:
      node = node[part]
  default = node[parts[-1]]
  if isinstance(default, ml_collections.ConfigDict):
    raise ConfigError(f"--config.{dotted} is a group of fields; set one of its fields")
  if dotted in INT_OR_AUTO:
    try:
      value = ast.literal_eval(text.strip()) if text.strip() != "auto" else "auto"
    except (ValueError, SyntaxError):
      value = text
    _check_int_or_auto(dotted, value)
  else:
    value = _parse_value(text, default, dotted)
  with node.ignore_type():
    node[parts[-1]] = value


def parse_args(argv: Sequence[str], default_config: str | None = None):
  """Splits argv into (config, remaining args). Understands --config and --config.x=v."""
  spec = default_config
  overrides: list[tuple[str, str]] = []
  rest: list[str] = []
  i = 0
  argv = list(argv)
  while i < len(argv):
    a = argv[i]
    if a == "--config" or a.startswith("--config="):
      if a == "--config":
        if i + 1 >= len(argv):
          raise ConfigError("--config needs a file, e.g. --config configs/default.py")
        spec = argv[i + 1]
        i += 2
      else:
        spec = a.split("=", 1)[1]
        i += 1
    elif a.startswith("--config."):
      body = a[len("--config."):]
      if "=" in body:
        key, text = body.split("=", 1)
        i += 1
      else:
        if i + 1 >= len(argv):
          raise ConfigError(f"--config.{body} needs a value")
        key, text = body, argv[i + 1]
        i += 2
      overrides.append((key, text))
    else:
      rest.append(a)
      i += 1
  if spec is None:
    raise ConfigError("--config is required, e.g. --config configs/default.py")
  cfg = load_file(spec)
  for key, text in overrides:
    apply_override(cfg, key, text)
  return cfg, rest


def _require(cond: bool, msg: str) -> None:
  if not cond:
    raise ConfigError(msg)


def _choice(cfg, dotted: str, allowed: Sequence[str]) -> None:
  value = cfg
  for p in dotted.split("."):
    value = value[p]
  _require(value in allowed, f"config field {dotted!r} must be one of "
           f"{', '.join(map(repr, allowed))}; got {value!r}")


def _check_lora(section) -> None:
  """ConfigError naming a bad model.lora.targets (the numbers are DOMAINS entries)."""
  from rl_jax.model.presets import LORA_TARGETS
  targets = [t.strip() for t in str(section.targets).split(",") if t.strip()]
  bad = [t for t in targets if t not in LORA_TARGETS]
  _require(bool(targets) and not bad and len(set(targets)) == len(targets),
           f"config field 'model.lora.targets' must be distinct names from "
           f"{','.join(LORA_TARGETS)}; got {section.targets!r}")


def _check_files(cfg) -> None:
  """What a chat-formatted run needs beyond check_inputs: the checkpoint's own tokenizer."""
  if cfg.data.chat:
    _require(bool(cfg.model.path), "config field 'model.path' is empty; data.chat=True prompts "
             "with the checkpoint's own tokenizer and chat template: pass "
             "--config.model.path=/path/to/hf_checkpoint_dir")
    _require(cfg.warmstart.steps == 0, "config field 'warmstart.steps' must be 0 with "
             f"data.chat=True (demonstrations are not chat-formatted); got {cfg.warmstart.steps}")


# The domain of every numeric field of configs/base.py: ">= x", "> x", or an interval
# "[a, b)" etc. Floats must also be finite. Cross-field rules are in `validate`.
DOMAINS = {
    "seed": ">= 0",
    "model.lora.rank": ">= 0", "model.lora.alpha": "> 0", "model.lora.dropout": "[0, 1)",
    "sampler.max_concurrent_decodes": ">= 1", "sampler.page_size": ">= 1",
    "sampler.num_pages": ">= 0", "sampler.kv_cache_bytes": ">= 1",
    "sampler.max_prefill_length": ">= 1", "sampler.max_new_tokens": ">= 1",
    "sampler.temperature": ">= 0", "sampler.top_k": ">= 0", "sampler.top_p": "(0, 1]",
    "trainer.learning_rate": "> 0", "trainer.warmup_steps": ">= 0",
    "trainer.weight_decay": ">= 0", "trainer.b1": "[0, 1)", "trainer.b2": "[0, 1)",
    "trainer.grad_clip": ">= 0", "trainer.micro_batch_size": ">= 0",
    "trainer.logprob_chunk_len": ">= 0", "trainer.logprob_save_bytes": ">= 0",
    "trainer.num_minibatches": ">= 1", "trainer.eps_low": "[0, 1]", "trainer.eps_high": ">= 0",
    "trainer.tis_cap": ">= 0", "trainer.kl_beta": ">= 0", "trainer.loss_norm_len": ">= 0",
    "rl.total_steps": ">= 1", "rl.groups_per_step": ">= 1", "rl.group_size": ">= 2",
    "rl.max_staleness": ">= 0", "rl.max_inflight_groups": ">= -1", "rl.queue_maxsize": ">= 1",
    "rl.weight_sync_every": ">= 1", "rl.eval_every": ">= 0", "rl.verifier_patience_s": "> 0",
    "rl.max_oversample": ">= 1", "rl.overlong_buffer": ">= 0", "rl.control_every": ">= 3",
    "warmstart.steps": ">= 0", "warmstart.batch_size": ">= 1", "warmstart.learning_rate": "> 0",
    # 10**digits must fit the int64 the procedural tasks draw operands with.
    "task.digits": "[1, 18]", "task.num_terms": ">= 2", "task.format_reward": ">= 0",
    "task.heldout_size": ">= 1", "task.heldout_fraction": "(0, 1)",
    "task.tool_demo_fraction": "[0, 1]", "task.working_demo_fraction": "[0, 1]",
    "env.max_turns": ">= 1", "env.max_total_tokens": ">= 0", "env.tool.workers": ">= 1",
    "env.tool.timeout_s": "> 0", "env.tool.retries": ">= 0", "env.tool.latency_mean_s": ">= 0",
    "env.tool.latency_sigma": "> 0", "env.tool.latency_alpha": "> 0",
    "env.tool.failure_prob": "[0, 1]",
    "verifier.workers": ">= 1", "verifier.timeout_s": "> 0", "verifier.retries": ">= 0",
    "verifier.latency_mean_s": ">= 0", "verifier.latency_sigma": "> 0",
    "verifier.latency_alpha": "> 0", "verifier.failure_prob": "[0, 1]",
    "data.num_epochs": ">= 0", "data.max_prompt_length": ">= 1",
    "checkpoint.every": ">= 0", "checkpoint.keep": ">= 1", "checkpoint.grace_period_s": "> 0",
    "metrics.log_every": ">= 1",
}
# What a value means at the edge of its domain, appended to the error.
_DOMAIN_NOTES = {
    "sampler.num_pages": "0 = derive from sampler.kv_cache_bytes", "sampler.top_k": "0 = off",
    "trainer.micro_batch_size": "0 = whole batch", "trainer.tis_cap": "0 = off",
    "trainer.grad_clip": "0 = off",
    "trainer.loss_norm_len": "0 = sampler.max_new_tokens",
    "trainer.logprob_chunk_len": "0 = whole sequence",
    "trainer.logprob_save_bytes": "0 = always recompute the lm head's logits",
    "rl.max_staleness": "0 = on-policy only",
    "rl.control_every": "a window needs 3 logged steps to refit the planner's models", "rl.max_inflight_groups": "-1 = auto",
    "rl.group_size": "group advantages compare completions of one prompt",
    "checkpoint.every": "0 = off", "rl.eval_every": "0 = only at start and end",
    "env.max_total_tokens": "0 = sampler.max_new_tokens",
}
# A checkpoint continues a run only with the same values of these fields (prefixes end
# with "."): they define the model's shapes, the prompt stream its saved iterator state
# indexes into, and the sampling seeds. task.heldout_size only changes the evaluation
# set, model.remat only what the backward pass recomputes and model.attention only which
# kernel computes the same function.
# Fields that take "auto" or an integer >= 1 (their base value is "auto").
INT_OR_AUTO = ("sampler.steps_per_call",)
RESUME_MUST_MATCH = ("seed", "model.", "task.", "data.")
RESUME_MAY_DIFFER = ("task.heldout_size", "model.remat", "model.attention")


def resume_must_match(key: str) -> bool:
  """Whether a flat field name must equal the checkpoint's value to resume from it."""
  return key not in RESUME_MAY_DIFFER and any(
      key == p or (p.endswith(".") and key.startswith(p)) for p in RESUME_MUST_MATCH)


def in_domain(value, spec: str) -> bool:
  """Whether a number lies in a DOMAINS spec (">= 1", "> 0", "[0, 1)", ...)."""
  if isinstance(value, float) and not math.isfinite(value):
    return False
  if spec[0] in "[(":
    lo, hi = (float(x) for x in spec[1:-1].split(","))
    above = value >= lo if spec[0] == "[" else value > lo
    return above and (value <= hi if spec[-1] == "]" else value < hi)
  op, bound = spec.split()
  return value >= float(bound) if op == ">=" else value > float(bound)


def _get(cfg, dotted: str):
  for p in dotted.split("."):
    cfg = cfg[p]
  return cfg


def _check_int_or_auto(name: str, value) -> None:
  ok = value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
  _require(ok, f"config field {name!r} must be 'auto' or an integer >= 1; got {value!r}")


def check_domains(cfg) -> None:
  """ConfigError naming the first numeric field outside its DOMAINS entry (or an
  INT_OR_AUTO field that is neither "auto" nor an integer >= 1)."""
  for name in INT_OR_AUTO:
    _check_int_or_auto(name, _get(cfg, name))
  for name, spec in DOMAINS.items():
    value = _get(cfg, name)
    if not in_domain(value, spec):
      rule = f"in {spec}" if spec[0] in "[(" else spec
      note = f" ({_DOMAIN_NOTES[name]})" if name in _DOMAIN_NOTES else ""
      finite = "finite and " if isinstance(value, float) and not math.isfinite(value) else ""
      raise ConfigError(f"config field {name!r} must be {finite}{rule}{note}; got {value!r}")


def check_before_jax(cfg) -> None:
  """The checks that need no devices (domains, task, model, files): launch scripts run
  them before JAX starts, so a mistake costs no start-up time."""
  check_domains(cfg)
  check_inputs(cfg)


def flatten(d: dict, prefix: str = "") -> dict:
  """A nested dict (a config's to_dict()) as {"a.b.c": value}, tuples as lists."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, prefix + k + "."))
    else:
      out[prefix + k] = list(v) if isinstance(v, tuple) else v
  return out


def check_inputs(cfg) -> None:
  """ConfigError naming the field when the task, model or a file it names cannot be used;
  reads no file beyond checking that it exists and can be opened."""
  from rl_jax import tasks
  from rl_jax.model import presets
  t = cfg.task
  _require(t.name in tasks.task_names(), f"config field 'task.name' must be one of "
           f"{', '.join(map(repr, tasks.task_names()))}; got {t.name!r}")
  if t.name in ("gsm8k", "jsonl"):  # the file's records are read when the run starts
    _require(bool(t.path), f"config field 'task.path' is empty; task.name={t.name!r} reads "
             "a .parquet or .jsonl file: pass --config.task.path=FILE")
    _readable_file("task.path", t.path)
    if t.eval_path:
      _readable_file("task.eval_path", t.eval_path)
  else:
    try:  # a procedural task's constructor is cheap and checks task.operators per task
      tasks.make_task(t, seed=cfg.seed, on_bad_line=cfg.data.on_bad_line)
    except tasks.TaskError as e:
      raise ConfigError(f"config field 'task': {e}") from None
  for section in ("verifier", "env.tool"):
    sub = _get(cfg, section)
    if sub.latency == "empirical":
      _readable_file(f"{section}.latency_file", sub.latency_file)
  _require(cfg.model.preset in presets.PRESETS, f"config field 'model.preset' must be one of "
           f"{', '.join(map(repr, sorted(presets.PRESETS)))}; got {cfg.model.preset!r}")
  if cfg.model.path:
    _require(os.path.isdir(cfg.model.path), f"config field 'model.path': {cfg.model.path!r} "
             "is not a directory (a Hugging Face checkpoint directory is expected)")
    _readable_file("model.path", os.path.join(cfg.model.path, "config.json"))


def _readable_file(field: str, path: str) -> None:
  _require(bool(path), f"config field {field!r} must name a file")
  _require(os.path.exists(path), f"config field {field!r}: file {path!r} does not exist")
  _require(os.path.isfile(path), f"config field {field!r}: {path!r} is not a regular file")
  try:
    with open(path, "rb"):
      pass
  except OSError as e:
    raise ConfigError(f"config field {field!r}: file {path!r} cannot be read "
                      f"({e.strerror})") from None


def validate(cfg, num_devices: int | None = None) -> ml_collections.ConfigDict:
  """Checks values; returns cfg. Raises ConfigError naming the first bad field."""
  from rl_jax import sharding  # jax import deferred so a bad config fails fast

  check_fields(cfg, base_config())
  _choice(cfg, "rl.mode", ("sync", "async"))
  _choice(cfg, "rl.filter_groups", ("none", "zero_variance"))
  _choice(cfg, "rl.overlong", ("none", "mask", "penalty"))
  _choice(cfg, "rl.control", ("auto", "off", "admission"))
  _choice(cfg, "rl.queue_order", ("fifo", "oldest_version"))
  _choice(cfg, "checkpoint.rollouts", ("off", "queued", "all"))
  _choice(cfg, "model.dtype", ("auto", "float32", "bfloat16"))
  _choice(cfg, "model.param_dtype", ("float32", "bfloat16"))
  _choice(cfg, "model.remat", ("none", "full", "dots"))
  _choice(cfg, "model.attention", ("auto", "jnp", "xla", "cudnn", "splash"))
  _check_lora(cfg.model.lora)
  _choice(cfg, "sampler.dtype", ("auto", "float32", "bfloat16"))
  _choice(cfg, "sampler.layers", ("auto", "unrolled", "scan"))
  _choice(cfg, "sampler.attention", ("auto", "jnp", "pallas_tpu", "pallas_gpu", "ragged"))
  _choice(cfg, "sampler.compile", ("auto", "inline", "background", "ahead"))
  _require(cfg.sampler.compile != "background" or cfg.rl.mode == "async",
           "config field 'sampler.compile' may be 'background' only with rl.mode='async' "
           "(sync runs are reproducible bit for bit); got rl.mode='sync'")
  _choice(cfg, "trainer.loss_agg", ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"))
  _choice(cfg, "trainer.schedule", ("constant", "cosine"))
  _choice(cfg, "trainer.ratio_level", ("token", "sequence"))
  _choice(cfg, "trainer.kl_estimator", ("k1", "k3"))
  _choice(cfg, "trainer.packing", ("auto", "off"))
  _choice(cfg, "verifier.backend", ("threads", "processes"))
  _choice(cfg, "verifier.latency", ("none", "fixed", "lognormal", "pareto", "empirical"))
  _choice(cfg, "verifier.on_error", ("drop", "zero"))
  _choice(cfg, "env.tool.backend", ("threads", "processes"))
  _choice(cfg, "env.tool.latency", ("none", "fixed", "lognormal", "pareto", "empirical"))
  _choice(cfg, "data.on_long_prompt", ("truncate", "drop"))
  _choice(cfg, "data.on_bad_line", ("skip", "fail"))
  _choice(cfg, "task.matcher", ("exact", "numeric", "regex"))
  check_domains(cfg)
  _check_cross_fields(cfg)
  _check_mesh(cfg, sharding, num_devices)
  check_inputs(cfg)
  return cfg


def _check_cross_fields(cfg) -> None:
  rl, s, t = cfg.rl, cfg.sampler, cfg.trainer
  if rl.mode == "async":
    from rl_jax.orchestration.policy import StalenessPolicy  # imports no jax
    stall = StalenessPolicy.from_config(rl).stall_reason()
    _require(not stall, f"config fields 'rl.max_inflight_groups', 'rl.max_staleness', "
             f"'rl.groups_per_step', 'rl.weight_sync_every': {stall}")
  if rl.overlong == "penalty":
    _require(1 <= rl.overlong_buffer <= s.max_new_tokens,
             f"config field 'rl.overlong_buffer' must be in [1, sampler.max_new_tokens = "
             f"{s.max_new_tokens}] with rl.overlong=penalty; got {rl.overlong_buffer}")
  _require(len(t.length_buckets) > 0 and list(t.length_buckets) == sorted(t.length_buckets)
           and all(isinstance(b, int) and b >= 1 for b in t.length_buckets),
           f"config field 'trainer.length_buckets' must be a non-empty increasing tuple of "
           f"positive integers; got {t.length_buckets}")
  need_len = cfg.data.max_prompt_length + s.max_new_tokens
  _require(max(t.length_buckets) >= need_len,
           f"config field 'trainer.length_buckets' must reach data.max_prompt_length + "
           f"sampler.max_new_tokens = {need_len}; largest is {max(t.length_buckets)}")
  for section in ("verifier", "env.tool"):
    sub = _get(cfg, section)
    if sub.latency == "pareto":
      _require(sub.latency_alpha > 1.0, f"config field '{section}.latency_alpha' must be > 1 "
               f"for a finite-mean Pareto; got {sub.latency_alpha}")
  _require(cfg.env.max_total_tokens <= s.max_new_tokens,
           f"config field 'env.max_total_tokens' ({cfg.env.max_total_tokens}) must be <= "
           f"sampler.max_new_tokens ({s.max_new_tokens}), the longest completion the sampler "
           "caches (0 = sampler.max_new_tokens)")
  _check_files(cfg)


def _check_mesh(cfg, sharding, num_devices: int | None) -> None:
  mesh, rl, s, t = cfg.mesh, cfg.rl, cfg.sampler, cfg.trainer
  for role, axes in (("sampler", ("data", "tensor")), ("trainer", ("data", "fsdp", "tensor"))):
    sub = mesh[role]
    for key in sub.keys():
      _require(key in axes, f"config field 'mesh.{role}.{key}' is not a mesh axis; "
               f"allowed: {', '.join(axes)}")
      _require(isinstance(sub[key], int) and sub[key] >= 1,
               f"config field 'mesh.{role}.{key}' must be an integer >= 1; got {sub[key]!r}")
  if num_devices is None:
    import jax
    num_devices = jax.device_count()
  ns, nt, need = sharding.mesh_devices(mesh)
  _require(need <= num_devices,
           f"config field 'mesh' asks for {need} devices (sampler "
           f"{dict(mesh.sampler)}, trainer {dict(mesh.trainer)}, colocated={mesh.colocated}) "
           f"but {num_devices} exist")
  if mesh.colocated:
    _require(ns == nt, f"config field 'mesh': colocated sampler ({ns} devices) and trainer "
             f"({nt} devices) must use the same devices")
  trainer_dp = mesh.trainer.get("data", 1) * mesh.trainer.get("fsdp", 1)
  batch = rl.groups_per_step * rl.group_size
  _require(batch % trainer_dp == 0,
           f"config fields 'rl.groups_per_step' x 'rl.group_size' = {batch} rollouts per step "
           f"must divide across the trainer's data-parallel devices (data x fsdp = {trainer_dp})")
  if t.micro_batch_size:
    _require(batch % t.micro_batch_size == 0 and t.micro_batch_size % trainer_dp == 0,
             f"config field 'trainer.micro_batch_size' ({t.micro_batch_size}) must divide the "
             f"batch ({batch}) and be a multiple of the trainer's data-parallel size ({trainer_dp})")
  sampler_dp = mesh.sampler.get("data", 1)
  _require(s.max_concurrent_decodes % sampler_dp == 0,
           f"config field 'sampler.max_concurrent_decodes' ({s.max_concurrent_decodes}) must divide "
           f"across the sampler's data-parallel devices ({sampler_dp})")

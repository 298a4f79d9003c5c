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

_BASE_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "configs", "base.py")


class ConfigError(ValueError):
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
  if not hasattr(module, "get_config"):
    raise ConfigError(f"--config: {path} defines no get_config(arg=None)")
  return module


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
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    call = f"get_config({arg!r})" if arg else "get_config()"
    raise ConfigError(f"--config {spec}: {call} failed: {e}") from None
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
    if isinstance(b, ml_collections.ConfigDict):
      if not isinstance(v, ml_collections.ConfigDict):
        raise ConfigError(f"config field {name!r} must be a group of fields, got {v!r}")
      check_fields(v, b, name + ".")
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


def parse_args_or_exit(argv: Sequence[str]):
  """parse_args for launch scripts: a user mistake exits with one `error:` line."""
  try:
    return parse_args(argv)
  except ConfigError as e:
    sys.exit(f"error: {e}")


def _require(cond: bool, msg: str) -> None:
  if not cond:
    raise ConfigError(msg)


def _choice(cfg, dotted: str, allowed: Sequence[str]) -> None:
  value = cfg
  for p in dotted.split("."):
    value = value[p]
  _require(value in allowed, f"config field {dotted!r} must be one of "
           f"{', '.join(map(repr, allowed))}; got {value!r}")


def max_inflight_groups(cfg) -> int:
  """Admission bound: in-flight + queued groups <= this."""
  if cfg.rl.max_inflight_groups >= 0:
    return int(cfg.rl.max_inflight_groups)
  return (cfg.rl.max_staleness + 1) * cfg.rl.groups_per_step


def validate(cfg, num_devices: int | None = None) -> ml_collections.ConfigDict:
  """Checks values; returns cfg. Raises ConfigError naming the first bad field."""
  from rl_jax import sharding  # jax import deferred so a bad config fails fast

  check_fields(cfg, base_config())
  _choice(cfg, "rl.mode", ("sync", "async"))
  _choice(cfg, "model.dtype", ("float32", "bfloat16"))
  _choice(cfg, "model.param_dtype", ("float32", "bfloat16"))
  _choice(cfg, "sampler.dtype", ("auto", "float32", "bfloat16"))
  _choice(cfg, "sampler.layers", ("auto", "unrolled", "scan"))
  _choice(cfg, "sampler.attention", ("auto", "jnp", "pallas_tpu", "ragged"))
  _choice(cfg, "trainer.loss_agg", ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"))
  _choice(cfg, "trainer.schedule", ("constant", "cosine"))
  _choice(cfg, "trainer.ratio_level", ("token", "sequence"))
  _choice(cfg, "trainer.kl_estimator", ("k1", "k3"))
  _choice(cfg, "verifier.backend", ("threads", "processes"))
  _choice(cfg, "verifier.latency", ("none", "fixed", "lognormal", "pareto", "empirical"))
  _choice(cfg, "data.on_long_prompt", ("truncate", "drop"))
  _choice(cfg, "data.on_bad_line", ("skip", "fail"))
  _choice(cfg, "task.matcher", ("exact", "numeric", "regex"))

  rl = cfg.rl
  _require(rl.max_staleness >= 0,
           f"config field 'rl.max_staleness' must be >= 0 (0 = on-policy only); got {rl.max_staleness}")
  _require(rl.max_inflight_groups >= -1,
           f"config field 'rl.max_inflight_groups' must be -1 (auto) or >= 0; got {rl.max_inflight_groups}")
  for name in ("total_steps", "groups_per_step", "group_size", "queue_maxsize", "weight_sync_every"):
    _require(rl[name] >= 1, f"config field 'rl.{name}' must be >= 1; got {rl[name]}")
  _require(rl.group_size >= 2, f"config field 'rl.group_size' must be >= 2: group advantages "
           f"compare completions of one prompt; got {rl.group_size}")
  _require(rl.eval_every >= 0, f"config field 'rl.eval_every' must be >= 0; got {rl.eval_every}")
  if rl.mode == "async":
    _require(max_inflight_groups(cfg) >= rl.groups_per_step,
             f"config field 'rl.max_inflight_groups' ({rl.max_inflight_groups}) must be >= "
             f"rl.groups_per_step ({rl.groups_per_step}) or the trainer can never fill a batch")

  s = cfg.sampler
  for name in ("max_concurrent_decodes", "page_size", "max_prefill_length", "max_new_tokens",
               "steps_per_call"):
    _require(s[name] >= 1, f"config field 'sampler.{name}' must be >= 1; got {s[name]}")
  _require(s.num_pages >= 0, f"config field 'sampler.num_pages' must be >= 0; got {s.num_pages}")
  _require(s.temperature >= 0.0, f"config field 'sampler.temperature' must be >= 0; got {s.temperature}")
  _require(0.0 < s.top_p <= 1.0, f"config field 'sampler.top_p' must be in (0, 1]; got {s.top_p}")
  _require(s.top_k >= 0, f"config field 'sampler.top_k' must be >= 0 (0 = off); got {s.top_k}")

  t = cfg.trainer
  _require(t.learning_rate > 0, f"config field 'trainer.learning_rate' must be > 0; got {t.learning_rate}")
  _require(t.eps_low >= 0 and t.eps_high >= 0,
           f"config fields 'trainer.eps_low'/'trainer.eps_high' must be >= 0; got {t.eps_low}, {t.eps_high}")
  _require(t.tis_cap >= 0, f"config field 'trainer.tis_cap' must be >= 0 (0 = off); got {t.tis_cap}")
  _require(t.kl_beta >= 0, f"config field 'trainer.kl_beta' must be >= 0; got {t.kl_beta}")
  _require(t.num_minibatches >= 1, f"config field 'trainer.num_minibatches' must be >= 1; got {t.num_minibatches}")
  _require(t.micro_batch_size >= 0, f"config field 'trainer.micro_batch_size' must be >= 0; got {t.micro_batch_size}")
  _require(len(t.length_buckets) > 0 and list(t.length_buckets) == sorted(t.length_buckets),
           f"config field 'trainer.length_buckets' must be a non-empty increasing tuple; got {t.length_buckets}")
  need_len = cfg.data.max_prompt_length + s.max_new_tokens
  _require(max(t.length_buckets) >= need_len,
           f"config field 'trainer.length_buckets' must reach data.max_prompt_length + "
           f"sampler.max_new_tokens = {need_len}; largest is {max(t.length_buckets)}")

  mesh = cfg.mesh
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
  need = sharding.required_devices(mesh)
  _require(need <= num_devices,
           f"config field 'mesh' asks for {need} devices (sampler "
           f"{dict(mesh.sampler)}, trainer {dict(mesh.trainer)}, colocated={mesh.colocated}) "
           f"but {num_devices} exist")
  if mesh.colocated:
    ns = math.prod(dict(mesh.sampler).values())
    nt = math.prod(dict(mesh.trainer).values())
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
  _require(cfg.warmstart.steps >= 0, f"config field 'warmstart.steps' must be >= 0; got {cfg.warmstart.steps}")
  _require(cfg.task.heldout_size >= 1, f"config field 'task.heldout_size' must be >= 1; got {cfg.task.heldout_size}")
  _require(0.0 < cfg.task.heldout_fraction < 1.0,
           f"config field 'task.heldout_fraction' must be in (0, 1); got {cfg.task.heldout_fraction}")
  _require(cfg.verifier.workers >= 1, f"config field 'verifier.workers' must be >= 1; got {cfg.verifier.workers}")
  _require(cfg.verifier.timeout_s > 0, f"config field 'verifier.timeout_s' must be > 0; got {cfg.verifier.timeout_s}")
  _require(0.0 <= cfg.verifier.failure_prob <= 1.0,
           f"config field 'verifier.failure_prob' must be in [0, 1]; got {cfg.verifier.failure_prob}")
  if cfg.verifier.latency == "pareto":
    _require(cfg.verifier.latency_alpha > 1.0,
             f"config field 'verifier.latency_alpha' must be > 1 for a finite-mean Pareto; got {cfg.verifier.latency_alpha}")
  return cfg

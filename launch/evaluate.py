"""Held-out reward of a policy with greedy decoding (the evaluation train.py runs).

  python launch/evaluate.py --workdir runs/x [--step 40] [--config.sampler.max_new_tokens=64]
  python launch/evaluate.py --hf exported/x --config configs/default.py [--config.x=y ...]

A workdir brings its own run config (from the checkpoint); a Hugging Face directory is
scored on the task of --config. --config.<field>=<value> overrides either.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import cli  # noqa: E402  (imports no jax)
from rl_jax import config as config_lib  # noqa: E402


def _main(argv):
  parser = cli.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--workdir", help="a launch/train.py --workdir with checkpoints")
  source.add_argument("--hf", help="a Hugging Face checkpoint directory")
  parser.add_argument("--step", type=int, default=None, help="workdir step; default newest")
  parser.add_argument("--config", help="config file (required with --hf)")
  args, overrides = parser.parse_known_args(argv)
  from rl_jax import checkpoint as checkpoint_lib  # imports jax; starts no backend
  from rl_jax import model as model_lib
  from rl_jax.orchestration import runtime

  def override(cfg):
    for arg in overrides:
      if not arg.startswith("--config.") or "=" not in arg:
        raise config_lib.ConfigError(f"unknown argument {arg!r}; overrides look like "
                                     "--config.sampler.max_new_tokens=64")
      config_lib.apply_override(cfg, *arg[len("--config."):].split("=", 1))
    return cfg

  if args.hf:
    if not args.config:
      raise config_lib.ConfigError("--hf needs --config for the task and sampler settings")
    cfg = override(config_lib.load_file(args.config))
    cfg.model.path = args.hf
    runtime.prepare_host_devices(cfg)  # before jax starts: CPU runs get fake devices
    model_cfg, params = model_lib.from_pretrained(args.hf, dtype=cfg.model.param_dtype)
    has_tokenizer = os.path.exists(os.path.join(args.hf, "tokenizer.json"))
    tokenizer = model_lib.load_tokenizer(model_cfg, path=args.hf if has_tokenizer else "")
    what = args.hf
  else:
    # The device count comes from the run's config.json: reading the checkpoint starts jax.
    with open(os.path.join(args.workdir, "config.json")) as f:
      runtime.prepare_host_devices(override(checkpoint_lib.run_config_from_dict(json.load(f))))
    step, params, saved = checkpoint_lib.Checkpointer(
        args.workdir, read_only=True).restore_params(args.step)
    cfg = override(checkpoint_lib.run_config_from_dict(saved["run"]))
    model_cfg = checkpoint_lib.model_config_from_dict(saved["model"])
    tokenizer = model_lib.load_tokenizer(cfg.model.preset, path=cfg.model.path)
    what = f"{args.workdir} step {step}"
  config_lib.validate(cfg)
  from rl_jax.orchestration import heldout
  result = heldout.evaluate_params(cfg, model_cfg, params, tokenizer)
  tools = (f" tool-call rate {result['tool_call_rate']:.4f}" if "tool_call_rate" in result
           else "")
  print(f"held-out reward {result['reward_mean']:.4f} accuracy {result['accuracy']:.4f}{tools} "
        f"on {result['n']} prompts (greedy) of {what}")


def main(argv):
  return cli.run(_main, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

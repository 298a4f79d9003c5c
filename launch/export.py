"""Export a run's policy as a Hugging Face checkpoint (config.json + model.safetensors).

  python launch/export.py --workdir runs/x --out exported/x [--step 40]

Reads the newest readable checkpoint of the workdir (or --step); the result loads with
rl_jax.model.from_pretrained (and transformers). Tokenizer files of a run started from a
Hugging Face checkpoint (model.path) are copied along.
"""
import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import cli  # noqa: E402  (imports no jax)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "chat_template.jinja")


def _main(argv):
  parser = cli.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="a launch/train.py --workdir")
  parser.add_argument("--out", required=True, help="directory to write")
  parser.add_argument("--step", type=int, default=None, help="default: the newest")
  args = parser.parse_args(argv)
  # Host-only work: the checkpoint is read onto the CPU whatever accelerator is present.
  from rl_jax import checkpoint as checkpoint_lib
  from rl_jax import model as model_lib
  ck = checkpoint_lib.Checkpointer(args.workdir, read_only=True)
  step, params, config = ck.restore_params(args.step)
  model_cfg = checkpoint_lib.model_config_from_dict(config["model"])
  model_lib.save_pretrained(args.out, model_cfg, params)
  source = config["run"]["model"]["path"]
  for name in _TOKENIZER_FILES:
    if source and os.path.exists(os.path.join(source, name)):
      shutil.copy(os.path.join(source, name), os.path.join(args.out, name))
  print(f"exported step {step} of {args.workdir} to {args.out}")


def main(argv):
  return cli.run(_main, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""Export a run's policy as a Hugging Face checkpoint (config.json + model.safetensors),
or, for a LoRA run (model.lora.rank > 0), as a PEFT adapter.

  python launch/export.py --workdir runs/x --out exported/x [--step 40] [--merged]

Reads the newest readable checkpoint of the workdir (or --step). A full fine-tuning run
(or --merged) gives a checkpoint that loads with rl_jax.model.from_pretrained and
transformers; a LoRA run with --merged gives the merged weights W0 + (alpha/r) A B. A
LoRA run without --merged writes adapter_config.json + adapter_model.safetensors, which
load with `peft.PeftModel.from_pretrained(base, out)` where base is model.path, or, when
the run made its base (a random init or a supervised warm-up), the Hugging Face
checkpoint written to <out>/base.
Tokenizer files of a run started from a Hugging Face checkpoint (model.path) are copied.
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
  parser.add_argument("--merged", action="store_true",
                      help="LoRA run: write the full merged checkpoint, not the adapter")
  args = parser.parse_args(argv)
  # Host-only work: the checkpoint is read onto the CPU whatever accelerator is present.
  from rl_jax import checkpoint as checkpoint_lib
  from rl_jax import model as model_lib
  ck = checkpoint_lib.Checkpointer(args.workdir, read_only=True)
  hf_dirs = [args.out]  # Hugging Face dirs that get the tokenizer files
  if args.merged or not _is_lora(ck, args.step):
    step, params, config = ck.restore_params(args.step)
    model_cfg = checkpoint_lib.model_config_from_dict(config["model"])
    model_lib.save_pretrained(args.out, model_cfg, params)
  else:
    step, model_cfg, base_params, adapters, config = ck.restore_lora(args.step)
    base = config["run"]["model"]["path"]
    # A base the run made (random init and/or warm-up): PEFT needs it as a HF checkpoint.
    if config["lora_base"]["made_by_run"]:
      base = os.path.join(args.out, "base")
      model_lib.save_pretrained(base, model_cfg, base_params)
      hf_dirs.append(base)
    model_lib.save_peft_adapter(args.out, model_cfg, adapters, os.path.abspath(base))
    print(f"PEFT adapter (rank {model_cfg.lora_rank}) for the base {os.path.abspath(base)}")
  source = config["run"]["model"]["path"]
  for name in _TOKENIZER_FILES:
    if source and os.path.exists(os.path.join(source, name)):
      for d in hf_dirs:
        shutil.copy(os.path.join(source, name), os.path.join(d, name))
  print(f"exported step {step} of {args.workdir} to {args.out}")


def _is_lora(ck, step) -> bool:
  """Whether the run's checkpoint (`step`, else the newest) holds LoRA adapters; False
  when there is none, so that restore_params names what is missing."""
  steps = ck.steps()
  probe = step if step in steps else (steps[-1] if steps else None)
  return probe is not None and ck.read_json(probe, "config")["model"].get("lora_rank", 0) > 0


def main(argv):
  return cli.run(_main, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

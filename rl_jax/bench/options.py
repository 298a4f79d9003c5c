"""Flags of launch/bench.py's subcommands (train, sampler, suite) and problem sizes of
the benchmark suite; imports no jax, so `launch/bench.py` can build its parser before any
backend starts.

FULL sizes are the issue's accelerator shapes (decode at batch 64 and 256 with a 1k
context, train and prefill at 1k tokens); SMALL sizes (`--small`) let a CPU run the
whole suite in a few minutes. Every size also has its own flag, which wins over both.
"""
from __future__ import annotations

import argparse
import dataclasses

# Run order. cost and aot are opt-in (--cost / --cost-only, --aot / --aot-only): they
# only compile, which an accelerator's time is too dear for unless asked; they go first
# so a program that cannot fit is reported before anything runs.
SECTIONS = ("cost", "aot", "probes", "decode", "decode_tail", "prefill", "train", "sync",
            "anchor", "e2e")


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Problem sizes of every section; the defaults are the accelerator (FULL) ones."""
  decode_batches: tuple[int, ...] = (64, 256)
  ctx: int = 1024  # KV positions per decode slot
  page_size: int = 64  # the anchor's page size, so gathered bytes match
  steps_per_call: int = 16  # decode steps per generate call (the anchor's fori_loop)
  decode_calls: int = 5  # timed generate calls per batch size
  prefill_len: int = 1024
  train_batch: int = 16
  train_seq: int = 1024
  # Rows per trainer micro-batch (0: the whole batch); 8 keeps the 0.5B model's 16 x 1k
  # step with remat "dots" well inside 24 GiB (notes/PERFORMANCE.md, AOT figures).
  train_micro_batch: int = 8
  train_steps: int = 5
  train_warmup: int = 2
  copy_mib: int = 1024  # bytes copied by the bandwidth probe
  matmul_n: int = 8192  # n of the n x n x n bf16 matmul probe
  repeats: int = 10  # timed repetitions of probes, prefill and weight sync
  e2e_steps: int = 30
  e2e_max_new_tokens: int = 256
  e2e_groups_per_step: int = 16
  e2e_group_size: int = 8
  e2e_slots: int = 128
  e2e_steps_per_call: int = 8
  e2e_micro_batch: int = 16  # rows per trainer micro-batch: bounds full-vocab logits memory
  e2e_heldout: int = 32


FULL = Sizes()
SMALL = Sizes(
    decode_batches=(4, 16), ctx=64, page_size=16, steps_per_call=4, decode_calls=3,
    prefill_len=64, train_batch=4, train_seq=64, train_steps=2, train_warmup=1, copy_mib=16,
    matmul_n=256, repeats=3, e2e_steps=4, e2e_max_new_tokens=12, e2e_groups_per_step=4,
    e2e_group_size=4, e2e_slots=16, e2e_steps_per_call=4, e2e_micro_batch=0, e2e_heldout=8,
    train_micro_batch=0)


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(",") if x)


def _sections(text: str) -> tuple[str, ...]:
  names = tuple(x for x in text.split(",") if x)
  unknown = [x for x in names if x not in SECTIONS]
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown section(s) {unknown}; sections: {SECTIONS}")
  return names


def _list(text: str) -> tuple:
  """"1,4,auto" -> (1, 4, "auto")."""
  return tuple(x if x == "auto" else int(x) for x in text.split(","))


def add_train_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--preset", default="tiny_char")
  p.add_argument("--seq", type=int, default=256, help="tokens per row (prompt + completion)")
  p.add_argument("--batch", type=int, default=16, help="rollouts per step")
  p.add_argument("--steps", type=int, default=10, help="timed steps")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps (include compilation)")
  p.add_argument("--dtype", default="float32", help="compute dtype: float32 | bfloat16")
  p.add_argument("--remat", action="store_true", help="recompute layer activations")
  p.add_argument("--mesh", default="", help="trainer mesh data,fsdp,tensor (default: all data)")
  p.add_argument("--micro-batch", type=int, default=0)
  p.add_argument("--minibatches", type=int, default=1)
  p.add_argument("--kl-beta", type=float, default=0.0)
  p.add_argument("--peak-tflops", type=float, default=0.0,
                 help="peak dense TFLOP/s per device for MFU (e.g. 790 for an H200 in bf16)")


def add_sampler_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--preset", default="tiny_char")
  p.add_argument("--requests", type=int, default=0,
                 help="rollouts, all queued at once (0: 1024, with --peer 64)")
  p.add_argument("--median", type=int, default=12, help="median completion length")
  p.add_argument("--tail-frac", type=float, default=0.05, help="share of long completions")
  p.add_argument("--tail-mult", type=int, default=16, help="long length / median")
  p.add_argument("--batch", type=int, default=16, help="static batch size (sets the KV bytes)")
  p.add_argument("--slots", type=_list, default=(64,),
                 help="paged decode slots (a comma list with --peer)")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--steps-per-call", type=_list, default=(1,),
                 help="decode steps per generate call, or auto (a comma list with --peer)")
  p.add_argument("--recompute-requests", type=int, default=64,
                 help="run the quadratic recompute baseline on the first N requests (0: all)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--layers", default="auto", help="paged decode layer loop: auto | unrolled | scan")
  p.add_argument("--peer", action="store_true",
                 help="the peer workload (rl_jax/bench/peer.py) side by side with tunix if "
                      "installed; uses --requests (default 64 here), --prompt-len, --max-new, "
                      "--mixes, --repeats")
  p.add_argument("--prompt-len", type=int, default=16)
  p.add_argument("--max-new", type=int, default=128)
  p.add_argument("--mixes", default="uniform,long_tail", help="uniform and/or long_tail")
  p.add_argument("--repeats", type=int, default=3, help="interleaved timed runs per variant")


def add_suite_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--preset", default="qwen2_0_5b", help="model shape, random weights")
  p.add_argument("--small", action="store_true", help="CPU-sized problems (see options.SMALL)")
  p.add_argument("--skip", type=_sections, default=(),
                 help=f"comma-separated sections to skip, of {','.join(SECTIONS)}")
  p.add_argument("--aot", action="store_true",
                 help="also compile the accelerator-shaped programs and report their memory")
  p.add_argument("--aot-only", action="store_true", help="only the aot section")
  p.add_argument("--cost", action="store_true",
                 help="also report XLA's bytes and FLOPs per decode step (compile only)")
  p.add_argument("--cost-only", action="store_true", help="only the cost section")
  p.add_argument("--cost-presets", default="qwen2_0_5b,llama3_1b",
                 help="cost section: comma-separated model presets")
  p.add_argument("--cost-dtype", default="float32",
                 help="cost section: decode weights / KV dtype (float32: XLA:CPU compiles "
                      "bf16 with f32 copies, which would count as bytes)")
  p.add_argument("--out", default="", help="write the results as JSON here")
  p.add_argument("--dtype", default="bfloat16",
                 help="sampler weights / KV and trainer compute dtype (master params stay fp32)")
  p.add_argument("--remat", default="dots", choices=("none", "full", "dots"),
                 help="train section: layer remat policy (ModelConfig.remat; the anchor: full)")
  p.add_argument("--attention", default="auto",
                 choices=("auto", "jnp", "xla", "cudnn", "splash"),
                 help="full-sequence attention kernel for prefill and train (ModelConfig)")
  p.add_argument("--logprob-chunk", type=int, default=128,
                 help="train section: positions per lm-head chunk (0: whole sequence)")
  p.add_argument("--peak-tflops", type=float, default=790.0,
                 help="reference bf16 peak per device for a second MFU (DESIGN.md: H200)")
  p.add_argument("--ref-gbps", type=float, default=4300.0,
                 help="reference copy bandwidth for a second roofline (DESIGN.md: H200)")
  p.add_argument("--device-gib", type=float, default=139.0,
                 help="device memory the aot figures are compared with")
  p.add_argument("--anchor", default="",
                 help="plain-JAX anchor script (default: rl_jax/bench/reference.py)")
  p.add_argument("--e2e-config", default="configs/default.py",
                 help="config the e2e run starts from (relative paths: the repository)")
  p.add_argument("--workdir", default="", help="e2e workdir (default: a temporary folder)")
  for field in dataclasses.fields(Sizes):
    flag = "--" + field.name.replace("_", "-")
    kind = _ints if field.name == "decode_batches" else int
    full, small = getattr(FULL, field.name), getattr(SMALL, field.name)
    p.add_argument(flag, type=kind, default=None, help=f"size (full {full}, small {small})")


def sizes_from_args(args: argparse.Namespace) -> Sizes:
  base = SMALL if args.small else FULL
  given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)
           if getattr(args, f.name) is not None}
  return dataclasses.replace(base, **given)


def sections_from_args(args: argparse.Namespace) -> dict[str, str]:
  """{section: "" to run it, else why it is skipped}, in run order."""
  why = {}
  only = [s for s in ("aot", "cost") if getattr(args, f"{s}_only")]
  for s in SECTIONS:
    if only:
      why[s] = "" if s in only else ", ".join(f"--{o}-only" for o in only)
    elif s in args.skip:
      why[s] = "--skip"
    elif s in ("aot", "cost") and not getattr(args, s):
      why[s] = f"opt-in: --{s}"
    else:
      why[s] = ""
  return why

"""Benchmarks, one subcommand each; imports are lazy so each loads only what it needs.

  python launch/bench.py train [--preset tiny_char] [--seq 256] [--batch 16] [--steps 10]
  python launch/bench.py sampler [--preset tiny_char] [--requests 1024] [--median 12]
  python launch/bench.py sampler --peer [--slots 64,16] [--steps-per-call 1,4,8]
  python launch/bench.py suite [--preset qwen2_0_5b] [--small] [--skip e2e,...]
                               [--aot | --aot-only] [--cost | --cost-only]
                               [--cost-presets qwen2_0_5b,llama3_1b] [--out results.json]

train and sampler print one JSON line (for tools) and a small table (for people); suite
writes its JSON to --out and prints its table last (see notes/PERFORMANCE.md).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import cli  # noqa: E402  (imports no jax)
from rl_jax.bench import options  # noqa: E402  (argparse only, imports no jax)


def _table(row: dict, keys) -> str:
  width = max(len(k) for k in keys)
  fmt = lambda v: f"{v:,.4g}" if isinstance(v, float) else str(v)
  return "\n".join(f"{k:<{width}}  {fmt(row[k])}" for k in keys if k in row)


def train(args):
  """Tokens/s (and MFU against --peak-tflops per device) of the GRPO update."""
  import jax
  from configs import base
  from rl_jax import model
  from rl_jax.bench import trainer as benchmark

  model_cfg = model.get_preset(args.preset).replace(dtype=args.dtype, remat=args.remat)
  trainer_cfg = base.get_config().trainer
  trainer_cfg.micro_batch_size = args.micro_batch
  trainer_cfg.num_minibatches = args.minibatches
  trainer_cfg.kl_beta = args.kl_beta
  mesh = tuple(int(x) for x in args.mesh.split(",")) if args.mesh else (jax.device_count(), 1, 1)
  row = benchmark.run_train_benchmark(
      model_cfg, trainer_cfg, mesh_shape=mesh, batch=args.batch, seq_len=args.seq,
      steps=args.steps, warmup=args.warmup, peak_tflops=args.peak_tflops)
  print(json.dumps(row))
  print(_table(row, ("device", "mesh", "params", "dtype", "batch", "seq", "step_ms_p50",
                     "tokens_per_s", "loss_tokens_per_s", "achieved_tflops", "mfu")))


def sampler(args):
  """Rollout tokens/s and latency: recompute vs static dense batches vs paged continuous;
  with --peer, the peer workload: rl_jax per slot count and steps per call vs tunix."""
  from rl_jax.sampler.engine import resolve_steps_per_call

  args.steps_per_call = tuple(resolve_steps_per_call(s) for s in args.steps_per_call)
  args.requests = args.requests or (64 if args.peer else 1024)
  if args.peer:
    return _peer(args)
  if len(args.slots) > 1 or len(args.steps_per_call) > 1:
    sys.exit("error: --slots and --steps-per-call take one value each without --peer")
  from rl_jax.bench import sampler as benchmark

  row = benchmark.run_sampler_benchmark(
      preset=args.preset, requests=args.requests, median=args.median,
      tail_frac=args.tail_frac, tail_mult=args.tail_mult, batch=args.batch,
      slots=args.slots[0], page_size=args.page_size, steps_per_call=args.steps_per_call[0],
      recompute_requests=args.recompute_requests, seed=args.seed, layers=args.layers)
  print(json.dumps(row))
  print(_table(row, ("device", "preset", "requests", "median_len", "max_len", "tail_frac",
                     "static_batch", "paged_slots", "page_size", "kv_pages_budget",
                     "steps_per_call", "paged_layers", "paged_dtype", "paged_preemptions",
                     "recompute_requests")))
  methods = ("recompute", "static", "paged")
  cols = ("tokens_per_s", "latency_p50_s", "latency_p99_s", "kv_pages_used", "wall_s")
  print(f"{'method':<10}" + "".join(f"{c:>15}" for c in cols))
  for m in methods:
    print(f"{m:<10}" + "".join(f"{row[f'{m}_{c}']:>15,.4g}" for c in cols))
  print(f"paged/static tokens/s = {row['ratio_paged_over_static']:.2f}   "
        f"paged/recompute tokens/s = {row['ratio_paged_over_recompute']:.2f}")


def _peer(args):
  from rl_jax.bench import peer

  tunix = peer.tunix_available()
  if not tunix:
    print("tunix: not installed here, rl_jax rows only (the peer runs from a separate "
          "environment with google-tunix==0.1.7; see notes/PERFORMANCE.md)")
  rows = peer.run_peer_benchmark(
      slots=args.slots, steps_per_call=args.steps_per_call, mixes=tuple(args.mixes.split(",")),
      requests=args.requests, prompt_len=args.prompt_len, max_new=args.max_new,
      page_size=args.page_size, repeats=args.repeats, seed=args.seed, peer=tunix)
  for row in rows:
    print(json.dumps(row))
  print(peer.table(rows))


def suite(args):
  """Decode, prefill, train, weight sync, plain-JAX anchor, e2e, AOT memory and XLA cost on
  one device."""
  try:
    from rl_jax.bench import suite as suite_lib
  except ImportError as e:
    sys.exit(f"error: cannot import {e.name}: {e}; see notes/PERFORMANCE.md for the wheels "
             "the benchmark machine needs")
  sys.exit(suite_lib.main(args))


def _list(text: str) -> tuple:
  """"1,4,auto" -> (1, 4, "auto")."""
  return tuple(x if x == "auto" else int(x) for x in text.split(","))


def _main(argv):
  parser = cli.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("train", help=train.__doc__)
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
  p.set_defaults(fn=train)
  p = sub.add_parser("sampler", help=sampler.__doc__)
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
  p.set_defaults(fn=sampler)
  p = sub.add_parser("suite", help=suite.__doc__)
  options.add_suite_args(p)
  p.set_defaults(fn=suite)
  args = parser.parse_args(argv)
  return args.fn(args)


def main(argv=None):
  return cli.run(_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())

"""The subcommands of `launch/bench.py`: train, sampler (--peer) and suite, each given
the parsed flags (options.add_*_args). train and sampler print one JSON line (for
tools) and a small table (for people); suite writes its JSON to --out and prints its
table last. Imports are lazy so each subcommand loads only what it needs; importing
this module imports no jax.
"""
import json
import sys


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

"""GPU check of the Pallas paged decode kernel (sampler.attention = "pallas_gpu"): kernel vs
jnp correctness, one layer's attention time per tiling, and decode tokens/s of the engine
with each route (rl_jax/bench/paged_kernel.py; notes/PERFORMANCE.md).

  python launch/check_paged_kernel.py [--out $OUT/paged_kernel.json] [--preset qwen2_0_5b]
      [--batches 64,256] [--ctx 1024] [--sections correctness,attention,decode]
  python launch/check_paged_kernel.py --sections ptx   # no GPU: compile to PTX / SASS only

The JSON is rewritten after every section, and a section that fails records its error
and the run goes on, so a run cut short still leaves what it measured.
"""
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import cli  # noqa: E402  (imports no jax)


def _main(argv) -> int:
  ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                "paged_kernel.json"))
  ap.add_argument("--preset", default="qwen2_0_5b")
  ap.add_argument("--batches", default="64,256")
  ap.add_argument("--ctx", type=int, default=1024)
  ap.add_argument("--page-size", type=int, default=16)
  ap.add_argument("--steps-per-call", type=int, default=8)
  ap.add_argument("--calls", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--sections", default="correctness,attention,decode")
  args = ap.parse_args(argv)

  import jax
  from rl_jax import model
  from rl_jax.bench import measure, paged_kernel

  cfg = model.get_preset(args.preset)
  batches = [int(b) for b in args.batches.split(",")]
  sizes = dict(batches=batches, ctx=args.ctx, page_size=args.page_size)
  res = dict(jax=jax.__version__, backend=jax.default_backend(),
             device=jax.devices()[0].device_kind, preset=args.preset, **sizes)
  timed = set(args.sections.split(",")) - {"ptx"}
  copy_gbps = measure.copy_bandwidth(nbytes=1 << 30, repeats=10)["copy_gbps"] if timed else None
  res["copy_gbps"] = copy_gbps
  runs = dict(
      correctness=lambda: paged_kernel.correctness(cfg, **sizes),
      attention=lambda: paged_kernel.attention(cfg, repeats=args.repeats, **sizes),
      decode=lambda: paged_kernel.decode(cfg, steps_per_call=args.steps_per_call,
                                         calls=args.calls, copy_gbps=copy_gbps, **sizes),
      ptx=lambda: paged_kernel.ptx(cfg, **sizes))
  for name in args.sections.split(","):
    t0 = time.perf_counter()
    try:
      res[name] = runs[name]()
    except Exception as e:  # noqa: BLE001  (record it; the next section still runs)
      res[name] = dict(error=f"{type(e).__name__}: {e}"[:2000],
                       traceback=traceback.format_exc()[-4000:])
    res[name]["wall_s"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
      json.dump(res, f, indent=1)
    print(name, json.dumps(res[name])[:3000], flush=True)
  return 0


def main(argv=None):
  return cli.run(_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())

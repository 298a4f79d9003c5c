"""Serve a policy through JetStream's orchestrator and gRPC server on localhost.

  python launch/serve.py --config configs/default.py [--port 9000]
  python launch/serve.py --config configs/default.py --config.model.path=/ckpt/qwen2

Weights come from model.path (a Hugging Face checkpoint directory, e.g. one written by
rl_jax.model.save_pretrained) or, without one, the model.preset with random weights
(seed `seed`). The engine uses the `sampler` section (slots, pages, max lengths, dtype)
on one data replica with mesh.sampler.tensor-way tensor parallelism. Requests are
decoded greedily unless --temperature > 0.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import cli  # noqa: E402  (imports no jax)
from rl_jax import config as config_lib  # noqa: E402


def _main(argv):
  if cli.print_help(argv, __doc__):
    return 0
  cfg, rest = config_lib.parse_args(argv)
  config_lib.check_before_jax(cfg)
  parser = cli.ArgumentParser(description=__doc__)
  parser.add_argument("--port", type=int, default=9000)
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--top-k", type=int, default=0)
  parser.add_argument("--top-p", type=float, default=1.0)
  args = parser.parse_args(rest)

  import jax
  from rl_jax import model, sharding
  from rl_jax.sampler import engine as engine_lib
  from rl_jax.sampler import jetstream_adapter

  model_cfg, params = model.from_run_config(cfg.model, weights=True,
                                            weights_dtype=cfg.sampler.dtype)
  tensor = int(cfg.mesh.sampler.get("tensor", 1))
  mesh = sharding.make_mesh((1, 1, tensor), jax.devices()[:tensor])
  engine = engine_lib.Engine.from_config(
      cfg.sampler, model_cfg, mesh=mesh,
      tokenizer=model.load_tokenizer(model_cfg, cfg.model.path))
  sampling = engine_lib.Sampling(args.temperature, args.top_k, args.top_p)
  adapter = jetstream_adapter.JetStreamEngine(engine, params=params, sampling=sampling)
  weights = (engine.load_params(params) if params is not None
             else engine.load_params(rng=jax.random.key(cfg.seed)))
  server = jetstream_adapter.serve(adapter, weights, port=args.port)
  print(f"serving {cfg.model.path or cfg.model.preset} on localhost:{args.port} "
        f"({engine.max_concurrent_decodes} slots, {engine.num_pages} KV pages); Ctrl-C stops")
  try:
    server.wait_for_termination()  # stops the server on the way out
  except KeyboardInterrupt:
    pass


def main(argv):
  return cli.run(_main, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

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
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import cli  # noqa: E402  (imports no jax)
from rl_jax.bench import commands, options  # noqa: E402  (argparse only, imports no jax)


def _main(argv):
  parser = cli.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  for fn, add_args in ((commands.train, options.add_train_args),
                       (commands.sampler, options.add_sampler_args),
                       (commands.suite, options.add_suite_args)):
    p = sub.add_parser(fn.__name__, help=fn.__doc__)
    add_args(p)
    p.set_defaults(fn=fn)
  args = parser.parse_args(argv)
  return args.fn(args)


def main(argv=None):
  return cli.run(_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())

"""rl_jax.bench: the accelerator benchmark suite (`python launch/bench.py suite`).

options (flags and sizes, imports no jax), commands (launch/bench.py's train, sampler and
suite subcommands), measure (device probes, decode, prefill, train, weight sync), reference (the plain-JAX implementation rl_jax is compared with),
anchor (runs reference.py, or the script given with --anchor, at the suite's shapes),
e2e (a short async run through orchestration.loop), aot (compiled memory of the
accelerator-shaped programs, no allocation), cost (XLA's bytes and FLOPs per decode step
of rl_jax and the reference, compiled ahead of time) and suite (runs the sections,
writes JSON, prints the tables). Nothing here imports grain, ml_collections, TensorFlow or JetStream
except the e2e section, which checks for grain and ml_collections first.
"""

"""rl_jax.sampler."""

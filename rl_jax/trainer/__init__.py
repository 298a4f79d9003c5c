"""rl_jax.trainer."""

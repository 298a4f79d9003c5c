"""rl_jax.data."""

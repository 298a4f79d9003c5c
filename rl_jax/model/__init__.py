"""rl_jax.model."""

"""rl_jax.tasks."""

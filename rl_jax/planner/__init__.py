"""rl_jax.planner."""

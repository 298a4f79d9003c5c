"""rl_jax.orchestration."""

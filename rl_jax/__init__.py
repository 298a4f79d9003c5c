"""rl_jax: synchronous and asynchronous GRPO for language models in JAX."""
__version__ = "0.1.0"

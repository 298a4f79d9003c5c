"""rl_jax.data: JSONL record files (jsonl) and grain prompt pipelines (prompts).

Importing the package loads neither grain nor model code, so rl_jax.tasks can read its
files through rl_jax.data.jsonl cheaply.
"""

"""rl_jax.tasks: the Task protocol, built-in tasks and the verifier pool.

Importing the package registers the built-in tasks (arithmetic, calculator, carries,
countdown, gsm8k, jsonl) with `make_task`.
"""
from rl_jax.tasks import (arithmetic, calculator, carries, countdown,  # noqa: F401  (registration)
                          gsm8k, jsonl)
from rl_jax.tasks.base import (Example, Reward, Task, TaskError, evaluate, make_task,
                               register_task, task_names)

__all__ = ["Example", "Reward", "Task", "TaskError", "evaluate", "make_task",
           "register_task", "task_names"]

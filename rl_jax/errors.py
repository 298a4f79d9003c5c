"""The base class of every error that is the user's or the environment's to fix.

Launch scripts (rl_jax/cli.py) print a UserError as one `error: <message>` line and exit
non-zero without a traceback; each module keeps its own subclass (ConfigError, TaskError,
CheckpointError, RestoreError, ...) so callers can still tell them apart. Imports nothing.
"""


class UserError(Exception):
  """A mistake in the config, a file or the environment: one sentence naming the field,
  file, line or path."""

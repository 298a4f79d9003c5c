"""The two ways a run stops early, each with one sentence for the user."""


class RunError(RuntimeError):
  """A run that cannot continue: one sentence for the user."""


class Preempted(Exception):
  """The run stopped after SIGTERM; the message says which checkpoint holds its state."""

"""What every launch script does with a failure: one line on stderr and a non-zero exit.

  def main(argv):
    return cli.run(_main, argv)      # _main(argv) -> exit status or None

  if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

Exit statuses (documented in the README):

  0                 done
  EXIT_ERROR = 1    a user mistake or environment fault (`error: <one sentence>`), or an
                    unexpected failure (`error: <Type>: <message> (rerun with --debug ...)`)
  EXIT_USAGE = 2    bad command-line flags (argparse)
  EXIT_INTERRUPTED = 130   Ctrl-C (128 + SIGINT)
  EXIT_PREEMPTED = 143     SIGTERM stopped the run (128 + SIGTERM, what a shell reports for
                    a process killed by SIGTERM): the work is not finished, rerun the same
                    command to resume. Kubernetes (podFailurePolicy / restartPolicy) and
                    SLURM (--requeue) retry a non-zero exit; 0 would read as success.

`--debug` anywhere on the command line prints the traceback before the line.

`--dry-run` anywhere on the command line checks the command and exits 0 without doing
any work: the script's main runs up to the end of its outermost flag parse (an
ArgumentParser below), where DryRun stops it. A script that reads --config before its
flags (train.py, serve.py, plan.py) has by then loaded the config with its overrides and
run config.check_before_jax; none has claimed a workdir, read a run or started JAX. What
a parse_known_args leaves is passed on as config overrides (compare.py to train.py,
evaluate.py to its config), so a dry run accepts only --config.FIELD[=VALUE] there.
tests/test_docs.py dry-runs every launch command of the docs this way. Imports no jax.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from typing import Callable, Sequence

from rl_jax.errors import UserError

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 143
DEBUG_FLAG = "--debug"
DRY_RUN_FLAG = "--dry-run"

_dry_run = False  # set by run() while it calls a script's main with --dry-run
_parse_depth = 0  # ArgumentParser parses in progress (a subcommand's parse is nested)


def dry_running() -> bool:
  """Whether the script runs under --dry-run (it may check more before its flag parse)."""
  return _dry_run


class DryRun(SystemExit):
  """Raised when a --dry-run's command line has parsed: exit status 0, nothing ran."""

  def __init__(self):
    super().__init__(0)


class ArgumentParser(argparse.ArgumentParser):
  """argparse with one-line errors: `error: <what> (see --help)`, exit EXIT_USAGE."""

  def error(self, message):
    print(f"error: {one_line(message)} (see --help)", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)

  def parse_args(self, args=None, namespace=None):
    return self._parse(super().parse_args, args, namespace)

  def parse_known_args(self, args=None, namespace=None):
    return self._parse(super().parse_known_args, args, namespace)

  def _parse(self, parse, args, namespace):
    """`parse(args, namespace)`; under --dry-run the outermost parse ends in DryRun."""
    global _parse_depth
    _parse_depth += 1
    try:
      result = parse(args, namespace)
    finally:
      _parse_depth -= 1
    if _dry_run and _parse_depth == 0:
      bad = _not_an_override(result[1] if isinstance(result, tuple) else [])
      if bad is not None:
        self.error(f"unrecognized argument {bad!r} (what the flags leave must be "
                   "--config.FIELD=VALUE overrides)")
      raise DryRun()
    return result


def _not_an_override(args: Sequence[str]) -> str | None:
  """The first of `args` that is not part of a `--config.FIELD=VALUE` or
  `--config.FIELD VALUE` override; None when they all are."""
  i = 0
  while i < len(args):
    if not args[i].startswith("--config.") or ("=" not in args[i] and i + 1 == len(args)):
      return args[i]
    i += 1 if "=" in args[i] else 2
  return None


def print_help(argv: Sequence[str], doc: str) -> bool:
  """Prints `doc` when argv asks for help (-h/--help): for scripts that read --config
  before their argparse flags, so help works without a config."""
  if "-h" in argv or "--help" in argv:
    print(doc.strip())
    return True
  return False


def one_line(text: str) -> str:
  """`text` with its lines joined by " | " (a message must fit one stderr line)."""
  lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
  return " | ".join(lines)


def describe(e: BaseException) -> str:
  """The one line a user sees for `e` (without the `error: ` prefix)."""
  if isinstance(e, UserError):
    return one_line(str(e))
  if isinstance(e, OSError) and e.strerror:
    where = e.filename if e.filename is not None else ""
    if e.filename2 is not None:
      where = f"{where} -> {e.filename2}"
    return one_line(f"{where}: {e.strerror}" if where else e.strerror)
  text = one_line(str(e))
  return (f"{type(e).__name__}{': ' + text if text else ''} "
          f"(rerun with {DEBUG_FLAG} for the traceback)")


def run(fn: Callable[[list[str]], int | None], argv: Sequence[str],
        stderr=None) -> int:
  """Calls fn(argv without --debug and --dry-run); returns its exit status (None means 0),
  or prints one `error:` line for an exception and returns EXIT_ERROR (EXIT_INTERRUPTED
  for Ctrl-C). SystemExit passes through as its status, a message becomes one line on
  stderr. With --dry-run, fn stops at its flag parse (module docstring) and run returns 0."""
  global _dry_run
  stderr = stderr or sys.stderr
  argv = list(argv)
  debug = DEBUG_FLAG in argv
  _dry_run = DRY_RUN_FLAG in argv
  argv = [a for a in argv if a not in (DEBUG_FLAG, DRY_RUN_FLAG)]
  try:
    status = fn(argv)
  except DryRun:
    print("dry run: the command line is valid; nothing ran", flush=True)
    return 0
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    print(one_line(str(e.code)), file=stderr, flush=True)
    return EXIT_ERROR
  except KeyboardInterrupt:
    print("interrupted", file=stderr, flush=True)
    return EXIT_INTERRUPTED
  except Exception as e:  # noqa: BLE001  (every failure ends in one line)
    if debug:
      traceback.print_exc(file=stderr)
    print(f"error: {describe(e)}", file=stderr, flush=True)
    return EXIT_ERROR
  finally:
    _dry_run = False
  return int(status or 0)

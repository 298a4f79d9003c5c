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

`--debug` anywhere on the command line prints the traceback before the line. Imports no jax.
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


class ArgumentParser(argparse.ArgumentParser):
  """argparse with one-line errors: `error: <what> (see --help)`, exit EXIT_USAGE."""

  def error(self, message):
    print(f"error: {one_line(message)} (see --help)", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


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
  """Calls fn(argv without --debug); returns its exit status (None means 0), or prints
  one `error:` line for an exception and returns EXIT_ERROR (EXIT_INTERRUPTED for Ctrl-C).
  SystemExit passes through as its status, a message becomes one line on stderr."""
  stderr = stderr or sys.stderr
  argv = list(argv)
  debug = DEBUG_FLAG in argv
  argv = [a for a in argv if a != DEBUG_FLAG]
  try:
    status = fn(argv)
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
  return int(status or 0)

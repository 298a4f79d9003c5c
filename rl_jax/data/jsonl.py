"""Reading JSONL record files with line-numbered errors.

Every malformed line (invalid UTF-8, invalid JSON, not an object, or rejected by the
caller's `parse`) is reported as "<file>:<line>: <reason>". With on_bad_line="fail"
the first one raises DataError; with "skip" it is counted and logged (the first few
individually, then one summary line).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, TypeVar

from rl_jax.errors import UserError

T = TypeVar("T")
ON_BAD_LINE = ("skip", "fail")
_LOGGED_BAD_LINES = 3

log = logging.getLogger(__name__)


class DataError(UserError, ValueError):
  """Input data is missing, empty or malformed."""


def read_jsonl(path: str, *, parse: Callable[[dict[str, Any], int], T],
               on_bad_line: str) -> tuple[list[T], int]:
  """Parses each non-blank line of `path` as a JSON object and then with parse(obj, line).

  `parse` raises ValueError (any message) to reject a record. Returns (records,
  skipped_lines). Raises DataError for a missing file, a file with no valid record, or
  (on_bad_line="fail") the first bad line.
  """
  if on_bad_line not in ON_BAD_LINE:
    raise DataError(f"data.on_bad_line must be one of {ON_BAD_LINE}, got {on_bad_line!r}.")
  if not path:
    raise DataError("no data file given (task.path is empty).")
  if not os.path.isfile(path):
    raise DataError(f"data file {path!r} does not exist.")
  records, skipped, bad = [], 0, []
  with open(path, "rb") as f:
    for line_no, raw in enumerate(f, start=1):
      try:
        text = raw.decode("utf-8")
        if not text.strip():
          continue
        try:
          obj = json.loads(text)
        except json.JSONDecodeError as e:
          raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
          raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        records.append(parse(obj, line_no))
      except (UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = "invalid UTF-8" if isinstance(e, UnicodeDecodeError) else str(e)
        if isinstance(e, RecursionError):
          reason = "JSON nested too deeply"
        message = f"{path}:{line_no}: {reason}"
        if on_bad_line == "fail":
          raise DataError(message + " (set data.on_bad_line='skip' to skip bad lines).")
        skipped += 1
        if skipped <= _LOGGED_BAD_LINES:
          bad.append(message)
  if not records:  # one line: the first bad line says what is wrong with the file
    first = f"; the first: {bad[0]}" if bad else ""
    raise DataError(f"data file {path!r} contains no valid records "
                    f"({skipped} bad lines{first}).")
  for message in bad:
    log.warning("skipping %s", message)
  if skipped > _LOGGED_BAD_LINES:
    log.warning("skipped %d bad lines in %s", skipped, path)
  return records, skipped


def require_str(obj: dict[str, Any], field: str) -> str:
  """obj[field] as a string; numbers are accepted and formatted with str()."""
  if field not in obj:
    raise ValueError(f"missing field {field!r}")
  value = obj[field]
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    raise ValueError(f"field {field!r} must be a string, got {type(value).__name__}")
  return value if isinstance(value, str) else str(value)

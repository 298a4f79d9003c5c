"""Record files by extension: JSON lines (.jsonl, .json) and Parquet (.parquet).

`read_records(path, parse=..., on_bad_line=...)` gives every record to
`parse(obj, position)` as a dict; position is the 1-based line of a JSON-lines file or
the 1-based row of a Parquet file, and errors say "<file>:<line>: <reason>" or
"<file>: row <n>: <reason>". A Parquet file is a table (e.g. the Hugging Face GSM8K
split `main/train-00000-of-00001.parquet`, columns question and answer); its rows are
read a batch at a time, so memory follows the batch, not the file. pyarrow is imported
only for Parquet files.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, TypeVar

from rl_jax.data.jsonl import ON_BAD_LINE, DataError, read_jsonl

T = TypeVar("T")
JSON_LINES = (".jsonl", ".json")
PARQUET = (".parquet",)
_LOGGED_BAD_ROWS = 3

log = logging.getLogger(__name__)


def read_records(path: str, *, parse: Callable[[dict[str, Any], int], T],
                 on_bad_line: str) -> tuple[list[T], int]:
  """(records, skipped) from a .jsonl/.json or .parquet file; DataError otherwise."""
  if path and os.path.isdir(path):
    raise DataError(f"data file {path!r} is a directory; give one .parquet or .jsonl file "
                    "(e.g. the split's train-00000-of-00001.parquet).")
  ext = os.path.splitext(path)[1].lower()
  if ext in PARQUET:
    return read_parquet(path, parse=parse, on_bad_line=on_bad_line)
  if ext in JSON_LINES or not path:
    return read_jsonl(path, parse=parse, on_bad_line=on_bad_line)
  raise DataError(f"data file {path!r} has extension {ext or '(none)'!r}; rl_jax reads "
                  f"JSON lines ({', '.join(JSON_LINES)}) and Parquet (.parquet).")


def _open_parquet(path: str):
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise DataError(f"reading {path} needs pyarrow (pip install pyarrow).") from None
  try:
    return pq.ParquetFile(path)
  except Exception as e:  # ArrowInvalid / OSError: not a Parquet file, or truncated
    raise DataError(f"data file {path!r} is not a readable Parquet file ({e}).") from None


def read_parquet(path: str, *, parse: Callable[[dict[str, Any], int], T],
                 on_bad_line: str) -> tuple[list[T], int]:
  """Rows of a Parquet file as dicts through parse(row, row_number); see read_jsonl."""
  if on_bad_line not in ON_BAD_LINE:
    raise DataError(f"data.on_bad_line must be one of {ON_BAD_LINE}, got {on_bad_line!r}.")
  if not os.path.isfile(path):
    raise DataError(f"data file {path!r} does not exist.")
  table = _open_parquet(path)
  records, skipped, row = [], 0, 0
  for batch in table.iter_batches(batch_size=4096):
    for obj in batch.to_pylist():
      row += 1
      try:
        records.append(parse(obj, row))
      except ValueError as e:
        message = f"{path}: row {row}: {e}"
        if on_bad_line == "fail":
          raise DataError(message + " (set data.on_bad_line='skip' to skip bad rows).") from None
        skipped += 1
        if skipped <= _LOGGED_BAD_ROWS:
          log.warning("skipping %s", message)
  if skipped > _LOGGED_BAD_ROWS:
    log.warning("skipped %d bad rows in %s", skipped, path)
  if not records:
    columns = ", ".join(table.schema_arrow.names)
    raise DataError(f"data file {path!r} contains no valid records ({row} rows, {skipped} "
                    f"bad; columns: {columns}).")
  return records, skipped

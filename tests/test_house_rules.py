"""The size rules of DESIGN.md's style section, checked on the source with `ast` (nothing
is imported or run): modules at most 600 lines (the run loop, rl_jax/orchestration/loop.py,
under 500), launch scripts at most 80 lines (they only parse flags, build and call the
library), functions and methods at most 80 lines. Covers every .py under rl_jax/,
launch/ and configs/; a failure lists each offender as path:name:lines.
"""
import ast
import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("rl_jax", "launch", "configs")
MAX_MODULE_LINES = 600
LOOP = "rl_jax/orchestration/loop.py"
MAX_LOOP_LINES = 499  # under 500
MAX_LAUNCH_LINES = 80
MAX_FUNCTION_LINES = 80


@functools.lru_cache(maxsize=None)
def _sources() -> dict:
  """{path relative to the repository, '/'-separated: source text} of every .py file."""
  out = {}
  for package in PACKAGES:
    for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
      dirs[:] = sorted(d for d in dirs if d != "__pycache__")
      for name in sorted(files):
        if name.endswith(".py"):
          path = os.path.join(folder, name)
          with open(path, encoding="utf-8") as f:
            out[os.path.relpath(path, ROOT).replace(os.sep, "/")] = f.read()
  return out


def _lines(text: str) -> int:
  return len(text.splitlines())


def _functions(tree: ast.AST, prefix: str = ""):
  """(qualified name, lines) of every function and method in `tree`, nested ones too.
  Only statement lists are searched: a def is a statement."""
  for field in ("body", "orelse", "finalbody", "handlers", "cases"):
    for node in getattr(tree, field, ()):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        name = prefix + node.name
        if not isinstance(node, ast.ClassDef):
          yield name, node.end_lineno - node.lineno + 1
        yield from _functions(node, name + ".")
      else:
        yield from _functions(node, prefix)


def _report(offenders: list, rule: str) -> str:
  return f"{len(offenders)} over {rule}:\n  " + "\n  ".join(offenders)


def test_every_package_has_sources():
  sources = _sources()
  for package in PACKAGES:
    assert any(p.startswith(package + "/") for p in sources), package
  assert LOOP in sources


def test_modules_stay_under_600_lines():
  offenders = [f"{path}:<module>:{_lines(text)}" for path, text in _sources().items()
               if _lines(text) > MAX_MODULE_LINES]
  assert not offenders, _report(offenders, f"{MAX_MODULE_LINES} lines per module")


def test_the_run_loop_stays_under_500_lines():
  n = _lines(_sources()[LOOP])
  assert n <= MAX_LOOP_LINES, _report([f"{LOOP}:<module>:{n}"], "499 lines, the run loop's")


def test_launch_scripts_stay_at_most_80_lines():
  offenders = [f"{path}:<module>:{_lines(text)}" for path, text in _sources().items()
               if path.startswith("launch/") and _lines(text) > MAX_LAUNCH_LINES]
  assert not offenders, _report(offenders, f"{MAX_LAUNCH_LINES} lines per launch script")


def test_functions_stay_at_most_80_lines():
  offenders = [f"{path}:{name}:{n}" for path, text in _sources().items()
               for name, n in _functions(ast.parse(text, filename=path))
               if n > MAX_FUNCTION_LINES]
  assert not offenders, _report(offenders, f"{MAX_FUNCTION_LINES} lines per function")

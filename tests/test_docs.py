"""The docs check: README.md and every docs/**/*.md say only what works.

1. Links. Every link, image and reference definition outside code (`[text](path)`,
   `![alt](path)`, `[label]: path`, `<img src=...>`, `<a href=...>`) whose target has no
   scheme (https:, mailto: ... are skipped) resolves to a file or folder relative to the
   Markdown file, inside the repository. A `#anchor` on a Markdown target (or alone, for
   the same file) must be one of that file's headings as GitHub slugs them, or an
   explicit `id=` / `name=`.
2. Config names. Every `--config.FIELD` named anywhere (prose, inline code, code blocks)
   is a field of configs/base.py's get_config() (a group only before a placeholder, as in
   `--config.mesh.<axis>`); in code, its `=VALUE` parses as that field's type. Every
   `--ab FIELD=A,B` names a field and both values parse. Every `configs/NAME.py` exists
   and loads, and `configs/NAME.py:VARIANTS` loads with those variants.
3. Commands. Every `python launch/X.py ...` (or python3) in a fenced shell code block,
   also after `&&`/`;`/`|` or environment assignments, and with `\\` continuations
   joined, is dry-run in this process: `main(argv + ["--dry-run"])` (rl_jax/cli.py) parses
   the flags with the script's own parser (train.py, serve.py and plan.py load the config
   with its overrides and run config.check_before_jax first), then stops; no workdir is
   claimed or read, nothing trains and JAX computes nothing. The config of a command of
   a script that validates its config itself (_VALIDATING: train.py, compare.py for each
   arm, i.e. each rl.mode of --modes and each --ab value, evaluate.py with model.path =
   --hf) is then loaded here and checked with config.validate, with enough devices (the
   docs' commands are for other machines). `[--flag value]` brackets (optional flags)
   are taken off, and `[--a | --b]` keeps the first choice.

Rules for what cannot be checked here:
- A config field naming a file or folder (a field ending in `path` or `_file`, and
  evaluate.py's --hf as model.path) whose value does not exist relative to the
  repository root (a dataset or checkpoint the user downloads) is replaced by an empty
  stand-in: a folder holding an empty config.json for model.path (a Hugging Face
  checkpoint), an empty file for the others. Everything else is still checked.
- Workdirs, --out folders and the other paths of the scripts' own flags are not looked
  at: a dry run stops before it would read or create them.
- A command with a placeholder (a word `...` or containing `...` or `<...>`, or a
  variant or override value that is one, such as `lora=R` or `--config.task.path=...`)
  is checked for syntax only: `...` words and placeholder variants and overrides are
  dropped, check_before_jax and validate are skipped, and an error about a missing
  required flag (the `...` may stand for it) or naming a placeholder is accepted.
  Placeholder values are all-capital words (R, N, FIELD) or hold `...`, `<`, `>` or
  `|`; a word of a command is one when it holds `...` or `<...>` or an all-capital part
  between `=` and `,` (as in --ab FIELD=A,B, --devices N).
- Commands in inline code are not run; check 2 covers their config names.
Every failure names the Markdown file and line; each test collects them all and asserts
once with the whole list.
"""
import contextlib
import functools
import glob
import importlib.util
import io
import os
import re
import shlex
import urllib.parse
from unittest import mock

from rl_jax import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENOUGH_DEVICES = 1 << 20


def markdown_files() -> list[str]:
  return [os.path.join(ROOT, "README.md")] + sorted(
      glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def _where(path: str, lineno: int) -> str:
  return f"{os.path.relpath(path, ROOT)}:{lineno}"


def _lines(path: str) -> list[tuple[int, str, str | None]]:
  """(line number, text, fence) of each line; fence is the code block's info string
  ("" when it has none) for the lines inside a fenced block, None outside."""
  out, fence, info = [], None, None
  with open(path, encoding="utf-8") as f:
    for no, line in enumerate(f.read().splitlines(), 1):
      m = re.match(r"^\s*(`{3,}|~{3,})\s*([^\s`]*)", line)  # also indented in a list
      if fence is None and m:
        fence, info = m.group(1), m.group(2).lower()
      elif fence is not None and re.match(rf"^\s*{fence[0]}{{{len(fence)},}}\s*$", line):
        fence = None
      elif fence is not None:
        out.append((no, line, info))
      else:
        out.append((no, line, None))
  return out


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _placeholder(text: str) -> bool:
  return bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", text) or re.search(r"\.\.\.|…|[<>|]", text))


# Links.

_INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?")
_HTML_LINK = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)\s*=\s*[\"']([^\"']+)[\"']",
                        re.IGNORECASE)


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: inline markup off, lower case, punctuation (all but
  `-` and `_`) dropped, spaces to hyphens."""
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
  text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
  return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def _anchors(path: str) -> frozenset:
  """The anchors of a Markdown file: its headings' slugs (a repeated one gets -1, -2,
  ...) and explicit id= / name= attributes."""
  seen, out = {}, set()
  for _, line, fence in _lines(path):
    if fence is not None:
      continue
    out.update(re.findall(r"\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", line))
    m = re.match(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)
    if m:
      slug = _slug(m.group(1))
      n = seen.get(slug, 0)
      seen[slug] = n + 1
      out.add(slug if n == 0 else f"{slug}-{n}")
  return frozenset(out)


def check_links(path: str, root: str = ROOT) -> list[str]:
  failures = []
  for no, line, fence in _lines(path):
    if fence is not None:
      continue
    prose = _CODE_SPAN.sub("", line)
    targets = (_INLINE_LINK.findall(prose) + _REF_DEF.findall(prose)
               + _HTML_LINK.findall(prose))
    for target in targets:
      if not target or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):
        continue  # empty, or a URL with a scheme
      file_part, _, anchor = target.partition("#")
      file_part = urllib.parse.unquote(file_part.partition("?")[0])
      if file_part.startswith("/"):
        resolved = os.path.normpath(os.path.join(root, file_part.lstrip("/")))
      elif file_part:
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
      else:
        resolved = path
      where = _where(path, no)
      if os.path.relpath(resolved, root).startswith(os.pardir):
        failures.append(f"{where}: link {target!r} points outside the repository")
      elif not os.path.exists(resolved):
        failures.append(f"{where}: link {target!r}: {os.path.relpath(resolved, root)} "
                        "does not exist")
      elif anchor and resolved.endswith(".md") and os.path.isfile(resolved):
        if urllib.parse.unquote(anchor) not in _anchors(resolved):
          failures.append(f"{where}: link {target!r}: {os.path.relpath(resolved, root)} "
                          f"has no heading with the anchor #{anchor}")
  return failures


# Config names.

_OVERRIDE = re.compile(r"--config\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(\.?)(=[^\s`'\"|]*)?")
_AB = re.compile(r"--ab(?:=|\s+)([A-Za-z_][\w.]*)=([^\s`'\"|]*)")
_CONFIG_FILE = re.compile(r"(?<![\w./-])(configs/[\w/-]+\.py)(?::([^\s`'\"();|\]]+))?")


@functools.lru_cache(maxsize=None)
def _base():
  return config_lib.base_config()


def _field_problem(dotted: str, value: str | None, group_ok: bool = False) -> str | None:
  """What is wrong with `--config.<dotted>[=value]`, or None. A placeholder value is
  not parsed."""
  node = _base()
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node:
      return f"--config.{dotted}: configs/base.py has no field {dotted!r}"
    node = node[part]
  if hasattr(node, "keys"):
    return None if group_ok else f"--config.{dotted} is a group of fields, not a field"
  if value is None or _placeholder(value):
    return None
  try:
    config_lib.apply_override(_base().copy_and_resolve_references(), dotted, value)
  except config_lib.ConfigError as e:
    return str(e)
  return None


@functools.lru_cache(maxsize=None)
def _config_file_problem(spec: str) -> str | None:
  """What is wrong with loading `configs/NAME.py[:VARIANTS]` (placeholder variants
  dropped), or None."""
  path, _, variants = spec.partition(":")
  if _placeholder(os.path.basename(path)[:-3]):
    return None
  if not os.path.isfile(os.path.join(ROOT, path)):
    return f"{path} does not exist"
  kept = [v for v in variants.split(",") if v and not _placeholder(v.partition("=")[2])]
  try:
    config_lib.load_file(os.path.join(ROOT, path) + (":" + ",".join(kept) if kept else ""))
  except config_lib.ConfigError as e:
    return f"{spec} does not load: {e}"
  return None


def check_config_names(path: str) -> list[str]:
  failures = []
  for no, line, fence in _lines(path):
    where = _where(path, no)
    code = " ".join(m.group(2) for m in _CODE_SPAN.finditer(line)) if fence is None else line
    problems = []
    for m in _OVERRIDE.finditer(line):  # names anywhere
      group_ok = bool(m.group(2)) and line[m.end(2):m.end(2) + 1] not in ("", " ")
      problems.append(_field_problem(m.group(1), None, group_ok))
    for m in _OVERRIDE.finditer(code):  # values in code only
      if m.group(3):
        problems.append(_field_problem(m.group(1), m.group(3)[1:]))
    for m in _AB.finditer(line):
      field, values = m.group(1), m.group(2).split(",")
      if _placeholder(field):
        continue
      problems.append(_field_problem(field, None))
      if fence is not None or m.group(0) in code:
        problems += [_field_problem(field, v) for v in values if v]
    for m in _CONFIG_FILE.finditer(line):
      variants = (m.group(2) or "").rstrip(".,:")
      spec = m.group(1) + (":" + variants if variants else "")
      problems.append(_config_file_problem(spec))
    seen = set()
    for p in problems:
      if p is not None and p not in seen:
        seen.add(p)
        failures.append(f"{where}: {p}")
  return failures


# Commands.

_SHELL = ("", "sh", "bash", "shell", "console", "zsh", "text")
_PYTHON = re.compile(r"^python(?:3(?:\.\d+)?)?$")
_SCRIPT = re.compile(r"^(?:\./)?(launch/[\w/]+\.py)$")
_SEPARATORS = ("&&", "||", ";", "|", "&", "<")
_REDIRECT = re.compile(r"^(?:\d?>{1,2}|&>)")
_FOLDER_FIELDS = ("model.path",)  # a Hugging Face checkpoint folder; other paths are files
# The scripts that run config.validate themselves (train.py in its run loop, compare.py
# through train.py, evaluate.py with model.path = --hf); plan.py and serve.py run
# check_before_jax, which their dry run covers.
_VALIDATING = ("launch/train.py", "launch/compare.py", "launch/evaluate.py")


def commands(path: str) -> list[tuple[int, str, list[str]]]:
  """(line, script, argv) of every launch command in the fenced shell blocks of `path`."""
  out, joined, start = [], "", None
  for no, line, fence in _lines(path):
    if fence is None or fence not in _SHELL:
      joined, start = "", None
      continue
    start = no if start is None else start
    if line.rstrip().endswith("\\"):
      joined += line.rstrip()[:-1] + " "
      continue
    text, line_no = joined + line, start
    joined, start = "", None
    if "launch/" not in text:
      continue
    text = re.sub(r"^\s*\$\s+", "", text)
    try:
      words = shlex.split(_strip_comment(text))
    except ValueError as e:
      out.append((line_no, "", [f"<cannot split the line into words: {e}>"]))
      continue
    i = 0
    while i < len(words) - 1:
      m = _SCRIPT.match(words[i + 1])
      if not (_PYTHON.match(words[i]) and m):
        i += 1
        continue
      argv, i, depth = [], i + 2, 0  # depth: inside [optional flags], | is no pipe
      while i < len(words) and not (
          (depth == 0 and (words[i] in _SEPARATORS or _REDIRECT.match(words[i]))) or
          (_PYTHON.match(words[i]) and i + 1 < len(words) and _SCRIPT.match(words[i + 1]))):
        argv.append(words[i])
        depth += words[i].startswith("[-")
        depth -= depth > 0 and words[i].endswith("]")
        i += 1
        if depth == 0 and argv[-1].endswith(";"):
          argv[-1] = argv[-1][:-1]
          break
      out.append((line_no, m.group(1), _optional_flags(argv)))
  return out


def _strip_comment(text: str) -> str:
  """`text` up to a `#` that starts a shell comment (at a word start, outside quotes)."""
  quote = None
  for k, ch in enumerate(text):
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch == "#" and (k == 0 or text[k - 1].isspace()):
      return text[:k]
  return text


def _optional_flags(argv: list[str]) -> list[str]:
  """argv with `[--flag value]` brackets taken off; `[--a | --b]` keeps --a."""
  out, depth, skipping = [], 0, False
  for word in argv:
    if word.startswith("[-"):
      depth += 1
      word = word[1:]
    if depth and word == "|":
      skipping = True
      continue
    closes = depth and word.endswith("]")
    if closes:
      word = word[:-1]
    if word and not skipping:
      out.append(word)
    if closes:
      depth, skipping = depth - 1, False
  return out


@functools.lru_cache(maxsize=None)
def _script(rel: str):
  name = "docs_" + re.sub(r"\W", "_", rel)
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, rel))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _stand_ins(argv: list[str], tmp_dir: str) -> list[str]:
  """argv with each missing file or folder a config field names replaced (module doc)."""
  out = []
  for word in argv:
    m = re.match(r"^--config\.([\w.]+(?:path|_file))=(.+)$", word)
    if m and not _placeholder(m.group(2)) and not os.path.exists(os.path.join(ROOT, m.group(2))):
      stand_in = os.path.join(tmp_dir, f"stand_in_{len(os.listdir(tmp_dir))}",
                              os.path.basename(m.group(2).rstrip("/")))
      os.makedirs(stand_in if m.group(1) in _FOLDER_FIELDS else os.path.dirname(stand_in))
      open(os.path.join(stand_in, "config.json") if m.group(1) in _FOLDER_FIELDS
           else stand_in, "w").close()
      word = f"--config.{m.group(1)}={stand_in}"
    out.append(word)
  return out


def _syntax_only(argv: list[str]) -> tuple[list[str], list[str]]:
  """The placeholders of argv (module doc), and argv without `...` words and placeholder
  variants and overrides."""
  out, found = [], []
  for k, word in enumerate(argv):
    spec_word = k > 0 and argv[k - 1] == "--config"
    if spec_word or word.startswith("--config="):
      prefix = "" if spec_word else "--config="
      path, _, variants = word[len(prefix):].partition(":")
      variants = [v for v in variants.split(",") if v]
      found += [v for v in variants if _placeholder(v.partition("=")[2])]
      kept = [v for v in variants if not _placeholder(v.partition("=")[2])]
      out.append(prefix + path + (":" + ",".join(kept) if kept else ""))
    elif word.startswith("--config.") and "=" in word and _placeholder(word.partition("=")[2]):
      found.append(word)
    elif "..." in word or "…" in word:
      found.append(word)
    else:
      if re.search(r"<[^>]*>", word) or any(
          re.fullmatch(r"[A-Z][A-Z0-9_]*", part) for part in re.split(r"[=,]", word)):
        found.append(word)
      out.append(word)
  return found, out


def _dry_run(script: str, argv: list[str]) -> tuple[int, str]:
  """(exit status, stderr) of the script's main(argv + ["--dry-run"]), in this process."""
  err = io.StringIO()
  with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
    try:
      status = _script(script).main([*argv, "--dry-run"])
    except (Exception, SystemExit) as e:  # noqa: BLE001  (a script without cli.run)
      return 1, f"{type(e).__name__}: {e}"
  return status, err.getvalue().strip()


def _flag(argv: list[str], name: str, default: str) -> str:
  for k, word in enumerate(argv):
    if word == name and k + 1 < len(argv):
      return argv[k + 1]
    if word.startswith(name + "="):
      return word.split("=", 1)[1]
  return default


def _arms(script: str, argv: list[str]) -> list[list[str]]:
  """The overrides the script adds to the command's config, one list per config it
  validates: compare.py's arms (rl.mode of each of --modes, times the --ab values), and
  evaluate.py's model.path = --hf."""
  if script == "launch/compare.py":
    ab = _flag(argv, "--ab", "")
    field, _, values = ab.partition("=")
    return [[f"--config.rl.mode={mode}", *([f"--config.{field}={v}"] if ab else [])]
            for mode in _flag(argv, "--modes", "sync,async").split(",")
            for v in (values.split(",") if ab else [None])]
  if script == "launch/evaluate.py" and _flag(argv, "--hf", ""):
    return [[f"--config.model.path={_flag(argv, '--hf', '')}"]]
  return [[]]


def _validate(script: str, argv: list[str], tmp_dir: str) -> str | None:
  """The ConfigError of the command's config (of each of its _arms), or None."""
  config_args = [w for k, w in enumerate(argv) if w.startswith("--config")
                 or (k > 0 and argv[k - 1].startswith("--config") and "=" not in argv[k - 1])]
  arms = _arms(script, argv)
  for extra in arms:
    try:
      cfg, _ = config_lib.parse_args(_stand_ins(config_args + extra, tmp_dir))
      config_lib.validate(cfg, num_devices=ENOUGH_DEVICES)
    except config_lib.ConfigError as e:
      return f"{str(e)}{' (' + ' '.join(extra) + ')' if len(arms) > 1 else ''}"
  return None


def check_commands(path: str, tmp_dir: str) -> list[str]:
  failures = []
  for no, script, argv in commands(path):
    where = _where(path, no)
    shown = " ".join(["python", script, *argv]) if script else argv[0]
    if not script:
      failures.append(f"{where}: {shown}")
      continue
    if not os.path.isfile(os.path.join(ROOT, script)):
      failures.append(f"{where}: `{shown}`: {script} does not exist")
      continue
    placeholders, argv = _syntax_only(argv)
    if placeholders:
      with mock.patch.object(config_lib, "check_before_jax", lambda cfg: None):
        status, err = _dry_run(script, argv)
      if status != 0 and "required" not in err and not any(repr(w) in err for w in placeholders):
        failures.append(f"{where}: `{shown}` (syntax only): exit status {status}: {err}")
      continue
    status, err = _dry_run(script, _stand_ins(argv, tmp_dir))
    if status != 0:
      failures.append(f"{where}: `{shown}`: exit status {status}: {err}")
    elif script in _VALIDATING and ("--config" in argv or
                                    any(w.startswith("--config=") for w in argv)):
      problem = _validate(script, argv, tmp_dir)
      if problem:
        failures.append(f"{where}: `{shown}`: the config does not validate: {problem}")
  return failures


def _report(failures: list[str]) -> str:
  return f"{len(failures)} problems in the docs:\n" + "\n".join(failures)


def test_links():
  failures = [f for path in markdown_files() for f in check_links(path)]
  assert not failures, _report(failures)


def test_config_names():
  failures = [f for path in markdown_files() for f in check_config_names(path)]
  assert not failures, _report(failures)


def test_commands(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)  # the docs' commands run from the repository root
  failures = [f for path in markdown_files() for f in check_commands(path, str(tmp_path))]
  assert not failures, _report(failures)


def test_links_can_fail(tmp_path):
  (tmp_path / "page.md").write_text("# Page\n")
  (tmp_path / "bad.md").write_text(
      "# Title\n[ok](page.md) [gone](missing.md) ![img](nope.png)\n"
      "[anchor](page.md#nope) `[code](skipped.md)` [web](https://example.com)\n")
  failures = check_links(str(tmp_path / "bad.md"), root=str(tmp_path))
  assert len(failures) == 3, failures
  assert all(":2: " in f for f in failures[:2]) and "missing.md" in failures[0], failures
  assert "nope.png" in failures[1] and ":3: " in failures[2] and "#nope" in failures[2]


def test_config_names_can_fail(tmp_path):
  (tmp_path / "bad.md").write_text(
      "Set `--config.rl.max_staleness=2` or `--config.rl.no_such_field=1`.\n"
      "```\n--config.rl.max_staleness=two --ab rl.nope=a,b\n```\n"
      "See configs/nope.py and configs/default.py:colour=red.\n")
  failures = check_config_names(str(tmp_path / "bad.md"))
  assert len(failures) == 5, failures
  assert ":1: " in failures[0] and "rl.no_such_field" in failures[0]
  assert ":3: " in failures[1] and "rl.max_staleness" in failures[1] and "'two'" in failures[1]
  assert "rl.nope" in failures[2]
  assert ":5: " in failures[3] and "configs/nope.py does not exist" in failures[3]
  assert "colour=red" in failures[4] and "unknown variant" in failures[4]


def test_commands_can_fail(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  (tmp_path / "bad.md").write_text(
      "```sh\n"
      f"python launch/train.py --config configs/default.py --workdir {tmp_path}/a --no-such-flag\n"
      "cd x && python3 launch/train.py --config configs/default.py --config.rl.mode=sideways\n"
      "python launch/bench.py train --bogus 1   # comment\n"
      "python launch/compare.py --config configs/default.py --ab rl.mode=sync,nope \\\n"
      "  --modes async\n"
      "python launch/train.py --config configs/default.py --config.seed=... --worddir x\n"
      "python launch/nope.py\n"
      f"python launch/train.py --config configs/default.py --workdir {tmp_path}/b  # fine\n"
      "python launch/compare.py --config configs/default.py --ab FIELD=A,B --devices N\n"
      "python launch/plan.py --config configs/default.py --devices N\n"
      "```\n")
  failures = check_commands(str(tmp_path / "bad.md"), str(tmp_path))
  assert [f.split(": ", 1)[0].rsplit(":", 1)[1] for f in failures] == [
      "2", "3", "4", "5", "7", "8", "10"], failures
  assert "--no-such-flag" in failures[0] and "exit status 2" in failures[0]
  assert "rl.mode" in failures[1] and "'sideways'" in failures[1]
  assert "--bogus" in failures[2]
  assert "'nope'" in failures[3] and "--config.rl.mode=async" in failures[3]
  assert "syntax only" in failures[4] and "--worddir" in failures[4]
  assert "launch/nope.py does not exist" in failures[5]
  assert "syntax only" in failures[6] and "--devices" in failures[6]
  assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

"""Number parsing and final-answer extraction shared by the verifiers.

Numbers are compared as canonical decimal strings, never converted to int or float:
a 100000-digit completion costs linear time and cannot hit Python's int-string limit.

Canonical form: optional "-", integer digits without leading zeros (or "0"), then
"." and fraction digits without trailing zeros if any remain. "+3.50", "$3.5", "03.5"
-> "3.5"; "1,234" -> "1234"; "-0.0" -> "0".

Only ASCII digits are digits. Other scripts' digits ("٤٦", fullwidth "４６") are not read
as numbers, so a completion written in them scores 0 rather than being silently
reinterpreted. The Unicode minus U+2212 is accepted as "-": it is a sign, not a digit.
"""
from __future__ import annotations

import re

# A number not glued to a preceding word or number: optional sign, optional "$",
# digits with optional 3-digit comma groups, optional fraction. The lookahead requires
# at least one digit so the pattern never matches the empty string.
_NUMBER = re.compile(
    r"(?<![0-9A-Za-z_.])(?P<sign>[-+]?)\$?(?=\.?[0-9])"
    r"(?P<int>[0-9]+(?:,[0-9]{3})*)?(?:\.(?P<frac>[0-9]+))?\.?")
_INTEGER = re.compile(r"[-+]?[0-9]+")
_BOXED = "\\boxed{"
_HASHES = "####"


def _canonical(sign: str, int_part: str | None, frac: str | None) -> str:
  digits = (int_part or "").replace(",", "").lstrip("0") or "0"
  frac = (frac or "").rstrip("0")
  body = f"{digits}.{frac}" if frac else digits
  return "-" + body if sign == "-" and body != "0" else body


def preview(number: str | None, limit: int = 40) -> str | None:
  """A bounded copy of a parsed number for Reward.info (logs must not hold 10**5 digits)."""
  if number is None or len(number) <= limit:
    return number
  return f"{number[:limit // 2]}...({len(number)} chars)"


def _normalise(text: str) -> str:
  return text.replace("\u2212", "-")


def canonical_number(text: str) -> str | None:
  """Canonical form of `text` if all of it (stripped) is one number, else None."""
  m = _NUMBER.fullmatch(_normalise(text).strip())
  return None if m is None else _canonical(m["sign"], m["int"], m["frac"])


def canonical_integer(text: str) -> str | None:
  """Canonical form of `text` if all of it (stripped) is one signed integer, else None.

  "46", " 46\n", "+46", "046" -> "46"; "46 47", "4.6", "46." -> None.
  """
  text = _normalise(text).strip()
  if _INTEGER.fullmatch(text) is None:
    return None
  return _canonical(text[0] if text[0] in "+-" else "", text.lstrip("+-"), None)


# Operators that, right after the number, make it part of an expression ("1234 * 2").
# "+" and "-" are left out: after a final answer they are more often punctuation.
_OPERATORS = frozenset("*/^=\u00d7\u00f7")


def _sole_number(segment: str) -> str | None:
  """The canonical number a marked answer commits to, or None when the segment holds no
  number or more than the number: another digit after it (an alternative, "1234 or
  1235"; more arithmetic, "1234 * 2"; an exponent, "1234e5"; a longer comma group,
  "1,2345") or an operator right after it ("1234 * x"). Words without digits around it
  are allowed ("#### The answer is $1,234 dollars.")."""
  m = _NUMBER.search(_normalise(segment))
  if m is None:
    return None
  rest = segment[m.end():]
  if any("0" <= ch <= "9" for ch in rest) or rest.lstrip()[:1] in _OPERATORS:
    return None
  return _canonical(m["sign"], m["int"], m["frac"])


def extract_final_answer(text: str) -> tuple[str | None, str]:
  """The completion's final answer as (canonical number or None, source).

  source is "####" (the number after the last "####", on its line), "boxed" (the number
  inside the last \\boxed{...}), whichever marker occurs later; "last_number" when
  neither marker occurs; "none" when there is no number at all. A marker followed by no
  number, or by a number with more after it (`_sole_number`: "#### 1234 or 1235",
  "#### 1234 * 2", "#### 1234e5"), gives (None, marker): the model committed to a
  non-answer, never to the first number of it.
  """
  text = _normalise(text)
  hashes, boxed = text.rfind(_HASHES), text.rfind(_BOXED)
  if hashes > boxed:
    line = text[hashes + len(_HASHES):].split("\n", 1)[0]
    return _sole_number(line), "####"
  if boxed >= 0:
    start = boxed + len(_BOXED)
    end = text.find("}", start)
    return _sole_number(text[start:] if end < 0 else text[start:end]), "boxed"
  # The last match of a linear regex scan; finditer keeps memory O(1).
  last = None
  for last in _NUMBER.finditer(text):
    pass
  if last is None:
    return None, "none"
  return _canonical(last["sign"], last["int"], last["frac"]), "last_number"

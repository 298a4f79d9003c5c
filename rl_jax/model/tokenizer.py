"""Tokenizers with one small interface: a char-level one and Hugging Face tokenizer.json.

Both provide `encode(text, add_bos=False) -> list[int]`, `decode(ids, skip_special=True)
-> str`, `vocab_size`, `bos_id`, `eos_id`, `pad_id` and `stop_ids` (every id that ends a
completion). Prompts are plain text (format_prompt) or, for a Hugging Face checkpoint
with a chat template, `HFTokenizer.apply_chat_template(messages)` (rl_jax.model.chat_template).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable

import tokenizers

from rl_jax.model import chat_template as chat_template_lib
from rl_jax.model.presets import ModelConfig, get_preset

PROMPT_PLACEHOLDER = "{prompt}"


def format_prompt(text: str, template: str = PROMPT_PLACEHOLDER) -> str:
  """`template` with "{prompt}" replaced by `text`.

  Plain replacement rather than str.format so templates may contain other braces.
  """
  if PROMPT_PLACEHOLDER not in template:
    raise ValueError(f"prompt template {template!r} has no {PROMPT_PLACEHOLDER} placeholder")
  return template.replace(PROMPT_PLACEHOLDER, text)


class CharTokenizer:
  """pad 0, bos 1, eos 2, printable ASCII 32..126 -> 3..97, newline -> 98.

  Other characters encode as '?'. Ids 99..127 exist only so the vocabulary matches the
  tiny_char model; they decode to U+FFFD so a model emitting them is visible.
  """
  vocab_size = 128
  pad_id, bos_id, eos_id = 0, 1, 2
  _FIRST_CHAR, _LAST_CHAR, _OFFSET = 32, 126, 3
  _NEWLINE_ID = 98
  _SPECIAL_TEXT = {0: "<pad>", 1: "<bos>", 2: "<eos>"}

  @property
  def stop_ids(self) -> frozenset[int]:
    return frozenset({self.eos_id})

  def fingerprint(self) -> str:
    """Identifies the vocabulary (checkpoints compare it before continuing rollouts)."""
    return f"char-{self.vocab_size}"

  def _char_id(self, ch: str) -> int:
    code = ord(ch)
    if self._FIRST_CHAR <= code <= self._LAST_CHAR:
      return code - self._FIRST_CHAR + self._OFFSET
    if ch == "\n":
      return self._NEWLINE_ID
    return ord("?") - self._FIRST_CHAR + self._OFFSET

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    ids = [self._char_id(ch) for ch in text]
    return [self.bos_id] + ids if add_bos else ids

  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
    out = []
    for i in map(int, ids):
      if i in self._SPECIAL_TEXT:
        if not skip_special:
          out.append(self._SPECIAL_TEXT[i])
      elif self._OFFSET <= i <= self._LAST_CHAR - self._FIRST_CHAR + self._OFFSET:
        out.append(chr(i - self._OFFSET + self._FIRST_CHAR))
      elif i == self._NEWLINE_ID:
        out.append("\n")
      else:
        out.append("\ufffd")
    return "".join(out)


def _read_optional_json(file: str) -> dict:
  if not os.path.exists(file):
    return {}
  with open(file) as fh:
    return json.load(fh)


def _as_list(value) -> list[int]:
  if value is None:
    return []
  return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class HFTokenizer:
  """A checkpoint directory's tokenizer.json, via the `tokenizers` library.

  Special ids come from tokenizer_config.json (bos_token / eos_token / pad_token), then
  config.json and generation_config.json (*_token_id); the keyword ids are used only
  where none of those files names one. `stop_ids` holds every eos id the files name,
  plus the end-of-turn tokens its chat template writes (e.g. <|im_end|>). pad falls back
  to eos. `chat_template` is the checkpoint's ChatTemplate, or None.
  """

  def __init__(self, path: str, *, bos_id: int | None = None, eos_id: int | None = None,
               pad_id: int | None = None):
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
      raise FileNotFoundError(f"tokenizer file {file} does not exist")
    self._tok = tokenizers.Tokenizer.from_file(file)
    tok_cfg = _read_optional_json(os.path.join(path, "tokenizer_config.json"))
    model_cfg = _read_optional_json(os.path.join(path, "config.json"))
    gen_cfg = _read_optional_json(os.path.join(path, "generation_config.json"))

    def token_id(key):
      token = tok_cfg.get(key)
      if isinstance(token, dict):  # older configs store an AddedToken dict
        token = token.get("content")
      return None if token is None else self._tok.token_to_id(token)

    def first(*candidates):
      return next((c for c in candidates if c is not None), None)

    eos_ids = ([token_id("eos_token")] + _as_list(model_cfg.get("eos_token_id")) +
               _as_list(gen_cfg.get("eos_token_id")))
    eos_ids = [i for i in eos_ids if i is not None] or ([] if eos_id is None else [eos_id])
    if not eos_ids:
      raise ValueError(f"no eos token in the tokenizer_config.json, config.json or "
                       f"generation_config.json of {path}; pass eos_id")
    self.eos_id = eos_ids[0]
    self.chat_template = chat_template_lib.load(path, tok_cfg)
    if self.chat_template is not None:
      turn_ends = (self._tok.token_to_id(t) for t in self.chat_template.end_of_turn_tokens())
      eos_ids += [i for i in turn_ends if i is not None]
    self.stop_ids = frozenset(eos_ids)
    self.bos_id = first(token_id("bos_token"), model_cfg.get("bos_token_id"),
                        gen_cfg.get("bos_token_id"), bos_id)
    self.pad_id = first(token_id("pad_token"), model_cfg.get("pad_token_id"), pad_id,
                        self.eos_id)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self._path = path
    digest = hashlib.sha256(open(file, "rb").read())
    digest.update(repr((self.eos_id, self.bos_id, self.pad_id, sorted(self.stop_ids))).encode())
    self._fingerprint = digest.hexdigest()[:16]

  def fingerprint(self) -> str:
    """tokenizer.json's bytes and the special ids, hashed (checkpoints compare it
    before continuing rollouts)."""
    return self._fingerprint

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    # Special tokens are added here explicitly, never by the tokenizer's post-processor.
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if not add_bos:
      return ids
    if self.bos_id is None:
      raise ValueError(f"the tokenizer in {self._path} has no bos token")
    return [self.bos_id] + ids

  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def apply_chat_template(self, messages) -> str:
    """The chat template rendered with the generation prompt (no tokenization)."""
    if self.chat_template is None:
      raise chat_template_lib.ChatTemplateError(
          f"the tokenizer in {self._path} has no chat template (neither "
          f"{chat_template_lib.TEMPLATE_FILE} nor a 'chat_template' in tokenizer_config.json)")
    return self.chat_template.render(messages, add_generation_prompt=True)


def load_tokenizer(model_cfg_or_preset_name: ModelConfig | str,
                   path: str = "") -> CharTokenizer | HFTokenizer:
  """HFTokenizer for a checkpoint `path`; without one, the CharTokenizer.

  Random-weight runs of a real preset shape use the char tokenizer too (its ids are a
  subset of any vocabulary of at least 128).
  """
  cfg = (get_preset(model_cfg_or_preset_name) if isinstance(model_cfg_or_preset_name, str)
         else model_cfg_or_preset_name)
  if path:
    return HFTokenizer(path, bos_id=cfg.bos_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id)
  if cfg.vocab_size < CharTokenizer.vocab_size:
    raise ValueError(f"the char tokenizer needs vocab_size >= {CharTokenizer.vocab_size}, "
                     f"the model has {cfg.vocab_size}; set model.path to a checkpoint")
  return CharTokenizer()

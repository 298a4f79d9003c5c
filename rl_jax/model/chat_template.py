"""Chat templates of Hugging Face checkpoints, rendered with jinja2 the way transformers does.

Where the template lives: `chat_template.jinja` in the checkpoint directory (what
transformers >= 4.43 writes), else the "chat_template" entry of tokenizer_config.json
(a string, or a list of {"name", "template"} of which "default" is used). The .jinja
file wins when both exist, as in transformers.

Rendering mirrors `tokenizer.apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)` without importing transformers: a sandboxed jinja2
environment with trim_blocks and lstrip_blocks, the loopcontrols extension, a
`{% generation %}` block that renders its body, the globals raise_exception and
strftime_now, a tojson filter that does not escape HTML, and the variables messages,
add_generation_prompt, tools=None, documents=None plus the tokenizer's named special
tokens (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token) as
strings, for those tokenizer_config.json names.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any, Sequence

from rl_jax.errors import UserError


TEMPLATE_FILE = "chat_template.jinja"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names a template may read.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
# Tokens that end an assistant turn in the common template families (ChatML/Qwen,
# Llama 3, Phi 3, Gemma, GPT-2 style). Each one the template writes is a stop token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                      "<|endoftext|>", "<|end_of_text|>")


class ChatTemplateError(UserError, ValueError):
  """A chat template that cannot be read or rendered; the message names the file."""


def _raise_exception(message):
  import jinja2
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
  # jinja2 is imported here, so rl_jax.model imports without it (benchmark machines).
  import jinja2
  import jinja2.ext
  import jinja2.sandbox

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant spans with
    it; the rendered text is just the body."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(source)


def _token_text(value) -> str | None:
  if isinstance(value, dict):  # an AddedToken dict in older tokenizer_config.json files
    value = value.get("content")
  return value if isinstance(value, str) else None


class ChatTemplate:
  """A template's source plus the special-token variables it is rendered with.

  Holds only strings (the compiled template is cached per source), so it pickles.
  """

  def __init__(self, source: str, *, special_tokens: dict[str, str], where: str):
    self.source = source
    self.special_tokens = dict(special_tokens)
    self.where = where
    import jinja2
    try:
      _compile(source)
    except jinja2.TemplateSyntaxError as e:
      raise ChatTemplateError(f"{where}: chat template line {e.lineno}: {e.message}") from None

  def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
             **kwargs) -> str:
    """The prompt text for `messages` ([{"role", "content"}, ...])."""
    import jinja2
    variables = {**self.special_tokens, **kwargs}
    try:
      return _compile(self.source).render(
          messages=[dict(m) for m in messages], tools=None, documents=None,
          add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:
      raise ChatTemplateError(f"{self.where}: the chat template failed: {e}") from None

  def end_of_turn_tokens(self) -> tuple[str, ...]:
    """The END_OF_TURN_TOKENS this template writes."""
    return tuple(t for t in END_OF_TURN_TOKENS if t in self.source)


def load(path: str, tokenizer_config: dict | None = None) -> ChatTemplate | None:
  """The chat template of the checkpoint directory `path`, or None when it has none.

  `tokenizer_config` is the parsed tokenizer_config.json (read here when None).
  """
  cfg_file = os.path.join(path, "tokenizer_config.json")
  if tokenizer_config is None:
    tokenizer_config = {}
    if os.path.exists(cfg_file):
      with open(cfg_file) as fh:
        tokenizer_config = json.load(fh)
  special = {name: text for name in SPECIAL_TOKEN_NAMES
             if (text := _token_text(tokenizer_config.get(name))) is not None}
  jinja_file = os.path.join(path, TEMPLATE_FILE)
  if os.path.exists(jinja_file):
    with open(jinja_file, encoding="utf-8") as fh:
      return ChatTemplate(fh.read(), special_tokens=special, where=jinja_file)
  source = tokenizer_config.get("chat_template")
  if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
    source = named.get("default")
    if source is None:
      raise ChatTemplateError(f"{cfg_file}: 'chat_template' lists templates "
                              f"{sorted(map(str, named))} but none named 'default'")
  if source is None:
    return None
  if not isinstance(source, str):
    raise ChatTemplateError(f"{cfg_file}: 'chat_template' must be a string or a list of "
                            f"{{name, template}}, got {type(source).__name__}")
  return ChatTemplate(source, special_tokens=special, where=cfg_file)

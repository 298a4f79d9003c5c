"""rl_jax.model.chat_template against transformers' apply_chat_template on the same files."""
import json

import pytest
import transformers

import tiny_hf
from rl_jax import model as M
from rl_jax.model import chat_template as ct

CHATS = [
    [{"role": "user", "content": "What is 12 plus 30?"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "What is 12 plus 30?  \n"}],
    [{"role": "user", "content": "Natalia sold {clips} in \"April\" & <May>."},
     {"role": "assistant", "content": "#### 72"},
     {"role": "user", "content": "Again?"}],
]


def _reference(path, chat):
  tok = transformers.AutoTokenizer.from_pretrained(str(path))
  text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
  ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
  return text, list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# transformers' assistant-mask tag and a tojson filter that must not escape HTML.
GENERATION_TAG = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m | tojson }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("layout", ["chatml_in_config", "llama_style_jinja_file",
                                    "generation_tag"])
def test_render_and_tokens_match_transformers(layout, tmp_path):
  if layout == "chatml_in_config":
    tiny_hf.write_tokenizer(tmp_path)
  elif layout == "generation_tag":
    tiny_hf.write_tokenizer(tmp_path, chat_template=GENERATION_TAG)
  else:
    # Both places hold a template: the .jinja file wins, as in transformers.
    tiny_hf.write_tokenizer(tmp_path, jinja=tiny_hf.LLAMA_STYLE, bos="<s>")
  tok = M.HFTokenizer(str(tmp_path))
  for chat in CHATS:
    want_text, want_ids = _reference(tmp_path, chat)
    got = tok.apply_chat_template(chat)
    assert got == want_text
    assert tok.encode(got) == want_ids
  if layout == "llama_style_jinja_file":
    assert got.startswith("<s>\n")  # bos_token reached the template


def test_stop_ids_hold_the_templates_end_of_turn_token(tmp_path):
  tiny_hf.write_tokenizer(tmp_path, eos="<|endoftext|>", generation_eos=("<|endoftext|>",))
  tok = M.HFTokenizer(str(tmp_path))
  im_end = tok._tok.token_to_id("<|im_end|>")
  eot = tok._tok.token_to_id("<|endoftext|>")
  assert tok.eos_id == eot and tok.stop_ids == {eot, im_end}
  # Without a template nothing is added.
  tiny_hf.write_tokenizer(tmp_path / "plain", chat_template=None, eos="<|endoftext|>",
                          generation_eos=("<|endoftext|>",))
  plain = M.HFTokenizer(str(tmp_path / "plain"))
  assert plain.chat_template is None and plain.stop_ids == {eot}
  with pytest.raises(ct.ChatTemplateError, match="has no chat template"):
    plain.apply_chat_template(CHATS[0])


def test_named_templates_use_default(tmp_path):
  tiny_hf.write_tokenizer(tmp_path)
  cfg_file = tmp_path / "tokenizer_config.json"
  cfg = json.loads(cfg_file.read_text())
  cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                          {"name": "default", "template": tiny_hf.CHATML}]
  cfg_file.write_text(json.dumps(cfg))
  want, _ = _reference(tmp_path, CHATS[1])
  assert M.HFTokenizer(str(tmp_path)).apply_chat_template(CHATS[1]) == want
  cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}]
  cfg_file.write_text(json.dumps(cfg))
  with pytest.raises(ct.ChatTemplateError, match=r"tokenizer_config.json.*none named 'default'"):
    M.HFTokenizer(str(tmp_path))


def test_template_errors_name_the_file(tmp_path):
  tiny_hf.write_tokenizer(tmp_path, jinja=tiny_hf.LLAMA_STYLE, bos="<s>")
  tok = M.HFTokenizer(str(tmp_path))
  with pytest.raises(ct.ChatTemplateError, match=r"chat_template.jinja: .*unknown role tool"):
    tok.apply_chat_template([{"role": "tool", "content": "x"}])
  (tmp_path / "chat_template.jinja").write_text("{% if %}")
  with pytest.raises(ct.ChatTemplateError, match=r"chat_template.jinja: chat template line 1"):
    M.HFTokenizer(str(tmp_path))

"""rl_jax.model.tokenizer: char tokenizer, tokenizer.json wrapper, prompt templates."""
import json
import string

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from rl_jax import model as M

SPECIALS = ["<pad>", "<s>", "</s>", "<eot>"]


def test_char_round_trip_and_ids():
  tok = M.CharTokenizer()
  text = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace(
      "\x0c", "")
  ids = tok.encode(text)
  assert len(ids) == len(text) and tok.decode(ids) == text
  assert min(ids) == 3 and max(ids) < tok.vocab_size == M.get_preset("tiny_char").vocab_size
  assert tok.encode(" ~") == [3, 97]
  assert tok.encode("12+3", add_bos=True) == [1] + [ord(c) - 29 for c in "12+3"]
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.stop_ids) == (0, 1, 2, {2})


def test_char_unknowns_and_specials():
  tok = M.CharTokenizer()
  assert tok.decode(tok.encode("é\t")) == "??"
  ids = [1] + tok.encode("ab") + [2, 0]
  assert tok.decode(ids) == "ab"
  assert tok.decode(ids, skip_special=False) == "<bos>ab<eos><pad>"
  assert tok.decode([120]) == "\ufffd"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok")
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  corpus = ["what is 12 + 30?", "the answer is 42.", "hello world, hello tokens"] * 20
  tok.train_from_iterator(corpus, trainer)
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"}))
  (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
  return path


def test_hf_tokenizer_round_trip_and_special_ids(hf_dir):
  tok = M.HFTokenizer(str(hf_dir))
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.stop_ids == {2, 3}
  assert 256 < tok.vocab_size <= 300
  text = "what is 7 + 35? the answer: 42 ünïcode"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert len(ids) < len(text.encode())  # merges were learned and used
  assert tok.encode(text, add_bos=True) == [1] + ids
  assert tok.decode([1] + ids + [2]) == text
  assert tok.decode([1] + ids + [2], skip_special=False) == "<s>" + text + "</s>"


def test_hf_tokenizer_falls_back_to_config_ids(hf_dir, tmp_path):
  (tmp_path / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(
      {"bos_token_id": 1, "eos_token_id": [3, 2], "pad_token_id": None}))
  tok = M.HFTokenizer(str(tmp_path))
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == (1, 3, 3, {2, 3})
  (tmp_path / "config.json").unlink()
  with pytest.raises(ValueError, match="no eos token"):
    M.HFTokenizer(str(tmp_path))


def test_load_tokenizer(hf_dir):
  assert isinstance(M.load_tokenizer("tiny_char"), M.CharTokenizer)
  assert isinstance(M.load_tokenizer(M.get_preset("qwen2_0_5b")), M.CharTokenizer)
  tok = M.load_tokenizer(M.get_preset("tiny_char"), path=str(hf_dir))
  assert isinstance(tok, M.HFTokenizer) and tok.eos_id == 2
  with pytest.raises(ValueError, match="vocab_size"):
    M.load_tokenizer(M.get_preset("tiny_char").replace(vocab_size=64))
  with pytest.raises(ValueError, match="unknown model preset"):
    M.load_tokenizer("nope")


def test_format_prompt():
  assert M.format_prompt("1+2") == "1+2"
  assert M.format_prompt("1+2", template='Q: {prompt}\nA {"json": 1}') == 'Q: 1+2\nA {"json": 1}'
  with pytest.raises(ValueError, match="placeholder"):
    M.format_prompt("x", template="no slot")

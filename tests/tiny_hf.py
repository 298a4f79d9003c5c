"""A tiny Hugging Face checkpoint directory and GSM8K-style data files, built offline.

The tokenizer is a byte-level BPE trained with `tokenizers` on a small corpus, with
Qwen-style special tokens and a ChatML chat template; the model is a random
transformers Qwen2ForCausalLM written with save_pretrained.
"""
import json
import os

# The Qwen2.5-Instruct template's structure (system default, tool branch with tojson,
# tool-call and tool-response turns), written with "{%-" whitespace control.
CHATML = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are a tiny model.' }}\n"
    "    {%- endif %}\n"
    "    {{- '\\n\\n<tools>' }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- '\\n' }}{{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- '\\n</tools><|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a tiny model.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}\n"
    "        {{- '\\n</tool_response><|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")

# A Llama-3-style template written WITHOUT "-" whitespace control, so its output depends
# on trim_blocks / lstrip_blocks; it reads bos_token and calls raise_exception.
LLAMA_STYLE = (
    "{{ bos_token }}\n"
    "{% for message in messages %}\n"
    "  {% if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "    {{ raise_exception('unknown role ' + message['role']) }}\n"
    "  {% endif %}\n"
    "  {% set content = '<|start|>' + message['role'] + '<|sep|>\\n\\n' + message['content'] | trim + '<|eot|>' %}\n"
    "  {{ content }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "  {{ '<|start|>assistant<|sep|>\\n\\n' }}\n"
    "{% endif %}\n")

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "<|start|>", "<|sep|>",
            "<|eot|>"]
CORPUS = [
    "What is 12 plus 30? Natalia sold clips to 48 of her friends in April.",
    "Reason step by step. End your reply with a line of the form '#### <number>' "
    "that holds only the final numeric answer.",
    "You are a helpful assistant who solves grade-school math word problems.",
    "system user assistant the answer is 42. #### 72 tools tool_response",
]


def write_tokenizer(path, *, chat_template=CHATML, jinja=None, eos="<|im_end|>",
                    bos=None, generation_eos=("<|im_end|>", "<|endoftext|>")):
  """tokenizer.json, tokenizer_config.json (+ chat_template.jinja when `jinja`) and
  generation_config.json in `path`; returns the tokenizers.Tokenizer."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
  os.makedirs(path, exist_ok=True)
  tok = Tokenizer(models.BPE())
  # Qwen2's pre-tokenizer: transformers builds a Qwen2Tokenizer (with this pattern) for a
  # directory whose config.json says qwen2, so the reference must see the same one.
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS * 20, trainer)
  tok.save(os.path.join(path, "tokenizer.json"))
  cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
         "pad_token": "<|endoftext|>", "model_max_length": 4096}
  if chat_template is not None:
    cfg["chat_template"] = chat_template
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(cfg, f)
  if jinja is not None:
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
      f.write(jinja)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [tok.token_to_id(t) for t in generation_eos]}, f)
  return tok


def write_checkpoint(path):
  """A random 2-layer Qwen2ForCausalLM (transformers save_pretrained) plus the tokenizer."""
  import torch
  import transformers
  tok = write_tokenizer(path)
  torch.manual_seed(0)
  cfg = transformers.Qwen2Config(
      vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=1024, tie_word_embeddings=True,
      bos_token_id=tok.token_to_id("<|endoftext|>"),
      eos_token_id=tok.token_to_id("<|im_end|>"))
  transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)
  # save_pretrained writes its own generation_config.json; keep the tokenizer's stop list.
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [tok.token_to_id("<|im_end|>"),
                                tok.token_to_id("<|endoftext|>")]}, f)
  return tok


def gsm8k_rows(n, start=0):
  rows = []
  for i in range(start, start + n):
    a, b = 3 + i, 40 + 7 * i
    rows.append({"question": f"Natalia sold {a} clips in April and {b} in May. How many in all?",
                 "answer": f"She sold {a} + {b} = <<{a}+{b}={a + b}>>{a + b} clips.\n#### {a + b}"})
  return rows


def write_parquet(path, rows):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(rows), path)


def write_jsonl(path, rows):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)

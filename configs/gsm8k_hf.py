"""GRPO on GSM8K from a local Hugging Face checkpoint, on one accelerator.

  python launch/train.py --config configs/gsm8k_hf.py \
      --config.model.path=/ckpt/Qwen2.5-0.5B-Instruct \
      --config.task.path=/data/gsm8k/main/train-00000-of-00001.parquet --workdir runs/gsm8k

Variants, combinable (`configs/gsm8k_hf.py:mode=sync,size=1.5b`):
  mode=async|sync   async GRPO with the staleness defaults (default), or the sync baseline
  size=0.5b|1.5b    sizes for a 0.5B (default) or 1.5B model on one 80-141 GB GPU
  devices=N         N chips on one host (e.g. a TPU VM): data-parallel sampler, FSDP
                    trainer, both on all N chips (colocated)
  lora=R            rank-R LoRA on every projection (alpha 32) of a frozen bfloat16 base
                    (model.param_dtype): fp32 masters and Adam moments for the adapters
                    only, adapter-only weight sync, PEFT export. Learning rate
                    base.lora_learning_rate: full fine-tuning's scaled by
                    sqrt(R * hidden) / 32 (5.3e-6 for 0.5B and 3.5e-6 for 1.5B at R = 8),
                    which matches the size of full fine-tuning's first update. Memory per
                    GPU: launch/plan.py (README, LoRA)

The checkpoint directory (config.json, *.safetensors, tokenizer.json,
tokenizer_config.json and/or chat_template.jinja, generation_config.json) supplies the
weights, the tokenizer, the chat template and the stop tokens (eos ids plus the template's
end-of-turn tokens, e.g. <|im_end|>); nothing is downloaded. task.path is the GSM8K train
split as the Hugging Face Parquet file or JSON lines of {"question", "answer"}; the
held-out set is a fixed hash split of it (task.heldout_size prompts, greedy, every
rl.eval_every steps), or set task.eval_path to the test split.

Numerics: fp32 master weights and Adam moments, bf16 compute, bf16 sampler weights and
KV cache. Sizes (per one GPU): prompts <= 384 tokens (longer ones dropped), completions
<= 512, 32 prompts x 8 completions per optimizer step, 256 decode slots, a KV pool of
4 GiB (0.5B) / 8 GiB (1.5B) (every slot at full length fits), micro-batches of 16 (0.5B)
/ 8 (1.5B) sequences per chip with layer rematerialisation. Learning rate 2e-6 (0.5B) /
1e-6 (1.5B) after 10 warm-up steps, clip 0.2 / 0.28 (clip-higher), k3 KL to the initial
policy with beta 0.001, truncated importance weights (cap 2) for the sampler/trainer
mismatch of async and bf16 sampling, a 0.1 format bonus for the '#### <number>' line.
"""
from configs import base

_SIZES = {
    # preset (shape fallback only: model.path supplies the real config), micro-batch,
    # learning rate, KV pool bytes
    "0.5b": ("qwen2_0_5b", 16, 2e-6, 4 * 2**30),
    "1.5b": ("qwen2_1_5b", 8, 1e-6, 8 * 2**30),
}
_HIDDEN = {"qwen2_0_5b": 896, "qwen2_1_5b": 1536}  # for the LoRA learning rate
SYSTEM_PROMPT = "You are a helpful assistant who solves grade-school math word problems."
PROMPT_TEMPLATE = ("{question}\n\nReason step by step. End your reply with a line of the "
                   "form '#### <number>' that holds only the final numeric answer.")


def _parse(arg):
  variants = {"mode": "async", "size": "0.5b", "devices": "1", "lora": "0"}
  for kv in (arg or "").split(","):
    if not kv:
      continue
    key, _, value = kv.partition("=")
    if key not in variants:
      raise ValueError(f"unknown variant {key!r}; known: {', '.join(variants)}")
    variants[key] = value
  if variants["mode"] not in ("async", "sync"):
    raise ValueError(f"variant mode={variants['mode']!r}; known: async, sync")
  if variants["size"] not in _SIZES:
    raise ValueError(f"variant size={variants['size']!r}; known: {', '.join(_SIZES)}")
  if not variants["devices"].isdigit() or int(variants["devices"]) < 1:
    raise ValueError(f"variant devices={variants['devices']!r} must be an integer >= 1")
  return variants


def get_config(arg=None):
  v = _parse(arg)
  preset, micro_batch, lr, kv_bytes = _SIZES[v["size"]]
  devices = int(v["devices"])
  c = base.get_config()
  c.model.preset = preset
  c.model.path = ""  # required: --config.model.path=/path/to/checkpoint
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"
  # Keep weight-matmul outputs, recompute the rest ("full" recomputes everything and
  # saves more memory; AOT peaks per policy in notes/PERFORMANCE.md).
  c.model.remat = "dots"
  c.model.attention = "auto"  # cuDNN flash attention on GPU (bf16), splash on TPU

  c.mesh.colocated = True
  c.mesh.sampler.data, c.mesh.sampler.tensor = devices, 1
  c.mesh.trainer.data, c.mesh.trainer.fsdp, c.mesh.trainer.tensor = 1, devices, 1

  c.task.name = "gsm8k"
  c.task.prompt_template = PROMPT_TEMPLATE
  c.task.format_reward = 0.1  # a small bonus for the asked-for '#### <number>' line
  c.task.heldout_fraction = 0.05  # ~370 of GSM8K's 7473 training questions
  c.task.heldout_size = 256
  c.data.chat = True
  c.data.system_prompt = SYSTEM_PROMPT
  c.data.max_prompt_length = 384
  c.data.on_long_prompt = "drop"  # a truncated chat prompt has lost its header

  s = c.sampler
  s.dtype = "bfloat16"
  s.layers = "auto"  # unrolled decode layers on accelerators
  s.max_concurrent_decodes = 256
  s.page_size = 64
  s.num_pages = 0
  # Per sampler replica: with N data-parallel replicas each holds 1/N of the slots.
  s.kv_cache_bytes = kv_bytes // devices
  s.max_prefill_length = c.data.max_prompt_length
  s.max_new_tokens = 512
  s.temperature = 1.0
  s.steps_per_call = 8

  t = c.trainer
  t.learning_rate = lr
  t.schedule = "constant"
  t.warmup_steps = 10
  t.weight_decay = 0.0
  t.grad_clip = 1.0
  t.micro_batch_size = micro_batch * devices
  t.length_buckets = (512, 640, 768, 896)
  t.logprob_chunk_len = 128  # lm head + logsumexp per 128 positions: no [b, t, 152k] tensor
  t.loss_agg = "token_mean"
  t.eps_low, t.eps_high = 0.2, 0.28
  t.tis_cap = 2.0
  t.kl_beta = 0.001
  t.kl_estimator = "k3"

  c.warmstart.steps = 0
  c.rl.mode = v["mode"]
  c.rl.total_steps = 300
  c.rl.groups_per_step = 32
  c.rl.group_size = 8
  c.rl.max_staleness = 2
  c.rl.max_inflight_groups = -1
  c.rl.queue_maxsize = 64
  c.rl.weight_sync_every = 1
  c.rl.inflight_weight_updates = True
  c.rl.eval_every = 25
  # The patience clock runs only while verifier calls are outstanding (compilation and
  # slow train steps do not count); GSM8K's checker answers in microseconds.
  c.rl.verifier_patience_s = 300.0

  c.verifier.workers = 16
  c.verifier.latency = "none"
  c.checkpoint.every = 50
  c.checkpoint.keep = 3
  if v["lora"] != "0":
    c.model.param_dtype = "bfloat16"  # the frozen base; adapters train in fp32
    base.set_lora(c, v["lora"], hidden_size=_HIDDEN[preset])
  return c

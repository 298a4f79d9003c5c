"""The whole rl_jax config tree with defaults.

Experiment files (configs/default.py, ...) start from `get_config()` here and change
fields. Every field that exists is listed here; rl_jax/config.py rejects any other.
"""
import math

import ml_collections

# LoRA variants' alpha (configs/default.py:lora=R, configs/gsm8k_hf.py:lora=R).
LORA_ALPHA = 32.0


def get_config(arg=None):
  """The default of every field, one section per helper below."""
  del arg
  c = ml_collections.ConfigDict()
  c.seed = 0
  _model(c)
  _mesh(c)
  _sampler(c)
  _trainer(c)
  _rl(c)
  _warmstart(c)
  _task(c)
  _verifier(c)
  _env(c)
  _data(c)
  _checkpoint(c)
  _metrics(c)
  return c


def _model(c) -> None:
  """c.model: preset and checkpoint, dtypes, remat, attention kernel, LoRA."""
  c.model = ml_collections.ConfigDict()
  c.model.preset = "tiny_char"  # see rl_jax/model/presets.py
  c.model.path = ""  # Hugging Face checkpoint directory; overrides the preset's weights
  # Compute dtype: auto | float32 | bfloat16. auto: bfloat16 on GPU/TPU, float32 on CPU.
  # Trained weights are always float32 masters (and Adam moments) whatever it is.
  c.model.dtype = "auto"
  # Storage dtype of frozen weights: the KL reference policy (trainer.kl_beta > 0) and,
  # with LoRA, the base model: float32 | bfloat16 (half the bytes; cast where used).
  c.model.param_dtype = "float32"
  # Layer rematerialisation: none | full (recompute each layer in the backward pass) |
  # dots (keep weight-matmul outputs, recompute the rest). Typed `object` so configs
  # written when this was a boolean still load: True means full, False none.
  c.model.remat = ml_collections.FieldReference("none", field_type=object)
  # Full-sequence attention kernel (training, prefill): auto | jnp | xla | cudnn | splash.
  # auto: cuDNN flash attention on GPU in bf16, Pallas splash on TPU, XLA on CPU.
  c.model.attention = "auto"
  # Low-rank adapters (rl_jax/model/lora.py): rank 0 = full fine-tuning. With rank > 0
  # the base weights are frozen (stored in model.param_dtype) and only the adapters
  # train (float32 masters and Adam moments); weight sync sends only the adapters and
  # the sampler merges W = W0 + (alpha / rank) A B on its own devices.
  c.model.lora = ml_collections.ConfigDict()
  c.model.lora.rank = 0
  c.model.lora.alpha = 16.0
  # Which projections get adapters, comma-separated: any of q,k,v,o,gate,up,down.
  c.model.lora.targets = "q,k,v,o,gate,up,down"
  c.model.lora.dropout = 0.0  # dropout on the low-rank path's input, training only


def _mesh(c) -> None:
  """c.mesh: colocated, or the sampler and trainer sub-meshes."""
  c.mesh = ml_collections.ConfigDict()
  # colocated: sampler and trainer share every device (one GPU, a laptop).
  c.mesh.colocated = False
  # Split mode: sampler devices first, then trainer devices; 4 + 4 of 8 here.
  c.mesh.sampler = ml_collections.ConfigDict(dict(data=4, tensor=1))
  c.mesh.trainer = ml_collections.ConfigDict(dict(data=1, fsdp=2, tensor=2))


def _sampler(c) -> None:
  """c.sampler: decode slots, KV pages, sampling, decode programs."""
  c.sampler = ml_collections.ConfigDict()
  c.sampler.max_concurrent_decodes = 64  # decode slots
  c.sampler.page_size = 16  # tokens per KV page
  c.sampler.num_pages = 0  # 0: derive from kv_cache_bytes
  c.sampler.kv_cache_bytes = 64 * 2**20  # KV budget per sampler replica
  c.sampler.max_prefill_length = 64
  c.sampler.max_new_tokens = 32
  c.sampler.temperature = 1.0
  c.sampler.top_k = 0  # 0: off
  c.sampler.top_p = 1.0
  c.sampler.dtype = "auto"  # sampler weight / KV dtype; auto: bfloat16 on GPU/TPU, float32 on CPU
  c.sampler.layers = "auto"  # decode layer loop: unrolled | scan; auto: unrolled
  c.sampler.attention = "auto"  # decode attention: jnp | ragged | pallas_tpu | pallas_gpu; auto: pallas_tpu on TPU, else jnp
  # Decode steps per host round trip: an integer >= 1, or "auto" (8 on GPU/TPU, 4 on CPU;
  # rl_jax.sampler.engine.resolve_steps_per_call). Typed object so configs may set an int.
  c.sampler.steps_per_call = ml_collections.FieldReference("auto", field_type=object)
  # Where new program buckets compile: inline (the call waits) | background (a compiled
  # program covering the call runs meanwhile; single-process async runs only) | ahead
  # (only the programs covering every call, compiled before the run) | auto:
  # background in single-process async runs, else inline (sampler/programs.py).
  c.sampler.compile = "auto"


def _trainer(c) -> None:
  """c.trainer: optimizer, micro-batches, lm-head chunks, length buckets, GRPO loss."""
  c.trainer = ml_collections.ConfigDict()
  c.trainer.learning_rate = 1e-4
  c.trainer.schedule = "constant"  # constant | cosine
  c.trainer.warmup_steps = 0
  c.trainer.weight_decay = 0.0
  c.trainer.b1 = 0.9
  c.trainer.b2 = 0.99
  c.trainer.grad_clip = 1.0
  c.trainer.micro_batch_size = 0  # rollouts per micro-batch; 0: whole batch at once
  c.trainer.logprob_chunk_len = 128  # positions per lm-head chunk; 0: the whole sequence
  # Per-device budget for the lm head's saved softmax (micro-batch rows x length x vocab in
  # the compute dtype, over data x fsdp): within it the backward reuses it, above it the
  # backward recomputes each chunk's logits (one more head GEMM). 0: always recompute.
  c.trainer.logprob_save_bytes = 4 * 2**30
  c.trainer.num_minibatches = 1  # optimizer updates per batch
  c.trainer.length_buckets = (64, 128, 256, 512, 1024, 2048, 4096)
  # auto: pack whole sequences into rows of the length bucket where the attention kernel
  # takes segment ids (xla/jnp, splash; not cuDNN), else padded rows; off: padded rows.
  c.trainer.packing = "auto"
  c.trainer.loss_agg = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
  c.trainer.eps_low = 0.2
  c.trainer.eps_high = 0.28
  c.trainer.tis_cap = 2.0  # truncated importance weight cap C; 0: off
  c.trainer.ratio_level = "token"  # token | sequence (GSPO)
  c.trainer.std_normalize = True  # GRPO; False: Dr. GRPO
  c.trainer.kl_beta = 0.0  # 0 skips the reference forward
  c.trainer.kl_estimator = "k3"  # k1 | k3
  c.trainer.loss_norm_len = 0  # Dr. GRPO's constant length; 0: sampler.max_new_tokens


def _rl(c) -> None:
  """c.rl: mode, batch shape, staleness and admission, filtering, live control."""
  c.rl = ml_collections.ConfigDict()
  c.rl.mode = "async"  # sync | async
  c.rl.total_steps = 100  # optimizer steps
  c.rl.groups_per_step = 16  # prompts per optimizer step
  c.rl.group_size = 8  # G completions per prompt
  c.rl.max_staleness = 2  # policy versions; staleness = trainer_version - min(token_versions)
  c.rl.max_inflight_groups = -1  # -1: (max_staleness + 1) * groups_per_step
  c.rl.queue_maxsize = 64  # eligible groups
  # Which queued group the trainer takes first (async): oldest_version (the group sampled
  # by the oldest policy version first, ties by arrival) | fifo (arrival order).
  # docs/live_control.md#queue-order has the measurements behind the default.
  c.rl.queue_order = "oldest_version"
  c.rl.weight_sync_every = 1  # optimizer steps between publications
  c.rl.inflight_weight_updates = True
  c.rl.eval_every = 10  # optimizer steps between held-out evaluations; 0: only at start/end
  c.rl.verifier_patience_s = 60.0  # give up when no group verifies for this long
  # none | zero_variance: groups whose rewards are all equal are not trained; replaced
  c.rl.filter_groups = "none"
  c.rl.max_oversample = 4  # filtering samples at most this many x the batch per step
  c.rl.overlong = "none"  # none | mask (truncated completions out of the loss) | penalty
  c.rl.overlong_buffer = 0  # penalty: tokens before the limit where the penalty ramps
  # Live capacity control (rl_jax/orchestration/control.py): auto | admission | off.
  # admission: every control_every optimizer steps the planner's models are refitted from
  # the run's own recent metrics and set the async admission bound and the decode slots in
  # use (within the config's limits and the staleness rule), never below a floor that a
  # window whose trainer waited on an empty queue raises. auto: admission in async mode,
  # off in sync mode (which it never changes). Off by default: on a workload whose lengths
  # do not drift it holds the fixed settings and its process cost about 4% of steps per
  # hour (docs/live_control.md); configs/length_drift.py turns it on.
  c.rl.control = "off"
  c.rl.control_every = 20  # optimizer steps per control window


def _warmstart(c) -> None:
  """c.warmstart: supervised steps before RL."""
  c.warmstart = ml_collections.ConfigDict()
  c.warmstart.steps = 0  # supervised steps on generated demonstrations before RL
  c.warmstart.batch_size = 64
  c.warmstart.learning_rate = 1e-3


def _task(c) -> None:
  """c.task: which task, its data files and sizes."""
  c.task = ml_collections.ConfigDict()
  c.task.name = "arithmetic"  # arithmetic | calculator | carries | countdown | gsm8k | jsonl
  c.task.path = ""  # data file for gsm8k / jsonl: .jsonl, .json (lines) or .parquet
  c.task.eval_path = ""  # gsm8k / jsonl: held-out file (e.g. test split); "": split task.path
  c.task.prompt_template = "{question}\nAnswer:"  # gsm8k: prompt text around the question
  c.task.matcher = "numeric"  # jsonl: exact | numeric | regex
  c.task.digits = 2
  c.task.num_terms = 2
  c.task.operators = "+"
  c.task.format_reward = 0.0  # weight of the optional format reward
  c.task.tool_demo_fraction = 0.5  # calculator: share of warm-up demonstrations that call the tool
  c.task.working_demo_fraction = 0.1  # carries: share of warm-up demonstrations showing the working
  c.task.heldout_size = 256
  c.task.heldout_fraction = 0.1  # hash-based share of prompts kept for held-out


def _verifier(c) -> None:
  """c.verifier: the reward worker pool and its simulated latency and failures."""
  c.verifier = ml_collections.ConfigDict()
  c.verifier.backend = "threads"  # threads | processes
  c.verifier.workers = 8
  c.verifier.timeout_s = 5.0
  c.verifier.retries = 1
  # A group with any verifier error or timeout (after retries): "drop" it (not trained on,
  # counted as groups_dropped_verifier_error) or train on it with reward 0 ("zero").
  c.verifier.on_error = "drop"
  c.verifier.latency = "none"  # none | fixed | lognormal | pareto | empirical
  c.verifier.latency_mean_s = 0.0
  c.verifier.latency_sigma = 1.0  # lognormal sigma
  c.verifier.latency_alpha = 1.5  # pareto shape
  c.verifier.latency_file = ""  # empirical: one latency in seconds per line
  c.verifier.failure_prob = 0.0


def _env(c) -> None:
  """c.env: episodes of tool-using tasks and their tool pool."""
  # Tool-using tasks (those with an environment, e.g. calculator): a rollout is an episode
  # of model turns and environment observations (rl_jax/envs).
  c.env = ml_collections.ConfigDict()
  c.env.max_turns = 3  # model turns per episode; a tool call in the last one ends it
  c.env.max_total_tokens = 0  # completion tokens per episode (model + observation); 0: sampler.max_new_tokens
  # Tool calls run in a worker pool like the verifier's (same fields and semantics); a call
  # that fails or times out (after retries) gives the model an error observation.
  c.env.tool = ml_collections.ConfigDict()
  c.env.tool.backend = "threads"  # threads | processes
  c.env.tool.workers = 16
  c.env.tool.timeout_s = 5.0
  c.env.tool.retries = 1
  c.env.tool.latency = "none"  # none | fixed | lognormal | pareto | empirical
  c.env.tool.latency_mean_s = 0.0
  c.env.tool.latency_sigma = 1.0  # lognormal sigma
  c.env.tool.latency_alpha = 1.5  # pareto shape
  c.env.tool.latency_file = ""  # empirical: one latency in seconds per line
  c.env.tool.failure_prob = 0.0


def _data(c) -> None:
  """c.data: the prompt pipeline."""
  c.data = ml_collections.ConfigDict()
  c.data.shuffle = True
  c.data.num_epochs = 0  # 0: repeat forever
  c.data.max_prompt_length = 64  # tokens
  c.data.on_long_prompt = "truncate"  # truncate | drop
  c.data.on_bad_line = "skip"  # skip | fail
  # Render each prompt with the chat template of model.path's tokenizer files:
  # [system (when data.system_prompt is set), user = the task's prompt] + generation prompt.
  c.data.chat = False
  c.data.system_prompt = ""


def _checkpoint(c) -> None:
  """c.checkpoint: cadence, retention, preemption grace period."""
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 0  # optimizer steps; 0: off
  c.checkpoint.keep = 3
  c.checkpoint.keep_best = False
  c.checkpoint.async_save = True
  # After SIGTERM (preemption) the run saves and exits within this many seconds, or
  # exits without a new checkpoint when the save cannot finish in time.
  c.checkpoint.grace_period_s = 30.0
  # Async mode: which rollouts a checkpoint keeps. "all": the queued groups, the groups
  # being verified, and the sequences being decoded (continued after a resume); "queued":
  # the queued and verifying groups; "off": none (every group in flight is lost on resume).
  # Sync mode regenerates its window bit for bit whatever this says.
  c.checkpoint.rollouts = "all"


def _metrics(c) -> None:
  """c.metrics: logging cadence and writers."""
  c.metrics = ml_collections.ConfigDict()
  c.metrics.log_every = 1
  c.metrics.tensorboard = True
  c.metrics.console = True



def lora_learning_rate(full_ft_lr: float, *, rank: int, hidden_size: int,
                       alpha: float = LORA_ALPHA) -> float:
  """The LoRA learning rate that matches full fine-tuning's first step at `full_ft_lr`:

    lr_lora = full_ft_lr * sqrt(rank * hidden_size) / alpha.

  Adam's first step is a sign step. Full fine-tuning moves W by lr per entry along a
  gradient that is coherent over its input axis, so a layer's output moves ~ lr * d;
  LoRA's first step moves only B (A's gradient is 0 at B = 0), and the output moves
  ~ (alpha / r) * lr * sqrt(r d). Matching the two gives the factor above: about 1 for
  the tiny default (r 8, d 128, alpha 32), 2.6 for Qwen2.5-0.5B and 11 for an 8B model
  (r 32, d 4096), the ~10x that LoRA studies report at that scale. Measured first-step
  logit changes follow alpha / sqrt(r d) within 8% at rank 8 (notes/TUNING.md).
  """
  return full_ft_lr * math.sqrt(rank * hidden_size) / alpha


def set_lora(c, rank: str, *, hidden_size: int) -> None:
  """The `lora=R` variant of an experiment file: rank R adapters on every projection,
  alpha LORA_ALPHA, its learning rate scaled from c.trainer.learning_rate (full
  fine-tuning's) by lora_learning_rate; R = 0 leaves `c` as it is."""
  if not rank.isdigit():
    raise ValueError(f"variant lora={rank!r} must be an integer >= 0 (the rank; 0 = off)")
  if int(rank) == 0:
    return
  c.model.lora.rank = int(rank)
  c.model.lora.alpha = LORA_ALPHA
  c.trainer.learning_rate = lora_learning_rate(c.trainer.learning_rate, rank=int(rank),
                                               hidden_size=hidden_size)


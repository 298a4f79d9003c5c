"""The embedded default: tiny char-level model, 2-digit addition, async GRPO on CPU devices.

A heavy-tailed verifier latency (lognormal, emulating tool calls) makes the barrier of
sync mode costly: every sync step waits for the slowest of its 256 calls, while async
keeps sampling and training during them. configs/sync_baseline.py is the same workload
in sync mode, configs/no_tool_latency.py the same workload without verifier latency
(the compute-bound case). Variants, combinable (`configs/default.py:mode=sync,lora=8`):
  mode=async|sync   async GRPO (default) or the sync baseline
  lora=R            RL trains rank-R LoRA adapters on every projection (alpha 32) of the
                    base that the supervised warm-up made (the warm-up trains the full
                    model); learning rate base.lora_learning_rate (2e-4 at R = 8)

Tuned for held-out reward per wall time on a 2-core CPU (notes/TUNING.md): 64 prompts x
4 completions per step (more prompts per step beat more completions per prompt), AdamW
at 2e-4, 400 steps; decode slots for a whole batch; completions of at most 8 tokens
(an answer has at most 3 digits plus the stop token), so every batch fits the 16-token
length bucket and the train step compiles once; zero-variance groups filtered and
replaced; the sampler on one host device and the trainer on four (the launcher makes
the 5 devices), the sampler's programs compiled once before the run, and an admission
queue of three batches.
"""
from configs import base


def get_config(arg=None):
  c = base.get_config()
  c.model.preset = "tiny_char"
  c.task.name = "arithmetic"
  c.task.digits = 2
  c.task.num_terms = 2
  c.task.operators = "+"
  # Pure data parallelism on both sides: on CPU, FSDP/TP collectives cost more than the
  # tiny model's math. Sampler devices first, then trainer devices. The sampler takes
  # one device: a decode call split over 4 CPU devices costs 1.4-2.8x the same call on
  # one (fixed cost per device and call, notes/TUNING.md); the train step gains from 4.
  c.mesh.sampler.data = 1
  c.mesh.sampler.tensor = 1
  c.mesh.trainer.data = 4
  c.mesh.trainer.fsdp = 1
  c.mesh.trainer.tensor = 1
  c.data.max_prompt_length = 16
  c.sampler.max_prefill_length = 16
  c.sampler.max_new_tokens = 8
  c.sampler.page_size = 8
  c.sampler.max_concurrent_decodes = 256
  # Only the two programs that cover every call, compiled before the run: on this CPU a
  # bucket's compile (2-3 s) costs more than the padding it would save.
  c.sampler.compile = "ahead"
  c.trainer.length_buckets = (16, 32)
  c.trainer.learning_rate = 2e-4
  c.warmstart.steps = 300
  c.warmstart.batch_size = 64
  c.warmstart.learning_rate = 1e-3
  c.rl.mode = "async"
  c.rl.total_steps = 400
  c.rl.max_staleness = 2
  c.rl.groups_per_step = 64
  c.rl.group_size = 4
  # Train only groups with signal (about 60% of sampled groups are uniform here).
  c.rl.filter_groups = "zero_variance"
  # Room for the next batches while the last verifier calls of this one run: the
  # staleness rule's bound, (max_staleness + 1) x groups_per_step.
  c.rl.queue_maxsize = 192
  c.rl.eval_every = 25
  c.task.heldout_size = 512
  # Tool-call-like verification: every call of a step can run at once, heavy-tailed
  # latency (lognormal, mean 0.15 s, p99 about 0.9 s): a sync step waits for the slowest
  # of its 256 calls (about 1.5 s on average).
  c.verifier.workers = 256
  c.verifier.latency = "lognormal"
  c.verifier.latency_mean_s = 0.15
  c.verifier.latency_sigma = 1.0
  for kv in (arg or "").split(","):
    if not kv:
      continue
    key, _, value = kv.partition("=")
    if key == "mode":
      c.rl.mode = value
    elif key == "lora":
      base.set_lora(c, value, hidden_size=128)  # tiny_char's width
    else:
      raise ValueError(f"unknown variant {key!r}; known: mode, lora")
  return c

"""A workload whose completions grow during training: the one live control is for.

2-digit addition where the reward pays for the working (rl_jax/tasks/carries.py): a
correct bare answer ("132") earns 0.5, a correct answer with every column step shown
("7+5=12 4+8+1=13 =132") earns 1. The warm-up teaches mostly bare answers (a quarter
of its demonstrations show the working), so RL starts mostly short, finds that showing
the carries pays, and the median completion grows from 4 to about 16 tokens. The pipeline
calibrated for short answers (sampler slots, admission bound) becomes unbalanced.

Otherwise the embedded default's model, mesh, batch, queue and verifier latency; half
its decode slots; no filtering. Variants:
`:control=off` (a fixed admission bound, (max_staleness + 1) x groups_per_step),
`:mode=sync`.
"""
from configs import default


def get_config(arg=None):
  variants = dict(kv.partition("=")[::2] for kv in (arg or "").split(",") if kv)
  c = default.get_config("mode=" + variants.pop("mode") if "mode" in variants else None)
  c.rl.control = "auto"  # live control in async mode (off in the base default)
  if "control" in variants:
    c.rl.control = variants.pop("control")
  if variants:
    raise ValueError(f"unknown variant {next(iter(variants))!r}; known: mode, control")
  # No filtering: every admitted group is trained or discarded as too stale, so the
  # discard rate is the admission bound's alone. The default's queue (192 groups, the
  # staleness rule's bound) stays: with a queue of one batch (64) the queue's bound, not
  # the admission bound, would decide how far ahead the sampler runs.
  c.rl.filter_groups = "none"
  c.task.name = "carries"
  c.task.digits = 2
  c.task.working_demo_fraction = 0.25
  c.data.max_prompt_length = 8  # "99+99=" and bos
  c.sampler.max_prefill_length = 8
  c.sampler.max_new_tokens = 24
  c.trainer.length_buckets = (16, 32)
  # Padded rows: 2 batch shapes (one per length bucket). Packing's row counts follow the
  # drifting lengths and would compile a new train step every few steps on this CPU.
  c.trainer.packing = "off"
  # Half the default's decode slots: a batch of short answers fits them, one that shows
  # its working (5x the tokens) does not, and the largest generate program (the slowest
  # CPU compile) halves.
  c.sampler.max_concurrent_decodes = 128
  # Held-out reward passes 0.9 by about step 100 (the default's schedule is 400 steps).
  c.rl.total_steps = 150
  c.rl.eval_every = 15
  # A CPU compile of a new generate shape can stall the pipeline for minutes on a loaded
  # machine; that is not a verifier outage.
  c.rl.verifier_patience_s = 900.0
  c.rl.control_every = 20
  return c

"""Supervised warm-up on the task's demonstrations before RL (warmstart.steps > 0)."""
from __future__ import annotations

import numpy as np

from rl_jax.orchestration.errors import Preempted


def run(p) -> None:
  """Warms up pipeline `p` (loop.Pipeline): warmstart.steps supervised steps on batches
  of warmstart.batch_size demonstrations drawn with seed + 7, then p.state starts RL
  from the warmed-up params with fresh optimizer moments (with kl_beta > 0 they are also
  the reference policy). Under LoRA the warm-up trains the full model (from the base)
  and its result becomes the frozen base under fresh adapters."""
  import jax
  from rl_jax.data.prompts import demonstration_tokens, encode_prompt
  w = p.cfg.warmstart
  if w.steps <= 0:
    return
  rng = np.random.default_rng(p.cfg.seed + 7)
  sft = p.trainer.init_sft_state(
      params=p.trainer.base_params if p.trainer.lora else p.state.params)
  for step in range(w.steps):
    if p._preempt.is_set():
      raise Preempted()
    idx = rng.integers(0, p.task.num_train, size=w.batch_size)
    examples = [p.task.example(int(i)) for i in idx]
    prompts = [encode_prompt(e.prompt, tokenizer=p.tokenizer,
                             max_length=p.cfg.data.max_prompt_length)[0] for e in examples]
    demos = [demonstration_tokens(p.task, e, tokenizer=p.tokenizer) for e in examples]
    sft, m = p.trainer.sft_step(sft, p.trainer.make_sft_batch(
        prompts, [d[0] for d in demos], completion_masks=[d[1] for d in demos]))
    if step % 50 == 0 or step == w.steps - 1:
      p.console.message(f"warm-up step {step}: loss {m['loss']:.3f} "
                        f"token accuracy {m['token_accuracy']:.3f}")
  p.state = p.trainer.init_state(params=sft.params, rng=jax.random.PRNGKey(p.cfg.seed))

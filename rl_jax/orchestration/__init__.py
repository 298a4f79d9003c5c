"""rl_jax.orchestration: the sync / async GRPO pipeline.

  loop            Pipeline: builds the parts, the top-level run, the shared train step
  policy          StalenessPolicy: admission, acceptance, publication, credit release
                  (the planner's simulation calls the same object)
  rollout_queue   bounded queue of verified groups with the admission counters
  sampler_worker  the sampler thread: admission, generator steps, verification, swaps
  accounting      clock, busy timers, counters, the metrics row, summary.json
  control         live capacity control (rl.control): refit the planner every window,
                  set the admission bound and decode slots, advise restarts
  checkpointing   checkpoint cut, save / restore, SIGTERM, failures
  heldout         the fixed held-out set and its greedy evaluation
  weight_sync     trainer mesh -> sampler mesh weight transfer
  multihost       multi-process schedule (leader logs, followers replay), digests
  runtime         process start-up before JAX initialises
  errors          RunError, Preempted
"""

"""The parts of a Pipeline (rl_jax/orchestration/loop.py), built from a validated config.

Pipeline.__init__ calls these in order: `make_data` (model config, tokenizer, task,
prompt stream, environment, held-out set; returns the initial params), `make_models`
(trainer and its state, weight sync, sampler engine) and `make_workers` (accounting,
verifier pool, tool use, sampler worker). Each sets the attributes it names on the
pipeline `p`; `initial_weights_dtype` and `sampler_compile` are the two decisions they
take from the config.
"""
from __future__ import annotations

import concurrent.futures

from rl_jax.orchestration.accounting import RunAccounting
from rl_jax.orchestration.errors import RunError
from rl_jax.orchestration.heldout import make_heldout
from rl_jax.orchestration.sampler_worker import SamplerWorker


def initial_weights_dtype(cfg) -> str:
  """The dtype model.path's weights are read in: model.param_dtype for a LoRA base that
  no warm-up trains (it is only ever frozen in that dtype: no float32 copy, 4 bytes per
  weight, on the way), else float32 (the trainer's master params)."""
  frozen = cfg.model.lora.rank > 0 and int(cfg.warmstart.steps) <= 0
  return cfg.model.param_dtype if frozen else "float32"


def sampler_compile(cfg, multi: bool) -> str:
  """Where the sampler's programs compile (sampler.compile; sampler/programs.py):
  "background" in a single-process async run unless the config says "inline" or
  "ahead" (only the covering programs, before the clock: the same programs in every
  run and process), else "inline". Sync runs stay reproducible bit for bit, and every process of a
  multi-process run launches the same programs."""
  mode = cfg.sampler.compile
  if mode == "background" and multi:
    raise RunError("sampler.compile='background' needs a single-process run (every process "
                   "must launch the same programs); use 'auto', 'inline' or 'ahead'")
  if mode == "auto":
    mode = "background" if cfg.rl.mode == "async" and not multi else "inline"
  return mode


def make_data(p, multi: bool):
  """Model config, tokenizer, task, prompt stream, environment and held-out set of
  pipeline `p` (p.model_cfg, p.tokenizer, p.task, p.prompts, p.env, p.heldout); the
  initial params. Notes sizes that make no sense for the backend."""
  import jax
  from rl_jax import envs
  from rl_jax import model as model_lib
  from rl_jax.data import prompts as prompts_lib
  from rl_jax.orchestration import multihost, runtime
  from rl_jax.tasks import make_task
  cfg = p.cfg
  p.model_cfg, init_params = model_lib.from_run_config(
      cfg.model, weights=True, weights_dtype=initial_weights_dtype(cfg))
  note = runtime.cpu_size_note(cfg, p.model_cfg, jax.default_backend())
  if note:
    p.console.message(note)
  p.tokenizer = model_lib.load_tokenizer(cfg.model.preset, path=cfg.model.path)
  p.task = make_task(cfg.task, seed=cfg.seed, on_bad_line=cfg.data.on_bad_line)
  shard = multihost.prompt_shard() if multi else (jax.process_index(), jax.process_count())
  p.prompts = prompts_lib.make_prompt_source(
      p.task, cfg.data, p.tokenizer, seed=cfg.seed,
      process_index=shard[0], process_count=shard[1])
  p.env = envs.make_env(p.task, cfg.env)
  if p.env is not None and multi:
    raise RunError(f"task.name={cfg.task.name!r} uses tools, and tool-using episodes run "
                   "in a single process for now; run it without jax.distributed")
  p.heldout = make_heldout(cfg, p.task, p.tokenizer, env=p.env)
  return init_params


def make_models(p, init_params, multi: bool) -> None:
  """Trainer and its state, weight sync, sampler engine of pipeline `p` (p.trainer,
  p.state, p.weight_sync, p.engine, p._compiler, p.sampling; p.evaluator is None)."""
  import jax
  from rl_jax.orchestration import multihost
  from rl_jax.orchestration.weight_sync import LayoutError, WeightSync
  from rl_jax.sampler.engine import Engine, Sampling
  from rl_jax.trainer.train_step import Trainer
  cfg = p.cfg
  p.trainer = Trainer(p.model_cfg, cfg.trainer, p.meshes.trainer,
                      total_steps=cfg.rl.total_steps,
                      sft_learning_rate=cfg.warmstart.learning_rate,
                      loss_norm_len=cfg.trainer.loss_norm_len or cfg.sampler.max_new_tokens)
  p.state = p.trainer.init_state(params=init_params, rng=jax.random.PRNGKey(cfg.seed))
  try:
    # Under LoRA state.params are the adapters: only they travel per publication.
    p.weight_sync = WeightSync.for_policy(
        p.model_cfg, jax.eval_shape(lambda: p.state.params),
        trainer_shardings=p.trainer.param_shardings,
        sampler_mesh=p.meshes.sampler, sampler_dtype=cfg.sampler.dtype,
        colocated=p.meshes.colocated)
  except LayoutError as e:
    raise RunError(str(e)) from None
  p.engine = Engine.from_config(cfg.sampler, p.model_cfg, mesh=p.meshes.sampler,
                                tokenizer=p.tokenizer)
  p._compiler = None
  where = sampler_compile(cfg, multi)
  if where == "background":
    p._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile")
    p.engine.compile_in_background(p._compiler)
  elif where == "ahead":
    p.engine.compile_covers_only()
  if multi:
    p.engine = multihost.ReplicatedOutputs(p.engine)
  p.sampling = Sampling(temperature=cfg.sampler.temperature, top_k=cfg.sampler.top_k,
                        top_p=cfg.sampler.top_p)
  p.evaluator = None  # made with the sampler's generator at the first publication


def make_workers(p) -> None:
  """Accounting, verifier pool, tool use and the sampler worker of pipeline `p` (p.acc,
  p.pool, p.tools, p.worker)."""
  from rl_jax.orchestration.episodes import ToolUse
  from rl_jax.tasks.verifier_pool import VerifierPool
  cfg = p.cfg
  sampler_ids = {d.id for d in p.meshes.sampler.devices.flat}
  trainer_ids = {d.id for d in p.meshes.trainer.devices.flat}
  p.acc = RunAccounting(mode=cfg.rl.mode, sampler_devices=len(sampler_ids),
                        trainer_devices=len(trainer_ids),
                        total_devices=len(sampler_ids | trainer_ids))
  # Followers take process 0's rewards from the event log and verify nothing.
  p.pool = (None if p.schedule.follower
            else VerifierPool(p.task, cfg.verifier, seed=cfg.seed))
  p.tools = (None if p.env is None
             else ToolUse(cfg, p.env, p.tokenizer, p.acc))
  p.worker = SamplerWorker(
      cfg=cfg, task=p.task, prompts=p.prompts, tokenizer=p.tokenizer,
      queue=p.queue, policy=p.policy, accounting=p.acc, schedule=p.schedule,
      pool=p.pool, on_error=p._fail, episodes=p.tools and p.tools.driver)

"""The sharded GRPO / SFT update (batches: rl_jax.trainer.batch).

Shape letters: b = rows the step trains, t = token positions (the length bucket),
v = vocabulary, n = chunks (minibatches or micro-batches).

Update. `Trainer.step` is one jitted call with donated state:
  1. pi_prox (and pi_ref when kl_beta > 0) log-probs of the whole batch at the current
     params, without gradient; with one minibatch pi_prox equals pi_theta at the update
     point, so it is taken from the loss forward instead of a separate pass;
  2. for each of trainer.num_minibatches strided minibatches: gradients summed over
     micro-batches with lax.scan (loss weights use minibatch-wide token / sequence
     counts, so the sum equals the full-minibatch gradient), then one optax update that
     is discarded (params and opt_state kept bitwise) if the loss or gradient norm is
     not finite.
Minibatch i takes rows i, i + n, i + 2n, ...: with rows sharded in contiguous blocks
over (data, fsdp) this split is a local reshape, no data moves between devices.

Log-probs. Every forward (loss, pi_prox, pi_ref, SFT) takes the model's final hidden
states and runs the vocabulary projection in chunks of trainer.logprob_chunk_len
positions (rl_jax.model.head), so a [b, t, v] float32 array never exists; its GEMMs take
compute-dtype operands forward and backward. The backward reuses the forward's softmax
(compute dtype) when a micro-batch's fits trainer.logprob_save_bytes per device, and
recomputes the chunk's logits otherwise (Trainer.head_recomputes).
The step also reports the train/inference mismatch (`grpo.logprob_mismatch`):
|pi_prox - mu| on the tokens the sampler drew with the very params the step starts from.

Supervised warm-up (`sft_step`) uses the same accumulation with token-mean
cross-entropy on completion tokens and its own optimizer (constant
`sft_learning_rate`, the trainer's b1 / b2 / weight decay / clip). Its state comes
from `init_sft_state`; after the warm-up, `init_state(params=sft_state.params)` starts
RL with fresh Adam moments (and, when kl_beta > 0, the warmed-up params as reference).

LoRA (model_cfg.lora_rank > 0): `init_state(params=base)` freezes the base as
`base_params` (model.param_dtype, TRAIN_RULES shardings; a step argument, not donated, and
the KL reference) and the state's `params` are the adapters (rl_jax.model.lora; float32,
Adam only for them), the only tree differentiated. lora_dropout keys fold in the state's
step, minibatch and micro-batch (update forwards only). The warm-up trains the full
model: the base that LoRA RL starts from.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.model import attention as attention_lib
from rl_jax.model import lora
from rl_jax.trainer import buckets
from rl_jax.trainer import grpo
from rl_jax.trainer import optimizer as opt_lib
from rl_jax.trainer.batch import (GRPO_KEYS, ROW_KEYS, SFT_KEYS, TrainBatch, batch_rows,
                                  make_sft_batch, make_train_batch, pad_rows)
from rl_jax.trainer.state import TrainState, global_norm, merge_rows, split_rows, tree_where
from rl_jax.types import Group


class Trainer:
  """GRPO (and supervised warm-up) updates of one model on the trainer mesh.

  `total_steps` counts `step` calls; the schedule runs over
  total_steps * num_minibatches optimizer updates (warm-up likewise scaled).
  `loss_norm_len` is the constant length of the seq_mean_token_sum_norm aggregation
  (Dr. GRPO); pass the generation budget (sampler.max_new_tokens). Default: the
  largest length bucket.
  """

  def __init__(self, model_cfg, trainer_cfg, mesh, *, total_steps: int,
               sft_learning_rate: float = 1e-3, loss_norm_len: int | None = None):
    self.cfg = trainer_cfg
    self.mesh = mesh
    self._check_cfg()
    self.compute_dtype = jnp.dtype(model_cfg.dtype)
    # The attention kernel every trace of this trainer runs, chosen once at the longest
    # bucket (recorded from self.attention); a later shape it cannot take raises.
    self.attention = attention_lib.select(
        model_cfg.attention, self.compute_dtype, mesh.devices.flat[0].platform,
        (max(trainer_cfg.length_buckets), model_cfg.num_heads, model_cfg.num_kv_heads,
         model_cfg.head_dim))
    self.model_cfg = model_cfg.replace(attention=self.attention.name)
    self.dp = mesh.shape["data"] * mesh.shape["fsdp"]
    self.num_minibatches = int(trainer_cfg.num_minibatches)
    self.micro_batch_size = int(trainer_cfg.micro_batch_size)
    if self.micro_batch_size % self.dp:
      raise ValueError(
          f"trainer.micro_batch_size ({self.micro_batch_size}) must be a multiple of the "
          f"trainer's data-parallel size data*fsdp = {self.dp}")
    self.loss_norm_len = int(loss_norm_len or max(trainer_cfg.length_buckets))
    self.logprob_chunk_len = int(trainer_cfg.logprob_chunk_len)
    self.logprob_save_bytes = int(trainer_cfg.logprob_save_bytes)
    self.packed = self._packing()
    self._traces = {"init": 0, "step": 0, "sft_step": 0, "logprobs": 0, "loss_and_grad": 0}

    nm = self.num_minibatches
    self.schedule = opt_lib.lr_schedule(
        learning_rate=float(trainer_cfg.learning_rate), schedule=trainer_cfg.schedule,
        warmup_steps=int(trainer_cfg.warmup_steps) * nm, total_steps=int(total_steps) * nm)
    common = dict(b1=float(trainer_cfg.b1), b2=float(trainer_cfg.b2),
                  weight_decay=float(trainer_cfg.weight_decay),
                  grad_clip=float(trainer_cfg.grad_clip))
    self.optimizer = opt_lib.make_optimizer(learning_rate=self.schedule, **common)
    self.sft_learning_rate = float(sft_learning_rate)
    self.sft_optimizer = opt_lib.make_optimizer(learning_rate=self.sft_learning_rate, **common)

    self.replicated = shd.replicated(mesh)
    self.lora = lora.enabled(model_cfg)
    full_shapes = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32),
        jax.eval_shape(lambda: model.init_params(model_cfg, jax.random.key(0))))
    # Shardings of the full model's weights: the base under LoRA, the warm-up's params.
    self.full_shardings = shd.tree_shardings(
        model.param_logical_axes(model_cfg), full_shapes, mesh, shd.TRAIN_RULES)
    # state.params: the adapters under LoRA, else the full model.
    master_shapes = lora.adapter_shapes(model_cfg) if self.lora else full_shapes
    self.param_shardings = shd.tree_shardings(
        lora.logical_axes(model_cfg) if self.lora else model.param_logical_axes(model_cfg),
        master_shapes, mesh, shd.TRAIN_RULES)
    self.state_shardings = self._state_shardings(self.optimizer, master_shapes,
                                                 self.param_shardings)
    self.sft_state_shardings = self._state_shardings(self.sft_optimizer, full_shapes,
                                                     self.full_shardings)
    self._batch_spec = shd.batch_sharding(mesh, shd.TRAIN_RULES, 1).spec
    self.ref_params = ()
    self.base_params = ()
    self._build_programs()

  def _build_programs(self) -> None:
    """The jitted initialisers, steps and probes, with their shardings and donation."""
    grpo_sh = {k: self._batch_sharding(k) for k in GRPO_KEYS}
    sft_sh = {k: self._batch_sharding(k) for k in SFT_KEYS}
    # The steps' frozen argument: the base under LoRA (also the KL reference), else the
    # reference policy when kl_beta > 0, else nothing.
    frozen_sh = self.full_shardings if self.lora or self.cfg.kl_beta > 0 else ()
    # Jitted initialisers per optimizer: from an rng, or from given params (LoRA RL:
    # adapters from an rng only).
    self._inits = {}
    full_ft = (("sft", self.sft_optimizer, self.sft_state_shardings),)
    if self.lora:
      self._inits["rl"] = (jax.jit(self._init_adapters, in_shardings=(self.replicated,),
                                   out_shardings=self.state_shardings), None)
    else:
      full_ft += (("rl", self.optimizer, self.state_shardings),)
    for name, optimizer, sh in full_ft:
      self._inits[name] = (
          jax.jit(self._make_init(optimizer, from_rng=True), in_shardings=(self.replicated,),
                  out_shardings=sh),
          jax.jit(self._make_init(optimizer, from_rng=False),
                  in_shardings=(self.full_shardings,), out_shardings=sh))
    # Frozen weights (reference, LoRA base): stored in model.param_dtype, cast to the
    # compute dtype where they run (forward only).
    frozen_dtype = jnp.dtype(self.model_cfg.param_dtype)
    self._freeze = jax.jit(
        lambda p: jax.tree.map(lambda x: jnp.copy(x.astype(frozen_dtype)), p),
        in_shardings=(self.full_shardings,), out_shardings=self.full_shardings)
    # A random base is the full model's float32 init (the same draw), then frozen.
    self._random_base = jax.jit(
        lambda k: jax.tree.map(lambda x: x.astype(frozen_dtype), model.init_params(
            self.model_cfg.replace(param_dtype="float32"), k)),
        in_shardings=(self.replicated,), out_shardings=self.full_shardings)
    self._step = jax.jit(
        self._train_step,
        in_shardings=(self.state_shardings, grpo_sh, frozen_sh, self.replicated),
        out_shardings=(self.state_shardings, self.replicated), donate_argnums=(0,))
    self._sft_step = jax.jit(
        self._sft_step_fn, in_shardings=(self.sft_state_shardings, sft_sh),
        out_shardings=(self.sft_state_shardings, self.replicated), donate_argnums=(0,))
    self._loss_and_grad = jax.jit(
        self._loss_and_grad_fn,
        in_shardings=(self.param_shardings, grpo_sh, grpo_sh["behavior_logprobs_bt"],
                      frozen_sh),
        out_shardings=(self.replicated, self.param_shardings))
    self._logprobs = jax.jit(
        self._logprobs_fn,
        in_shardings=(self.param_shardings, {k: grpo_sh[k] for k in ROW_KEYS},
                      self.full_shardings if self.lora else ()),
        out_shardings=grpo_sh["mask_bt"])

  def _check_cfg(self):
    c = self.cfg
    for name, allowed in (("loss_agg", grpo.LOSS_AGGS), ("ratio_level", grpo.RATIO_LEVELS),
                          ("kl_estimator", grpo.KL_ESTIMATORS),
                          ("schedule", opt_lib.SCHEDULES)):
      if getattr(c, name) not in allowed:
        raise ValueError(f"trainer.{name} must be one of {allowed}, got {getattr(c, name)!r}")
    if int(c.num_minibatches) < 1:
      raise ValueError(f"trainer.num_minibatches must be >= 1, got {c.num_minibatches}")
    if c.packing not in ("auto", "off"):
      raise ValueError(f"trainer.packing must be one of ('auto', 'off'), got {c.packing!r}")

  def _packing(self) -> bool:
    """Whether rows are packed: trainer.packing = auto and the attention kernel takes
    segment ids; otherwise padded rows, and one warning line when auto cannot pack."""
    kernel = self.attention.name
    if self.cfg.packing == "off":
      return False
    if kernel not in attention_lib.SEGMENT_KERNELS:
      logging.warning("trainer.packing=auto: the %r attention kernel takes no segment ids "
                      "(packed rows) in jax %s; training padded rows", kernel, jax.__version__)
      return False
    return True

  def _state_shardings(self, optimizer, master_shapes, param_shardings) -> TrainState:
    opt_shapes = jax.eval_shape(optimizer.init, master_shapes)
    opt_sh = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_shapes, param_shardings,
        transform_non_params=lambda _: self.replicated,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return TrainState(params=param_shardings, opt_state=opt_sh, step=self.replicated,
                      skipped=self.replicated)

  def _batch_sharding(self, key: str) -> NamedSharding:
    ndim = 1 if key.endswith("_b") else 2
    return shd.batch_sharding(self.mesh, shd.TRAIN_RULES, ndim)

  def _chunk_sharding(self, ndim: int) -> NamedSharding:
    """Sharding of a [n, rows, ...] chunked array: rows over the batch axes."""
    return NamedSharding(self.mesh, P(None, *self._batch_spec, *(None,) * (ndim - 2)))

  def _split(self, x: jax.Array, n: int) -> jax.Array:
    return jax.lax.with_sharding_constraint(split_rows(x, n), self._chunk_sharding(x.ndim + 1))

  @property
  def batch_multiple(self) -> int:
    """Rows per step are padded to a multiple of this: num_minibatches x micro-batch rows."""
    return self.num_minibatches * (self.micro_batch_size or self.dp)

  @property
  def compile_count(self) -> int:
    """Traces of the jitted functions (each trace is one compilation)."""
    return sum(self._traces.values())

  def _make_init(self, optimizer, *, from_rng: bool):
    def init(x):
      self._traces["init"] += 1
      master_cfg = self.model_cfg.replace(param_dtype="float32")
      params = model.init_params(master_cfg, x) if from_rng else x
      # Copy so the state never aliases the caller's params (the step donates it).
      params = jax.tree.map(lambda p: jnp.copy(p.astype(jnp.float32)), params)
      return TrainState(params=params, opt_state=optimizer.init(params),
                        step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32))
    return init

  def _init_adapters(self, rng) -> TrainState:
    """LoRA RL state: fresh adapters (lora.init_adapters) and their Adam moments."""
    self._traces["init"] += 1
    adapters = lora.init_adapters(self.model_cfg, rng)
    return TrainState(params=adapters, opt_state=self.optimizer.init(adapters),
                      step=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32))

  def _init(self, name, params, rng):
    from_rng, from_params = self._inits[name]
    if params is None:
      return from_rng(jax.random.key(0) if rng is None else rng)
    return from_params(jax.device_put(params, self.full_shardings))

  def init_state(self, params=None, rng=None) -> TrainState:
    """RL state from `params` (any placement; copied) or a fresh init from `rng`.

    When trainer.kl_beta > 0 it also stores a frozen copy of the initial params as the
    reference policy. Under LoRA the full-model params (given, or drawn from `rng`)
    become the frozen `base_params` and the state trains fresh adapters drawn from
    fold_in(rng, 1); the base is then also the reference.
    """
    if not self.lora:
      state = self._init("rl", params, rng)
      if self.cfg.kl_beta > 0:
        self.ref_params = self._freeze(state.params)
      return state
    rng = jax.random.key(0) if rng is None else rng
    self.base_params = (self._random_base(rng) if params is None
                        else self._freeze(jax.device_put(params, self.full_shardings)))
    return self._inits["rl"][0](jax.random.fold_in(rng, 1))

  def init_sft_state(self, params=None, rng=None) -> TrainState:
    """Supervised warm-up state (its own optimizer, constant sft_learning_rate)."""
    return self._init("sft", params, rng)

  def _segments(self, rows):
    """The rows' segment ids when packed (attention and per-sequence sums use them)."""
    return rows["segment_ids_bt"] if self.packed else None

  def _policy(self, params, frozen) -> tuple[Any, Any]:
    """(full-model weights, adapters or None) of the policy whose trained tree is
    `params`, `frozen` being the step's frozen argument (the base under LoRA)."""
    return (frozen, params) if self.lora else (params, None)

  def _token_stats(self, weights, rows, adapters=None, dropout_rng=None) -> model.TokenStats:
    """Log-probs, entropy and greedy hits of rows["tokens_bt"] (ROW_KEYS) under the
    full-model `weights` (plus LoRA `adapters`); the lm head runs in chunks of
    trainer.logprob_chunk_len positions, so [b, t, v] logits never exist."""
    # Casting before the forward makes FSDP gather compute-dtype (e.g. bf16) shards.
    weights = jax.tree.map(lambda p: p.astype(self.compute_dtype), weights)
    x_bte = model.hidden_states(self.model_cfg, weights, rows["tokens_bt"],
                                rows["positions_bt"], self._segments(rows),
                                adapters=adapters, dropout_rng=dropout_rng)
    return model.token_stats(self.model_cfg, weights, x_bte, rows["tokens_bt"],
                             chunk_len=self.logprob_chunk_len,
                             recompute=self.head_recomputes(rows["tokens_bt"].shape))

  def head_recomputes(self, shape_bt) -> bool:
    """Whether the lm head's backward recomputes its logits for a [b, t] micro-batch: the
    saved softmax (b t v in the compute dtype, rows over data x fsdp) would exceed
    trainer.logprob_save_bytes per device."""
    saved = np.prod(shape_bt) * self.model_cfg.vocab_size * self.compute_dtype.itemsize
    return saved / self.dp > self.logprob_save_bytes

  def _chunked_logprobs(self, rows, weights, adapters=None):
    """Log-probs of a whole batch without gradient, one micro-batch at a time."""
    b = rows["tokens_bt"].shape[0]
    n = b // (self.micro_batch_size or b)
    chunks = {k: self._split(rows[k], n) for k in ROW_KEYS}
    logp = jax.lax.map(lambda c: self._token_stats(weights, c, adapters).logp_bt, chunks)
    return jax.lax.stop_gradient(merge_rows(logp))

  def _accumulate(self, params, mb, loss_fn, shardings):
    """Sum of loss, stats and gradients (laid out as `shardings`) over the micro-batches
    of minibatch `mb`. An "rng" entry of `mb` (a key) is split into one key per
    micro-batch, passed to loss_fn as mc["rng"]."""
    mb = dict(mb)
    rng = mb.pop("rng", None)
    rows = self.micro_batch_size or mb["tokens_bt"].shape[0]
    micro = {k: self._split(v, v.shape[0] // rows) for k, v in mb.items()}
    if rng is not None:
      micro["rng"] = jax.random.split(rng, mb["tokens_bt"].shape[0] // rows)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def body(grads, mc):
      (loss, stats), g = grad_fn(params, mc)
      g = jax.lax.with_sharding_constraint(g, shardings)
      return jax.tree.map(jnp.add, grads, g), (loss, stats)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (losses, stats) = jax.lax.scan(body, zeros, micro)
    return grads, losses.sum(), stats

  def _apply_update(self, optimizer, params, opt_state, grads, loss):
    """One optax update, kept only if loss and gradient norm are finite."""
    grad_norm = global_norm(grads)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    params = tree_where(finite, optax.apply_updates(params, updates), params)
    opt_state = tree_where(finite, new_opt_state, opt_state)
    update_norm = jnp.where(finite, global_norm(updates), 0.0)
    return params, opt_state, finite, grad_norm, update_norm

  def _grpo_micro_loss(self, params, mc, frozen, policy_version):
    c = self.cfg
    weights, adapters = self._policy(params, frozen)
    head_out = self._token_stats(weights, mc, adapters, mc.get("rng"))
    logp_bt = head_out.logp_bt
    prox_bt = mc.get("prox_bt", logp_bt)
    loss, stats = grpo.grpo_loss(
        logp_bt=logp_bt, prox_logp_bt=prox_bt,
        behavior_logp_bt=mc["behavior_logprobs_bt"], ref_logp_bt=mc.get("ref_bt"),
        adv_bt=mc["advantages_bt"], mask_bt=mc["mask_bt"], weights_bt=mc["weights_bt"],
        eps_low=float(c.eps_low), eps_high=float(c.eps_high), tis_cap=float(c.tis_cap),
        ratio_level=c.ratio_level, kl_beta=float(c.kl_beta), kl_estimator=c.kl_estimator,
        seg_bt=self._segments(mc))
    stats["entropy"] = grpo.masked_sum(x_bt=head_out.entropy_bt, mask_bt=mc["mask_bt"])
    stats.update(grpo.logprob_mismatch(
        prox_logp_bt=jax.lax.stop_gradient(prox_bt),
        behavior_logp_bt=mc["behavior_logprobs_bt"], mask_bt=mc["mask_bt"],
        versions_bt=mc["versions_bt"], policy_version=policy_version))
    return loss, stats

  def _minibatch_grads(self, params, mb, frozen, policy_version):
    """GRPO loss, stats and gradient of one minibatch, aggregated over all its rows."""
    mb = dict(mb, weights_bt=grpo.loss_weights(
        mask_bt=mb["mask_bt"], loss_agg=self.cfg.loss_agg, max_len=self.loss_norm_len,
        seg_bt=self._segments(mb)))
    loss_fn = functools.partial(self._grpo_micro_loss, frozen=frozen,
                                policy_version=policy_version)
    return self._accumulate(params, mb, loss_fn, self.param_shardings)

  def _loss_and_grad_fn(self, params, batch, prox_bt, frozen):
    """GRPO loss of the whole batch with a given pi_prox, and its gradient (no LoRA
    dropout: the loss is a deterministic function of params)."""
    self._traces["loss_and_grad"] += 1
    data = dict(batch, prox_bt=prox_bt)
    if self.cfg.kl_beta > 0:
      data["ref_bt"] = self._chunked_logprobs(batch, frozen)
    grads, loss, _ = self._minibatch_grads(params, data, frozen, policy_version=-1)
    return loss, grads

  def _train_step(self, state: TrainState, batch, frozen, policy_version):
    """num_minibatches GRPO updates (module docstring); metrics are token means over the
    whole batch except loss / pg_loss / grad_norm / update_norm (means over minibatches)
    and logprob_mismatch_max (a max). `frozen`: the LoRA base, else the reference (or ())."""
    self._traces["step"] += 1
    nm = self.num_minibatches
    data = dict(batch)
    if nm > 1:
      data["prox_bt"] = self._chunked_logprobs(batch, *self._policy(state.params, frozen))
    if self.cfg.kl_beta > 0:
      # The reference: the frozen base under LoRA (no adapters), else the frozen copy.
      data["ref_bt"] = self._chunked_logprobs(batch, frozen)
    minibatches = {k: self._split(v, nm) for k, v in data.items()}
    if self.lora and self.model_cfg.lora_dropout > 0:
      key = jax.random.fold_in(jax.random.key(0), state.step)
      minibatches["rng"] = jax.random.split(key, nm)
    # Updates applied so far (each step attempts nm), which is where the schedule stands.
    applied_before = state.step * nm - state.skipped

    def update(carry, mb):
      params, opt_state, skipped = carry
      grads, loss, stats = self._minibatch_grads(params, mb, frozen, policy_version)
      params, opt_state, finite, grad_norm, update_norm = self._apply_update(
          self.optimizer, params, opt_state, grads, loss)
      skipped = skipped + (~finite).astype(jnp.int32)
      return (params, opt_state, skipped), (loss, stats, grad_norm, update_norm)

    (params, opt_state, skipped), (loss_n, stats, grad_norm_n, update_norm_n) = jax.lax.scan(
        update, (state.params, state.opt_state, state.skipped), minibatches)
    ratios = stats.pop("ratio_bt").reshape(-1)
    sums = {k: v.max() if k.endswith("_max") else v.sum() for k, v in stats.items()}
    tokens = jnp.maximum(sums["tokens"], 1.0)
    ratio_p = jnp.nanquantile(ratios, jnp.array([0.01, 0.5, 0.99]))
    metrics = dict(
        loss=loss_n.mean(), pg_loss=stats["pg_loss"].sum() / nm,
        kl=sums["kl"] / tokens, kl_behavior=sums["kl_behavior"] / tokens,
        entropy=sums["entropy"] / tokens,
        clip_frac_low=sums["clip_low"] / tokens, clip_frac_high=sums["clip_high"] / tokens,
        ratio_p1=ratio_p[0], ratio_p50=ratio_p[1], ratio_p99=ratio_p[2],
        tis_weight_mean=sums["tis_weight"] / tokens,
        tis_truncated_frac=sums["tis_truncated"] / tokens,
        behavior_prox_logp_gap=sums["prox_gap"] / tokens,
        logprob_mismatch_mean=sums["mismatch_sum"] / jnp.maximum(sums["mismatch_tokens"], 1.0),
        logprob_mismatch_max=sums["mismatch_max"],
        logprob_mismatch_tokens=sums["mismatch_tokens"],
        grad_norm=grad_norm_n.mean(), update_norm=update_norm_n.mean(),
        learning_rate=self.schedule(applied_before),
        tokens=sums["tokens"], skipped_nonfinite=(skipped - state.skipped).astype(jnp.float32),
        skipped_nonfinite_total=skipped.astype(jnp.float32))
    new_state = TrainState(params=params, opt_state=opt_state, step=state.step + 1,
                           skipped=skipped)
    return new_state, metrics

  def _sft_micro_loss(self, params, mc):
    head_out = self._token_stats(params, mc)
    loss = -grpo.masked_sum(x_bt=mc["weights_bt"] * head_out.logp_bt, mask_bt=mc["mask_bt"])
    hit_bt = head_out.hit_bt.astype(jnp.float32)
    return loss, dict(correct=grpo.masked_sum(x_bt=hit_bt, mask_bt=mc["mask_bt"]),
                      tokens=grpo.masked_sum(x_bt=jnp.ones_like(hit_bt), mask_bt=mc["mask_bt"]))

  def _sft_step_fn(self, state: TrainState, batch):
    """Token-mean cross-entropy -sum_bt W_bt log pi(tokens_{t+1}), W from loss_weights."""
    self._traces["sft_step"] += 1
    mb = dict(batch, weights_bt=grpo.loss_weights(mask_bt=batch["mask_bt"],
                                                  loss_agg="token_mean", max_len=1))
    grads, loss, stats = self._accumulate(state.params, mb, self._sft_micro_loss,
                                          self.full_shardings)
    params, opt_state, finite, grad_norm, update_norm = self._apply_update(
        self.sft_optimizer, state.params, state.opt_state, grads, loss)
    skipped = state.skipped + (~finite).astype(jnp.int32)
    tokens = stats["tokens"].sum()
    metrics = dict(loss=loss, token_accuracy=stats["correct"].sum() / jnp.maximum(tokens, 1.0),
                   grad_norm=grad_norm, update_norm=update_norm, tokens=tokens,
                   skipped_nonfinite=(~finite).astype(jnp.float32))
    return TrainState(params=params, opt_state=opt_state, step=state.step + 1,
                      skipped=skipped), metrics

  def _logprobs_fn(self, params, rows, base):
    """logp_bt[:, t] = log pi(tokens_bt[:, t + 1]) without gradient."""
    self._traces["logprobs"] += 1
    return self._chunked_logprobs(rows, *self._policy(params, base))

  def make_train_batch(self, groups: Sequence[Group], *, mask_truncated: bool = False
                       ) -> TrainBatch:
    return make_train_batch(groups, pad_id=self.model_cfg.pad_id,
                            length_buckets=self.cfg.length_buckets,
                            std_normalize=bool(self.cfg.std_normalize),
                            batch_multiple=self.batch_multiple, mask_truncated=mask_truncated)

  def make_sft_batch(self, prompts_tokens, completions_tokens,
                     completion_masks=None) -> TrainBatch:
    return make_sft_batch(prompts_tokens, completions_tokens, pad_id=self.model_cfg.pad_id,
                          length_buckets=self.cfg.length_buckets,
                          batch_multiple=self.batch_multiple,
                          completion_masks=completion_masks)

  def layouts(self, batch: TrainBatch) -> tuple[buckets.RowLayout, buckets.RowLayout]:
    """(the rows the step trains, the padded rows) of `batch` padded to batch_multiple."""
    batch = pad_rows(batch, multiple=self.batch_multiple, pad_id=self.model_cfg.pad_id)
    padded = buckets.padded_layout(batch.lengths_b, batch.seq_len)
    if not self.packed:
      return padded, padded
    return buckets.packed_layout(
        batch.lengths_b, row_len=batch.seq_len, num_minibatches=self.num_minibatches,
        quantum=self.micro_batch_size or self.dp), padded

  def _device_batch(self, batch: TrainBatch, keys, layout) -> dict[str, jax.Array]:
    batch = pad_rows(batch, multiple=self.batch_multiple, pad_id=self.model_cfg.pad_id)
    rows = batch_rows(batch, layout, pad_id=self.model_cfg.pad_id)
    return {k: jax.device_put(rows[k], self._batch_sharding(k)) for k in keys}

  def _layout_metrics(self, batch: TrainBatch) -> tuple[buckets.RowLayout, dict]:
    layout, padded = self.layouts(batch)
    return layout, {"seq_len": float(layout.row_len), "train/rows": float(layout.num_rows),
                    "train/positions": float(layout.num_rows * layout.row_len),
                    "train/padding_frac": layout.padding_frac,
                    "train/padding_frac_unpacked": padded.padding_frac}

  def batch_spec(self, rows: int, row_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract step inputs (GRPO_KEYS) of `rows` trained rows of row_len positions."""
    dtypes = dict(tokens_bt=jnp.int32, positions_bt=jnp.int32, segment_ids_bt=jnp.int32,
                  mask_bt=jnp.bool_, behavior_logprobs_bt=jnp.float32,
                  advantages_bt=jnp.float32, versions_bt=jnp.int32)
    return {k: jax.ShapeDtypeStruct((rows, row_len), dtypes[k]) for k in GRPO_KEYS}

  def _frozen(self):
    """The steps' frozen argument: the LoRA base, else the reference policy (or ())."""
    if self.lora and not self.base_params:
      raise ValueError("model.lora.rank > 0 needs the base params: call init_state first")
    if not self.lora and self.cfg.kl_beta > 0 and not self.ref_params:
      raise ValueError("trainer.kl_beta > 0 needs reference params: call init_state first")
    return self.base_params if self.lora else self.ref_params

  def step(self, state: TrainState, batch: TrainBatch, *, policy_version: int = -1
           ) -> tuple[TrainState, dict[str, float]]:
    """One GRPO step (num_minibatches optimizer updates). `state` is donated."""
    state, pending = self.dispatch_step(state, batch, policy_version=policy_version)
    return state, pending()

  def dispatch_step(self, state: TrainState, batch: TrainBatch, *, policy_version: int = -1):
    """Launches one GRPO step without waiting for it: (new state, a function that
    blocks and returns the metrics as floats). `state` is donated.

    `policy_version` is the version of state.params (the weights the sampler had when
    it emitted tokens of that version): logprob_mismatch_* compare those tokens'
    behaviour log-probs with the trainer's own at the same params (-1: no such tokens).
    """
    version = jax.device_put(np.int32(policy_version), self.replicated)
    layout, extra = self._layout_metrics(batch)
    state, metrics = self._step(state, self._device_batch(batch, GRPO_KEYS, layout),
                                self._frozen(), version)
    extra.update(zero_var_groups=float(batch.zero_var_groups),
                 rollouts=float(batch.num_rollouts))

    def result() -> dict[str, float]:
      out = {k: float(v) for k, v in jax.device_get(metrics).items()}
      out.update(extra)
      return out
    return state, result

  def sft_step(self, state: TrainState, batch: TrainBatch
               ) -> tuple[TrainState, dict[str, float]]:
    """One supervised warm-up update on an init_sft_state state (donated)."""
    layout, extra = self._layout_metrics(batch)
    state, metrics = self._sft_step(state, self._device_batch(batch, SFT_KEYS, layout))
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}
    out.update(extra, learning_rate=self.sft_learning_rate)
    return state, out

  def logprobs(self, params, batch: TrainBatch) -> jax.Array:
    """logp_bt of the batch's tokens under `params` (trainer shardings; adapters on
    base_params under LoRA), position-aligned with the batch's own (padded) rows."""
    padded = self.layouts(batch)[1]
    return self._logprobs(params, self._device_batch(batch, ROW_KEYS, padded),
                          self._frozen() if self.lora else ())

  def loss_and_grad(self, params, batch: TrainBatch, prox_logprobs_bt: jax.Array
                    ) -> tuple[jax.Array, Any]:
    """The GRPO loss of the whole batch as one minibatch, and its gradient in params
    (the adapters under LoRA).

    pi_prox is given (e.g. `logprobs(params0, batch)`, the batch's padded rows) rather
    than recomputed, so the loss is a smooth function of `params` (for gradient checks
    and probes); it is laid out in the trained rows like the batch.
    """
    layout = self.layouts(batch)[0]
    prox_bt = jax.device_put(layout.scatter(np.asarray(jax.device_get(prox_logprobs_bt)), 0.0),
                             self._batch_sharding("behavior_logprobs_bt"))
    return self._loss_and_grad(params, self._device_batch(batch, GRPO_KEYS, layout), prox_bt,
                               self._frozen())

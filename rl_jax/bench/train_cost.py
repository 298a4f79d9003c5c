"""Matmul FLOPs of the real GRPO train step, read from its jaxpr: nothing runs or allocates.

`train_step_matmul` traces `Trainer._step` (the jitted step launch/train.py runs) on
abstract inputs (jax.ShapeDtypeStruct from jax.eval_shape) and sums the FLOPs of every
dot_general in the jaxpr, by operand dtypes:

  flops(dot_general) = 2 * prod(out.shape) * prod(lhs contracting dims)

Sub-programs are walked wherever they appear: a scan body counts `length` times (layers,
micro-batches, minibatches, lm-head chunks), remat (jax.checkpoint) and custom-vjp bodies
count where they run, so the backward pass and every recomputation are included. A
while loop's body counts once (its trip count is not static; the train step has none);
of a cond's branches the most expensive counts.

What the step needs (b rows of t tokens, N parameters, L layers, H query heads of
width D; the lm head is part of N, tied or not):

  needed = 6 * N * b * t                          every weight GEMM, forward + backward
         + 3 * 2 * (2 * b * t^2 * H * D) * L      QK^T and PV, forward + backward

The attention term is the full t x t (not halved for the causal mask), like the jnp /
xla kernels compute it. Rows are b full-length rows; the CLI prints the issue-26 shape.
Attention runs the kernel the Trainer selects on this host: on CPU `xla`, whose matmuls
are dot_generals and counted; cuDNN (GPU) and splash (TPU) are custom calls, so a walk
traced there leaves attention out of total_tflop.

  python -m rl_jax.bench.train_cost --preset qwen2_0_5b --batch 16 --seq 1024
"""
from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from rl_jax import model
from rl_jax import sharding as shd

RESULT_KEYS = ("total_tflop", "bf16_tflop", "f32_operand_tflop", "needed_tflop",
               "ratio_to_needed", "bf16_share")


def _jaxprs(value):
  """The jaxprs inside an equation parameter (a jaxpr, a closed jaxpr, or a sequence)."""
  if isinstance(value, jax_core.ClosedJaxpr):
    return [value.jaxpr]
  if isinstance(value, jax_core.Jaxpr):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in _jaxprs(v)]
  return []


def dot_flops(eqn) -> int:
  """2 * prod(out shape) * prod(contracted sizes) of one dot_general equation."""
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs_shape = eqn.invars[0].aval.shape
  k = math.prod(lhs_shape[i] for i in lhs_contract)
  return 2 * math.prod(eqn.outvars[0].aval.shape) * k


def matmul_flops(jaxpr, multiplier: int = 1, acc: dict | None = None) -> dict:
  """FLOPs of every dot_general in `jaxpr` (a Jaxpr or ClosedJaxpr) by operand dtypes:
  {"bf16": both operands bfloat16, "f32_operand": at least one float32, "other"}."""
  acc = {"bf16": 0, "f32_operand": 0, "other": 0} if acc is None else acc
  if isinstance(jaxpr, jax_core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      dtypes = {jnp.dtype(v.aval.dtype) for v in eqn.invars[:2]}
      kind = ("bf16" if dtypes == {jnp.dtype(jnp.bfloat16)} else
              "f32_operand" if jnp.dtype(jnp.float32) in dtypes else "other")
      acc[kind] += multiplier * dot_flops(eqn)
      continue
    if name == "cond":
      costs = [matmul_flops(j, multiplier) for j in _jaxprs(eqn.params["branches"])]
      worst = max(costs, key=lambda c: sum(c.values()))
      for key, value in worst.items():
        acc[key] += value
      continue
    inner = multiplier * (int(eqn.params["length"]) if name == "scan" else 1)
    for value in eqn.params.values():
      for sub in _jaxprs(value):
        matmul_flops(sub, inner, acc)
  return acc


def needed_flops(model_cfg, *, batch: int, seq: int) -> float:
  """6 N b t + 12 b t^2 H D L (module docstring)."""
  c = model_cfg
  weights = 6.0 * model.num_params(c) * batch * seq
  attention = 12.0 * batch * seq * seq * c.num_heads * c.head_dim * c.num_layers
  return weights + attention


def _abstract_step_args(trainer, *, batch: int, seq: int):
  """ShapeDtypeStructs of Trainer._step's arguments (state, batch, ref params, version)."""
  state = jax.eval_shape(trainer._make_init(trainer.optimizer, from_rng=True),
                         jax.random.key(0))
  data = trainer.batch_spec(batch, seq)
  ref = trainer.ref_params
  if trainer.cfg.kl_beta > 0:
    ref = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, trainer.compute_dtype),
                       state.params)
  return state, data, ref, jax.ShapeDtypeStruct((), jnp.int32)


def train_step_matmul(model_cfg, *, batch: int, seq: int, dtype: str, remat: str,
                      micro_batch: int, logprob_chunk: int, trainer_cfg=None) -> dict:
  """Matmul TFLOP of one GRPO train step of `batch` rows x `seq` tokens (module doc).

  `trainer_cfg` (default: configs/base.py's trainer section) gets micro_batch_size,
  logprob_chunk_len and length_buckets=(seq,) set. Traced on one device of this host.
  Keys: RESULT_KEYS; bf16_share = bf16_tflop / total_tflop.
  """
  from configs import base
  from rl_jax.trainer import train_step as ts
  cfg = model_cfg.replace(dtype=dtype, remat=remat)
  tcfg = base.get_config().trainer if trainer_cfg is None else trainer_cfg
  tcfg = tcfg.copy_and_resolve_references()
  tcfg.micro_batch_size, tcfg.logprob_chunk_len = int(micro_batch), int(logprob_chunk)
  tcfg.length_buckets = (int(seq),)
  mesh = shd.make_mesh((1, 1, 1), jax.devices()[:1])
  trainer = ts.Trainer(cfg, tcfg, mesh, total_steps=1)
  jaxpr = jax.make_jaxpr(trainer._step)(*_abstract_step_args(trainer, batch=batch, seq=seq))
  acc = matmul_flops(jaxpr)
  total = sum(acc.values())
  needed = needed_flops(cfg, batch=batch, seq=seq)
  return dict(total_tflop=total / 1e12, bf16_tflop=acc["bf16"] / 1e12,
              f32_operand_tflop=acc["f32_operand"] / 1e12, needed_tflop=needed / 1e12,
              ratio_to_needed=total / needed, bf16_share=acc["bf16"] / max(total, 1))


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="qwen2_0_5b")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--remat", default="dots")
  p.add_argument("--micro-batch", type=int, default=8)
  p.add_argument("--logprob-chunk", type=int, default=128)
  args = p.parse_args(argv)
  out = train_step_matmul(model.get_preset(args.preset), batch=args.batch, seq=args.seq,
                          dtype=args.dtype, remat=args.remat, micro_batch=args.micro_batch,
                          logprob_chunk=args.logprob_chunk)
  print(json.dumps(dict(vars(args), **out), indent=1))
  return out


if __name__ == "__main__":
  main()

"""Ahead-of-time memory of the accelerator-shaped programs: lower and compile the very
jitted functions rl_jax runs (Engine generate / prefill, Trainer step) from abstract
inputs (jax.eval_shape; nothing is allocated) and read compiled.memory_analysis().

peak_bytes = arguments + outputs - aliased (donated) + temporaries: what the program
holds at once besides other live buffers. The figures come from the backend doing the
compiling. On a CPU the XLA:CPU compiler upcasts bfloat16 arithmetic to float32 and
keeps float32 copies of bf16 weights in its temporaries (not of the KV pools: on CPU
they are stored as uint16 bits, decode.pool_dtype), so bf16 temp bytes are overstated
there; the float32 build of the same program, also compiled on CPU, has no such copies
and bounds the accelerator's bf16 temporaries from above (every dtype-dependent buffer
is twice its bf16 size, the float32-only ones equal).

Engine and Trainer construction only traces shapes (eval_shape) and builds jitted
functions; `construct_allocated_bytes` checks that by counting live device bytes
before and after.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax import model
from rl_jax.sampler import engine as engine_lib
from rl_jax.trainer import train_step as ts
from rl_jax.bench import measure

GIB = 2 ** 30


def _live_bytes() -> int:
  return sum(x.nbytes for x in jax.live_arrays())


def memory(compiled, device_bytes: float) -> dict:
  m = compiled.memory_analysis()
  if m is None:
    return dict(unavailable="this backend gives no memory analysis")
  out = dict(argument_bytes=int(m.argument_size_in_bytes),
             output_bytes=int(m.output_size_in_bytes),
             alias_bytes=int(m.alias_size_in_bytes), temp_bytes=int(m.temp_size_in_bytes))
  out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] +
                       out["temp_bytes"])
  out["frac_of_device"] = out["peak_bytes"] / device_bytes
  return out


def decode_program(model_cfg, mesh, *, batch, sizes, dtype, device_bytes) -> dict:
  before = _live_bytes()
  engine = measure.decode_engine(model_cfg, mesh, batch=batch, ctx=sizes.ctx,
                                 page_size=sizes.page_size,
                                 steps_per_call=sizes.steps_per_call, dtype=dtype)
  allocated = _live_bytes() - before
  params = jax.eval_shape(engine.load_params, rng=jax.random.key(0))
  state = jax.eval_shape(engine.init_decode_state)
  # The program Engine.generate runs over all slots and all page-table columns.
  program = engine.generate_program(batch, engine.pages_per_seq)
  compiled = program.lower(params, state).compile()
  return dict(memory(compiled, device_bytes), construct_allocated_bytes=allocated)


def prefill_program(model_cfg, mesh, *, sizes, dtype, device_bytes) -> dict:
  engine = engine_lib.Engine(model_cfg, mesh=mesh, max_concurrent_decodes=1,
                             page_size=sizes.page_size, num_pages=2,
                             max_prefill_length=sizes.prefill_len, max_new_tokens=1,
                             dtype=dtype)
  params = jax.eval_shape(engine.load_params, rng=jax.random.key(0))
  tokens = jax.ShapeDtypeStruct((sizes.prefill_len,), jnp.int32)
  length = jax.ShapeDtypeStruct((), jnp.int32)
  compiled = engine._prefill.lower(params, tokens, length).compile()
  return memory(compiled, device_bytes)


def train_program(model_cfg, mesh, *, sizes, dtype, remat, logprob_chunk_len,
                  device_bytes) -> dict:
  before = _live_bytes()
  cfg = measure.trainer_config(length_buckets=(sizes.train_seq,),
                               micro_batch_size=sizes.train_micro_batch,
                               logprob_chunk_len=logprob_chunk_len)
  trainer = ts.Trainer(model_cfg.replace(dtype=dtype, remat=remat), cfg, mesh, total_steps=1)
  allocated = _live_bytes() - before
  state = jax.eval_shape(trainer.init_state, rng=jax.random.key(0))
  b, t = sizes.train_batch, sizes.train_seq
  batch = trainer.batch_spec(b, t)
  version = jax.ShapeDtypeStruct((), jnp.int32)
  # trainer._step is the program Trainer.step runs; () is the absent reference policy.
  compiled = trainer._step.lower(state, batch, (), version).compile()
  return dict(memory(compiled, device_bytes), construct_allocated_bytes=allocated)


def run(model_cfg, sizes, *, dtype: str, remat: str, device_gib: float,
        logprob_chunk_len: int = 128) -> dict:
  """{program name: memory figures}; on a CPU backend also the float32 builds. The train
  step is compiled with `remat` first, then the other remat policies."""
  mesh = measure.one_device_mesh()
  device_bytes = device_gib * GIB
  dtypes = [dtype]
  if jax.default_backend() == "cpu" and dtype != "float32":
    dtypes.append("float32")
  out = {}
  for dt in dtypes:
    for b in sizes.decode_batches:
      out[f"decode_b{b}_ctx{sizes.ctx}_{dt}"] = decode_program(
          model_cfg, mesh, batch=b, sizes=sizes, dtype=dt, device_bytes=device_bytes)
    out[f"prefill_t{sizes.prefill_len}_{dt}"] = prefill_program(
        model_cfg, mesh, sizes=sizes, dtype=dt, device_bytes=device_bytes)
    for r in (remat,) + tuple(p for p in model.REMAT_POLICIES if p != remat):
      name = (f"train_b{sizes.train_batch}_t{sizes.train_seq}_mb{sizes.train_micro_batch}"
              f"_remat-{r}_{dt}")
      out[name] = train_program(model_cfg, mesh, sizes=sizes, dtype=dt, remat=r,
                                logprob_chunk_len=logprob_chunk_len, device_bytes=device_bytes)
  return out

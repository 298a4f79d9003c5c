"""Multi-controller execution: every process runs the same loop over one global mesh.

JAX is multi-controller: each process traces and launches every computation that
touches a mesh spanning processes, and the processes must launch them in the same
order with the same host inputs, or collectives deadlock or mix data. rl_jax keeps the
single-process pipeline (sampler thread, verifier pool, trainer on the main thread) and
makes every input to a device computation identical on all processes:

  prompts   every process reads the global prompt stream (process_index 0 of 1), so
            admission draws the same group ids, prompt tokens and seeds everywhere;
  sampling  generate's outputs are replicated over the sampler mesh before the host reads
            them, so finished-rollout bookkeeping (which sequences ended, their tokens,
            log-probs and versions) is identical on every process;
  rewards   each process verifies its own copy of the rollouts, but the trainer uses
            process 0's rewards: before make_train_batch, process 0 broadcasts the group
            ids of the batch and their rewards, and every process checks that its batch
            holds the same groups (a verifier's timeouts and errors are timing-dependent,
            so only process 0's results count);
  schedule  sync mode's barrier and the publication points follow the trainer step count,
            which is the same on every process; between publications the sampler's device
            work (prefill, generate, slot moves) depends only on the replicated outputs
            above, and the trainer's device work waits for a full batch, which in sync
            mode exists only once the sampler is idle. So the two threads never launch
            device work at the same time and every process launches the same sequence.

Async mode's admission and batch formation depend on thread timing (how many decode
steps run while the trainer steps, which groups the verifiers finish first), which
differs between processes; a multi-process async run is refused with one line rather
than risking a deadlock (see `check_supported`).

Meshes: `role_devices` orders the global devices round-robin over processes, so a
sub-mesh made from the first n devices takes devices from every process. Weight sync
between disjoint sub-meshes needs a cross-process device_put, which jax supports only
when source and target shardings cover the same devices (and, for different device sets,
only on the TFRT TPU runtime); multi-process runs therefore need mesh.colocated=True
unless running on TPU, and `check_supported` says so.

Digest: with RL_JAX_DIGEST set, every process writes `<RL_JAX_DIGEST>.<process index>`
(JSON: policy version, optimizer steps, per-leaf sums of the final trainer params) so a
test or an operator can check that processes agree and compare against another run.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import sharding as sharding_lib


class MultiHostError(RuntimeError):
  """A configuration that multi-process execution does not support: one sentence."""


def multi_process() -> bool:
  return jax.process_count() > 1


def check_supported(cfg) -> None:
  if not multi_process():
    return
  if cfg.rl.mode != "sync":
    raise MultiHostError(
        f"rl.mode={cfg.rl.mode!r} runs in one process only; multi-process runs support "
        f"rl.mode='sync' (see rl_jax/orchestration/multihost.py)")
  if not cfg.mesh.colocated and jax.devices()[0].platform != "tpu":
    raise MultiHostError(
        "multi-process runs on CPU/GPU need mesh.colocated=True: jax cannot copy weights "
        "between disjoint device sets that span processes outside TPU")


def role_devices() -> list:
  """Global devices ordered round-robin over processes (device order within each)."""
  devices = jax.devices()
  by_process: dict[int, list] = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  queues = [by_process[p] for p in sorted(by_process)]
  out = []
  for i in range(max(len(q) for q in queues)):
    out.extend(q[i] for q in queues if i < len(q))
  return out


def prompt_shard() -> tuple[int, int]:
  """(process_index, process_count) for make_prompt_source: one global stream."""
  return 0, 1


class ReplicatedOutputs:
  """An Engine whose generate() returns outputs replicated over the sampler mesh.

  The generator reads every generate output on the host; a batch-sharded output that
  spans processes is not addressable there, and replicating it also gives every process
  the same view of which sequences finished.
  """

  def __init__(self, engine):
    self._engine = engine
    self._replicate: dict[int, object] = {}

  def __getattr__(self, name):
    return getattr(self._engine, name)

  def generate(self, params, state, *, num_slots: int):
    state, out = self._engine.generate(params, state, num_slots=num_slots)
    fn = self._replicate.get(num_slots)
    if fn is None:
      in_sh = self._engine._output_shardings(num_slots)  # pylint: disable=protected-access
      rep = jax.tree.map(lambda _: sharding_lib.replicated(self._engine.mesh), in_sh)
      fn = self._replicate[num_slots] = jax.jit(lambda x: x, in_shardings=(in_sh,),
                                                out_shardings=rep)
    return state, fn(out)


def broadcast_batch(groups) -> None:
  """Makes every process train on process 0's rewards for the same groups (in place)."""
  from jax.experimental import multihost_utils
  ids = np.asarray([g.group_id for g in groups], np.int64)
  rewards = np.asarray([[r.reward for r in g.rollouts] for g in groups], np.float32)
  ids0, rewards0 = multihost_utils.broadcast_one_to_all((ids, rewards))
  if not np.array_equal(np.asarray(ids0), ids):
    raise MultiHostError(
        f"process {jax.process_index()} formed a batch of groups {ids.tolist()} but process 0 "
        f"formed {np.asarray(ids0).tolist()}; the processes have diverged")
  for g, row in zip(groups, np.asarray(rewards0)):
    for r, value in zip(g.rollouts, row):
      r.reward = float(value)


def params_digest(params, mesh) -> list[list[float]]:
  """[sum, sum of |x|] of every leaf, in tree order, computed on `mesh` and replicated."""
  leaves = jax.tree.leaves(params)
  rep = sharding_lib.replicated(mesh)
  fn = jax.jit(
      lambda xs: jnp.stack([jnp.stack([jnp.sum(x.astype(jnp.float32)),
                                       jnp.sum(jnp.abs(x.astype(jnp.float32)))]) for x in xs]),
      in_shardings=([x.sharding for x in leaves],), out_shardings=rep)
  return np.asarray(fn(leaves), np.float64).tolist()


def write_digest(pipeline, summary: dict) -> None:
  """Writes `<RL_JAX_DIGEST>.<process index>` when RL_JAX_DIGEST is set (every process)."""
  path = os.environ.get("RL_JAX_DIGEST")
  if not path:
    return
  digest = {
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "policy_version": pipeline.version,
      "optimizer_steps": summary["optimizer_steps"],
      "heldout_reward_final": summary["heldout_reward_final"],
      "params": params_digest(pipeline.state.params, pipeline.meshes.trainer),
  }
  with open(f"{path}.{jax.process_index()}", "w") as f:
    json.dump(digest, f)

"""Multi-controller execution: every process runs the same pipeline over one global mesh.

JAX is multi-controller: each process traces and launches every computation that
touches a mesh spanning processes, and the processes must launch them in the same
order with the same host inputs, or collectives deadlock or mix data. The pipeline's
scheduling (admission, which groups form a batch, when weights are published and when
the sampler swaps them in) depends on thread timing and on verifier latency, so it is
decided on one process and replayed on the others:

  leader     process 0 runs the ordinary pipeline (sampler thread, verifier pool, trainer
             on the main thread). Every piece of device work is an event: before
             launching it, the thread takes the event lock and appends the event with
             the decisions it needs to the EventLog (the jax.distributed key-value store,
             host to host, no device work). The lock is held while launching, not while
             waiting for results, so sampler and trainer still overlap.
  followers  processes 1.. run no sampler thread and no verifiers: one thread reads the
             log in order and performs each event with the leader's decisions, so their
             launch order is the leader's by construction.

`Schedule` is the one interface the pipeline sees: single process it logs nothing; on
the leader `event` / `put` append to the log while the RL loop runs; on a follower
`follow` replays the log through the pipeline's handlers for each kind of event.

  event     decisions carried                 work launched
  sample    ids of groups admitted, version   prefill/insert/generate (one Generator.step)
            of weights to swap in (or none)
  train     group ids of the batch and their  one train step; with publish, the weight
            rewards, stale groups discarded    sync of the new version
  evaluate  -                                 held-out greedy evaluation
  save      step, held-out reward             a collective orbax checkpoint save
  end/abort message                           stop (abort: RunError on every process)

Host data: every process reads the global prompt stream (process_index 0 of 1), so the
group ids in a sample event name the same prompts everywhere; generate's outputs are
replicated over the sampler mesh before the host reads them (ReplicatedOutputs), so
every process holds the same rollouts; rewards are process 0's, carried by the train
event. Each process builds the same global host batch and device_put places only its
addressable shards. Only process 0 writes metrics, summary.json and checkpoint metadata.

Meshes: `role_devices` orders the global devices round-robin over processes, so a
sub-mesh made from the first n devices takes devices from every process. Weight sync
between disjoint sub-meshes copies each sampler shard from a trainer device of the same
process (rl_jax/orchestration/weight_sync.py), so it stays device-to-device and needs no
cross-host transfer.

Digest: with RL_JAX_DIGEST set, every process writes `<RL_JAX_DIGEST>.<process index>`
(JSON: policy version, optimizer steps, per-leaf sums of the final trainer params) so a
test or an operator can check that processes agree and compare against another run.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import sharding as sharding_lib
from rl_jax.orchestration.errors import RunError


class MultiHostError(RuntimeError):
  """A configuration that multi-process execution does not support: one sentence."""


def multi_process() -> bool:
  return jax.process_count() > 1


class EventLog:
  """The leader's launch order and decisions, shared through the jax.distributed
  key-value store. Leader: `event(kind, **payload)` is a context manager that holds the
  event lock, appends the event, and launches the work in its body. Followers: `next()`
  returns the events in order, waiting for the leader."""

  PREFIX = "rl_jax/events/"
  KEEP = 1 << 14  # old events are deleted; followers run at most a few events behind

  def __init__(self, client=None):
    if client is None:
      from jax._src import distributed as jax_distributed
      client = jax_distributed.global_state.client
    if client is None:
      raise MultiHostError("multi-process run without a jax.distributed client")
    self._client = client
    self.leader = jax.process_index() == 0
    self.lock = threading.RLock()
    self.count = 0

  def put(self, kind: str, **payload) -> None:
    """Leader: appends one event (call with `lock` held, before launching its work)."""
    key = f"{self.PREFIX}{self.count}"
    self._client.key_value_set(key, json.dumps([kind, payload]))
    if self.count >= self.KEEP:
      try:
        self._client.key_value_delete(f"{self.PREFIX}{self.count - self.KEEP}")
      except Exception:  # noqa: BLE001  (cleanup only)
        pass
    self.count += 1

  @contextlib.contextmanager
  def event(self, kind: str, **payload):
    with self.lock:
      self.put(kind, **payload)
      yield

  def next(self, poll_s: float = 5.0) -> tuple[str, dict]:
    """Follower: the next event; waits as long as the leader takes."""
    key = f"{self.PREFIX}{self.count}"
    while True:
      try:
        raw = self._client.blocking_key_value_get(key, int(poll_s * 1000))
        break
      except Exception as e:  # noqa: BLE001
        text = str(e)
        if "DEADLINE_EXCEEDED" in text or "timed out" in text.lower():
          continue
        raise MultiHostError(f"process {jax.process_index()} lost the event log of "
                             f"process 0: {text.splitlines()[0] if text else e!r}") from None
    self.count += 1
    kind, payload = json.loads(raw)
    return kind, payload


class Schedule:
  """The order of device work across processes (module docstring); `events` None for a
  single process."""

  def __init__(self, events: EventLog | None):
    self.events = events
    self.follower = events is not None and not events.leader
    self.logging = False  # the leader logs only while the RL loop runs

  def start(self) -> None:
    self.logging = self.events is not None and not self.follower

  def launch_lock(self):
    """Held while deciding and launching one piece of logged work."""
    return self.events.lock if self.logging else contextlib.nullcontext()

  def put(self, kind: str, **payload) -> None:
    """Appends an event; call with `launch_lock()` held and only while `logging`."""
    self.events.put(kind, **payload)

  def event(self, kind: str, **payload):
    """Context that logs the event and holds the lock while its body launches the work."""
    if not self.logging:
      return contextlib.nullcontext()
    return self.events.event(kind, **payload)

  def end(self) -> None:
    if self.logging:
      with self.events.lock:
        self.events.put("end")
      self.logging = False

  def abort(self, message: str, save: bool) -> None:
    """Tells the followers to stop (best effort: a sampler stuck in a collective, because
    a follower died, keeps the lock)."""
    if not self.logging:
      return
    self.logging = False
    if self.events.lock.acquire(timeout=60):
      try:
        self.events.put("abort", message=message, save=save)
      finally:
        self.events.lock.release()

  def follow(self, handlers: dict, on_abort) -> None:
    """Follower: performs process 0's events in its order until its end event, each by
    `handlers[kind](payload)`; an abort event calls `on_abort(payload)` and raises."""
    while True:
      try:
        kind, payload = self.events.next()
      except MultiHostError as e:
        raise RunError(str(e)) from None
      if kind == "end":
        return
      if kind == "abort":
        on_abort(payload)
        raise RunError(f"process 0 stopped the run: {payload['message']}")
      if kind not in handlers:
        raise RunError(f"unknown event {kind!r} from process 0 (different rl_jax versions?)")
      handlers[kind](payload)


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

  def generate(self, params, state, *, num_slots: int, **kw):
    state, out = self._engine.generate(params, state, num_slots=num_slots, **kw)
    fn = self._replicate.get(num_slots)
    if fn is None:
      in_sh = jax.tree.map(lambda x: x.sharding, out)
      rep = jax.tree.map(lambda _: sharding_lib.replicated(self._engine.mesh), in_sh)
      fn = self._replicate[num_slots] = jax.jit(lambda x: x, in_shardings=(in_sh,),
                                                out_shardings=rep)
    return state, fn(out)


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
  """Writes `<RL_JAX_DIGEST>.<process index>` when RL_JAX_DIGEST is set (every process);
  `pipeline` has version, state.params and meshes.trainer."""
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


def follow(p, step: int) -> int:
  """A follower runs pipeline `p` (loop.Pipeline) from optimizer step `step`: performs
  process 0's events until its end event; the steps done."""
  me = jax.process_index()
  worker = p.worker

  def sample(e):
    for gid in e["gids"]:
      got = worker.admit_one()
      if got != gid:
        raise RunError(f"process {me} admitted group {got} where process 0 admitted "
                       f"{gid}; the processes have diverged")
    if e["version"] is not None:
      worker.swap_to(e["version"])
    for r in worker.generator.step():
      worker.on_rollout_finished(r)

  def train(e):
    worker.drop_groups(e["discarded"])
    groups = []
    for gid, rewards in zip(e["gids"], e["rewards"]):
      group = worker.take_group(gid)
      if group is None or len(group.rollouts) != len(rewards):
        raise RunError(f"process {me} lacks the rollouts of group {gid} that process 0 "
                       f"trains on; the processes have diverged")
      group.rollouts.sort(key=lambda x: x.sample_index)
      for r, reward in zip(group.rollouts, rewards):
        r.reward = float(reward)
      groups.append(group)
    tm = p.train_step(groups, publish=e["publish"])
    p._log_row(worker.steps_done, groups, tm, None)  # drains the row's buffers

  def abort(e):
    p._consistent = bool(e["save"])  # save collectively iff process 0 saves

  p.schedule.follow({
      "sample": sample, "train": train, "evaluate": lambda e: p.evaluate(),
      "save": lambda e: p.checkpoints.save(e["step"], heldout=e["heldout"], wait=e["wait"]),
  }, on_abort=abort)
  return worker.steps_done

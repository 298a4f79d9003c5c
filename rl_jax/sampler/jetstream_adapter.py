"""rl_jax's paged Engine behind JetStream 0.2.2's `engine_api.Engine`, for serving.

Shape letters: b decode slots, s decode steps per generate call.

This is the only RL-side module that imports jetstream (which pulls in seqio and
TensorFlow); training never imports it. JetStream 0.2.2's contract differs from its
GitHub main: `prefill` returns only the prefix (the first token comes from the first
`generate`), `ResultTokens` carries no log-probs, and there is no `free_resource`, so
pages are managed here: each slot owns enough pages for a whole sequence
(max_prefill_length + max_new_tokens), handed back when the orchestrator reuses the
slot. JetStream's orchestrator reads params once per thread start, so serving a new
policy version means restarting the driver; the RL path uses rl_jax's Generator.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

from rl_jax import sharding as shd
from rl_jax.sampler import engine as engine_lib
from rl_jax.sampler import page_table as pt


class Tokenizer(tokenizer_api.Tokenizer):
  """JetStream's tokenizer interface over an rl_jax tokenizer (CharTokenizer, HFTokenizer)."""

  def __init__(self, tokenizer):
    self._tok = tokenizer

  def encode(self, s: str, **kwargs) -> tuple[jax.Array | np.ndarray, int]:
    """(ids padded to JetStream's prefill buckets, true length); options as JetStream's."""
    ids = np.asarray(self._tok.encode(s), np.int32)
    return token_utils.pad_tokens(
        ids, self.bos_id, self.pad_id, is_bos=kwargs.pop("is_bos", True),
        prefill_lengths=kwargs.pop("prefill_lengths", None),
        max_prefill_length=kwargs.pop("max_prefill_length", None),
        jax_padding=kwargs.pop("jax_padding", True))

  def decode(self, token_ids: list[int], **kwargs) -> str:
    return self._tok.decode(token_ids)

  @property
  def pad_id(self) -> int:
    return self._tok.pad_id

  @property
  def eos_id(self) -> int:
    return self._tok.eos_id

  @property
  def bos_id(self) -> int:
    return self._tok.bos_id

  @property
  def stop_tokens(self) -> set[int]:
    return set(self._tok.stop_ids)


class JetStreamEngine(engine_api.Engine):
  """JetStream Engine over rl_jax's paged engine (one sample per slot).

  `sampling` applies to every request (greedy by default); request i is seeded with i.
  JetStream pads prompts to its buckets (16, 32, ... capped at max_prefill_length), so
  max_prefill_length must be 16 times a power of two.
  """

  def __init__(self, engine: engine_lib.Engine, *, params: Any = None,
               sampling: engine_lib.Sampling = engine_lib.Sampling.greedy()):
    if engine.tokenizer is None:
      raise ValueError("the engine needs a tokenizer to serve text")
    mpl = engine.max_prefill_length
    if mpl < 16 or mpl & (mpl - 1):
      raise ValueError(f"JetStream buckets need max_prefill_length = 16 * 2^k, got {mpl}")
    self._engine = engine
    self._params = params
    self._sampling = sampling
    self._pages_per_slot = pt.pages_for(mpl - 1 + engine.max_new_tokens, engine.page_size)
    need = self._pages_per_slot * engine.max_concurrent_decodes
    if need > engine.num_pages - 1:
      raise ValueError(f"serving reserves {need} pages ({self._pages_per_slot} per slot), "
                       f"the pool has {engine.num_pages - 1}")
    self._allocator = pt.PageAllocator(num_pages=engine.num_pages, page_size=engine.page_size)
    self._slot_pages: dict[int, np.ndarray] = {}
    self._requests = 0
    steps = engine.steps_per_call
    self._pack = jax.jit(_pack_result, in_shardings=(engine.output_shardings,),
                         out_shardings=shd.batch_sharding(engine.mesh, shd.SAMPLE_RULES, 2))
    self._idx = dict(tokens_idx=(0, steps), valid_idx=(steps, 2 * steps),
                     length_idx=(2 * steps, 2 * steps + 1))

  def load_params(self, *args, **kwargs) -> Any:
    """The params given at construction (placed for the engine), else random weights."""
    del args, kwargs
    return self._engine.load_params(self._params)

  def prefill(self, *, params: Any, existing_prefix: Any = None, padded_tokens: jax.Array,
              true_length: int) -> engine_lib.Prefix:
    # JetStream keeps the last bucket-many tokens of an over-long prompt but still
    # reports its full length.
    true_length = min(int(true_length), int(padded_tokens.shape[0]))
    return self._engine.prefill(params=params, existing_prefix=existing_prefix,
                                padded_tokens=padded_tokens, true_length=true_length)

  def insert(self, prefix: engine_lib.Prefix, decode_state: engine_lib.DecodeState,
             slot: int) -> engine_lib.DecodeState:
    """Give the slot fresh pages (returning the previous request's) and start decoding."""
    old = self._slot_pages.pop(slot, None)
    if old is not None:
      self._allocator.release(old)
    pages = self._allocator.allocate(self._pages_per_slot)
    self._slot_pages[slot] = pages
    seed, self._requests = self._requests, self._requests + 1
    return self._engine.insert(prefix, decode_state, slot, pages=pages,
                               sampling=self._sampling, seed=seed)

  def generate(self, params: Any, decode_state: engine_lib.DecodeState
               ) -> tuple[engine_lib.DecodeState, engine_api.ResultTokens]:
    decode_state, out = self._engine.generate(params, decode_state)
    return decode_state, engine_api.ResultTokens(
        data=self._pack(out), samples_per_slot=1, **self._idx)

  def init_decode_state(self, *args, **kwargs) -> engine_lib.DecodeState:
    del args, kwargs
    self._allocator = pt.PageAllocator(num_pages=self._engine.num_pages,
                                       page_size=self._engine.page_size)
    self._slot_pages.clear()
    return self._engine.init_decode_state()

  def get_prefix_destination_sharding(self) -> Any:
    return self._engine.prefix_shardings

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path="rl_jax", extra_ids=0)

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> Tokenizer:
    del metadata
    return Tokenizer(self._engine.tokenizer)

  @property
  def max_concurrent_decodes(self) -> int:
    return self._engine.max_concurrent_decodes

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._engine.max_prefill_length

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._engine.mesh

  @property
  def colocated_cpus(self) -> None:
    return None


def _pack_result(out: engine_lib.StepOutput) -> jax.Array:
  """int32 [b, 2s + 1]: tokens, validity, tokens generated so far (one host copy)."""
  return jnp.concatenate([out.tokens_sb.T, out.valid_sb.T.astype(jnp.int32),
                          out.generated_b[:, None]], axis=1)


def _patch_jetstream() -> None:
  """Work around three defects of JetStream 0.2.2's orchestrator (once per process).

  Its worker threads kill the whole process (SIGKILL) on any exception, so each of
  these races, harmless in itself, takes the server (or a test runner) down:
    - `delete_pytree` uses `jax.tree_map`, which newer JAX removed;
    - `AsyncMultifuture.set_exception` posts the end of a stream and its done flag to
      the receiver's event loop in two calls: once the first lands, the receiver may
      finish and close its loop, and the second raises 'Event loop is closed' in the
      detokenize thread. Here both go in one call, and a closed loop (nobody listening
      any more) is not an error;
    - the generate thread asserts that some slot is busy right after scanning the free
      slots, but the detokenize thread may free the last busy slot in between. Every
      slot is then free, so `Driver._generate_thread` is restarted (fresh decode state)
      instead of failing (see `_Driver`).
  """
  from jetstream.core import orchestrator
  from jetstream.core.utils import async_multifuture as amf
  if getattr(orchestrator, "_rl_jax_patched", False):
    return

  def delete_pytree(tree):
    jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, tree)

  def set_exception(self, exception: Exception) -> None:
    def finish():
      self._queue.put_nowait(amf._Exception(exception))  # pylint: disable=protected-access
      self._done.set()
    try:
      self._loop.call_soon_threadsafe(finish)
    except RuntimeError:  # the receiver's loop is closed: it stopped listening
      self._done.set()

  def add_result(self, result) -> None:
    try:
      self._loop.call_soon_threadsafe(self._queue.put_nowait, result)
    except RuntimeError:
      pass

  orchestrator.delete_pytree = delete_pytree
  amf.AsyncMultifuture.set_exception = set_exception
  amf.AsyncMultifuture.add_result = add_result
  orchestrator._rl_jax_patched = True  # pylint: disable=protected-access


_SLOT_ASSERT = "At this point we must have some requests inserted into the slots."


def make_driver(engine: JetStreamEngine, params: Any):
  """JetStream's orchestrator Driver with `engine` doing prefill and generate
  (interleaved mode, one slice), with the fixes of `_patch_jetstream`."""
  from jetstream.core import orchestrator
  _patch_jetstream()

  class _Driver(orchestrator.Driver):
    """Restarts the generate loop after JetStream's free-slot race (all slots free)."""

    def _generate_thread(self, idx: int):
      while True:
        try:
          return super()._generate_thread(idx)
        except AssertionError as e:
          if str(e) != _SLOT_ASSERT or not self.live:
            raise

  return _Driver(prefill_engines=[engine], generate_engines=[engine],
                 prefill_params=[params], generate_params=[params],
                 interleaved_mode=True)


def serve(engine: JetStreamEngine, params: Any, *, port: int, threads: int | None = None):
  """Start JetStream's gRPC server for `engine`; it accepts local connections only.

  Returns the started jetstream.core.server_lib.JetStreamServer (call .stop()).
  """
  import grpc
  from jetstream.core import server_lib

  driver = make_driver(engine, params)
  server = server_lib.JetStreamServer(
      driver, threads or max(driver.get_total_concurrent_requests(), 8), port,
      grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP))
  server.start()
  return server

"""JetStream 0.2.2's own orchestrator (and gRPC server) driving rl_jax's paged engine."""
import asyncio
import functools
import logging
import socket
import threading
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# jetstream's engine_api pulls in seqio and TensorFlow; only skip where it cannot load.
pytest.importorskip("jetstream.engine.engine_api",
                    reason="google-jetstream (with seqio/TensorFlow) is not importable")

from jetstream.core import orchestrator  # noqa: E402
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: E402

# Importing the orchestrator sets the root logger to DEBUG with its own stdout handler;
# undo that so JAX's debug logs do not flood (or outlive) the test's captured stdout.
logging.getLogger().removeHandler(orchestrator.handler)
logging.getLogger().setLevel(logging.WARNING)

# JetStream's worker threads SIGKILL the process on any exception, which would take the
# whole test run down without a word. In tests, a worker error is recorded and reported
# by the test instead (the adapter's own fixes must keep this list empty).
THREAD_ERRORS: list[str] = []


def _recording_run(self):
  try:
    threading.Thread.run(self)
  except Exception:  # noqa: BLE001
    THREAD_ERRORS.append(f"{self.name}: {traceback.format_exc()}")


orchestrator.JetThread.run = _recording_run


@pytest.fixture(autouse=True)
def _no_worker_errors():
  THREAD_ERRORS.clear()
  yield
  assert not THREAD_ERRORS, "a JetStream worker thread failed:\n" + "\n".join(THREAD_ERRORS)


from rl_jax import model  # noqa: E402
from rl_jax import sharding as shd  # noqa: E402
from rl_jax.sampler import engine as E  # noqa: E402
from rl_jax.sampler import jetstream_adapter as JA  # noqa: E402

CFG = model.get_preset("tiny_char")
TOK = model.CharTokenizer()
MAX_NEW = 8


@pytest.fixture(scope="module")
def params():
  p = model.init_params(CFG, jax.random.key(1))
  return jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, p)


@pytest.fixture(scope="module")
def adapter(params):
  eng = E.Engine(CFG, mesh=shd.make_mesh((1, 1, 1), jax.devices()[:1]),
                 max_concurrent_decodes=4, page_size=4, num_pages=32, max_prefill_length=16,
                 max_new_tokens=MAX_NEW, tokenizer=TOK)
  return JA.JetStreamEngine(eng, params=params)


@functools.lru_cache(maxsize=None)
def _apply_fn():
  return jax.jit(lambda p, t: model.apply(CFG, p, t))


def reference(params, prompt_ids, max_tokens):
  """Greedy ids after [bos] + prompt (what JetStream feeds), up to a stop id."""
  seq = [TOK.bos_id] + list(prompt_ids)
  out = []
  for _ in range(max_tokens):
    padded = np.zeros((1, 32), np.int32)
    padded[0, :len(seq)] = seq
    t = int(jnp.argmax(_apply_fn()(params, jnp.asarray(padded))[0, len(seq) - 1]))
    if t in TOK.stop_ids:
      break
    out.append(t)
    seq.append(t)
  return out


def test_abstract_api_is_complete(adapter):
  assert not getattr(JA.JetStreamEngine, "__abstractmethods__", None)
  tok = adapter.build_tokenizer(adapter.get_tokenizer())
  ids, n = tok.encode("12+3=", is_bos=True, max_prefill_length=16, jax_padding=False)
  assert n == 6 and ids.shape == (16,) and ids[0] == TOK.bos_id
  assert tok.decode(list(ids[1:n])) == "12+3="
  assert tok.stop_tokens == set(TOK.stop_ids)


def test_prefill_over_existing_prefix_equals_full_prefill(adapter, params):
  """JetStream's prefill(existing_prefix=...) passes through: the prefix of "12+3"
  extended by "=7" equals the prefix of "12+3=7" (K/V, last token, length), and both
  give the full recompute's greedy first token."""
  tok = adapter.build_tokenizer(adapter.get_tokenizer())
  p = adapter.load_params()

  def encode(text, bos):
    return tok.encode(text, is_bos=bos, max_prefill_length=16, jax_padding=True)

  full = adapter.prefill(params=p, padded_tokens=encode("12+3=7", True)[0],
                         true_length=encode("12+3=7", True)[1])
  head, n_head = encode("12+3", True)
  tail, n_tail = encode("=7", False)
  ext = adapter.prefill(params=p, existing_prefix=adapter.prefill(
      params=p, padded_tokens=head, true_length=n_head), padded_tokens=tail,
                        true_length=n_tail)
  n = n_head + n_tail
  assert int(ext.true_length) == int(full.true_length) == n
  assert int(ext.last_token) == int(full.last_token) == TOK.encode("7")[0]
  for a, b in ((ext.k_lktd, full.k_lktd), (ext.v_lktd, full.v_lktd)):
    np.testing.assert_allclose(np.asarray(a)[:, :, :n], np.asarray(b)[:, :, :n],
                               rtol=1e-5, atol=1e-4)
  firsts = []
  for prefix in (full, ext):
    state = adapter.insert(prefix, adapter.init_decode_state(), 0)
    _, result = adapter.generate(p, state)
    firsts.append(int(np.asarray(result.data)[0, 0]))
  seq = [TOK.bos_id] + TOK.encode("12+3=7")
  padded = np.zeros((1, 32), np.int32)
  padded[0, :len(seq)] = seq
  want = int(jnp.argmax(_apply_fn()(params, jnp.asarray(padded))[0, len(seq) - 1]))
  assert firsts == [want, want]


def test_orchestrator_drives_adapter(adapter, params):
  driver = JA.make_driver(adapter, adapter.load_params())
  client = orchestrator.LLMOrchestrator(driver=driver)
  texts = ["12+3=", "7+7=", "99+1=", "hello", "a", "40+2="]  # more requests than slots

  async def decode(text, max_tokens):
    request = jetstream_pb2.DecodeRequest(
        session_cache="", priority=1, max_tokens=max_tokens,
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=TOK.encode(text)))
    ids = []
    async for resp in client.Decode(request):
      ids.extend(resp.stream_content.samples[0].token_ids)
    return ids

  async def run_all():
    return await asyncio.wait_for(
        asyncio.gather(*[decode(t, 3 + i % 4) for i, t in enumerate(texts)]), timeout=120)

  try:
    got = asyncio.run(run_all())
  finally:
    driver.stop()
  for i, (text, ids) in enumerate(zip(texts, got)):
    assert ids == reference(params, TOK.encode(text), 3 + i % 4), text


def test_grpc_server_round_trip(adapter, params):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  server = JA.serve(adapter, adapter.load_params(), port=port)
  import grpc

  async def call():
    async with grpc.aio.secure_channel(
        f"localhost:{port}",
        grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)) as channel:
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      assert (await stub.HealthCheck(jetstream_pb2.HealthCheckRequest())).is_live
      request = jetstream_pb2.DecodeRequest(
          session_cache="", priority=1, max_tokens=5,
          text_content=jetstream_pb2.DecodeRequest.TextContent(text="12+3="))
      return "".join([r.stream_content.samples[0].text async for r in stub.Decode(request)])

  try:
    text = asyncio.run(asyncio.wait_for(call(), timeout=120))
  finally:
    server.stop()
  assert text == TOK.decode(reference(params, TOK.encode("12+3="), 5))


def test_streams_ending_as_their_event_loop_closes_do_not_kill_workers(adapter):
  """JetStream 0.2.2 ends a stream with two posts to the receiver's loop; a receiver that
  finishes after the first and closes its loop made the second raise in the detokenize
  thread, which SIGKILLs the process. Offline callers (one asyncio.run per request) hit
  it within a few dozen requests before the adapter's fix."""
  driver = JA.make_driver(adapter, adapter.load_params())
  client = orchestrator.LLMOrchestrator(driver=driver)

  async def decode(max_tokens):
    request = jetstream_pb2.DecodeRequest(
        session_cache="", priority=1, max_tokens=max_tokens,
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=TOK.encode("12+3=")))
    return [t async for r in client.Decode(request) for t in r.stream_content.samples[0].token_ids]

  try:
    lengths = [len(asyncio.run(asyncio.wait_for(decode(2 + i % 3), timeout=60)))
               for i in range(120)]
  finally:
    driver.stop()
  assert lengths == [2 + i % 3 for i in range(120)]


def test_lora_adapters_are_served_merged_into_the_base(params):
  """An engine holding a LoRA base serves adapters: load_params gives the decode weights
  of the merged model (W0 + (alpha/r) A B), as the full merged params would."""
  from rl_jax.model import lora
  cfg = CFG.replace(lora_rank=4, lora_targets=("q", "down"))
  eng = E.Engine(cfg, mesh=shd.make_mesh((1, 1, 1), jax.devices()[:1]),
                 max_concurrent_decodes=4, page_size=4, num_pages=32, max_prefill_length=16,
                 max_new_tokens=MAX_NEW, tokenizer=TOK)
  eng.set_base(params)
  ad = lora.init_adapters(cfg, jax.random.key(3))
  ad = jax.tree.map(lambda x: x + 0.1, ad)  # B != 0
  served = JA.JetStreamEngine(eng, params=ad).load_params()
  want = eng.load_params(lora.merge_params(cfg, params, ad))
  for a, b in zip(jax.tree.leaves(served), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  assert not np.allclose(np.asarray(served["layers"][0]["q"]),
                         np.asarray(params["layers"]["q"][0]))

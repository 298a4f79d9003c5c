"""Paged-KV decode engine for the rl_jax transformer, shaped like JetStream's Engine API.

Shape letters:
  b decode slots, t prefill positions (a length bucket), s decode steps per call,
  l layers, n pages in the pool, p tokens per page, k kv heads, h query heads,
  d head_dim, v vocab, m pages per sequence (page-table width), r words of a raw
  PRNG key.

Device state (`DecodeState`) is one pytree: the K/V page pools `k_pages_lnpkd` /
`v_pages_lnpkd`, a page table per slot, and per-slot decode registers (current token,
cache length, sampling settings, PRNG key). Every operation is a jitted function with
explicit in/out shardings on the sampler mesh that donates the state, so the pools
are updated in place.

The cache of a slot holds `lengths_b` tokens; `tokens_b` is the token at position
`lengths_b` whose K/V is not yet written. A decode step writes that token's K/V,
attends over the slot's pages plus itself, samples the next token and advances. So
`prefill` caches all prompt tokens but the last, and the last prompt token is fed to
the first decode step, which returns the first completion token (JetStream 0.2.2
semantics: the first token comes from the first generate).

Sampling (per slot, on device): temperature <= 0 is greedy; otherwise logits / T,
then top-k (k > 0) and top-p (p < 1) truncation, then a categorical draw with the key
fold_in(fold_in(key(seed), sample_index), position), so a request's tokens depend on
its seed and not on which slot or batch it ran in. The returned log-prob is that of
the sampled token under the distribution actually sampled from (after temperature and
truncation); with the default temperature 1, top_k 0, top_p 1 this is the model's own
log-softmax. Greedy slots report the model's temperature-1 log-prob of the argmax
token (the point mass they sample from carries no information).

Page ownership is host-side (page_table.py); the engine only follows page tables. Page
`NULL_PAGE` absorbs the writes of idle slots.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding

from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.sampler import page_table as pt

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2

_POOL_AXES = ("layers", "pages", "page_slot", "kv_heads", "head_dim")
_PREFIX_AXES = ("layers", "length", "kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Per-request sampling: temperature <= 0 means greedy; top_k 0 and top_p 1 are off."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  @classmethod
  def greedy(cls) -> Sampling:
    return cls(temperature=0.0)

  def __post_init__(self):
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 is off), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class DecodeState(NamedTuple):
  """Everything a decode step reads and writes; lives on the sampler mesh."""
  k_pages_lnpkd: jax.Array
  v_pages_lnpkd: jax.Array
  page_table_bm: jax.Array  # int32 page ids, NULL_PAGE where unused
  lengths_b: jax.Array  # int32 tokens in the cache = position of tokens_b
  tokens_b: jax.Array  # int32 next input token (K/V not yet cached)
  active_b: jax.Array  # bool
  generated_b: jax.Array  # int32 tokens sampled since insert
  max_new_b: jax.Array  # int32 sampling budget
  stop_on_eos_b: jax.Array  # bool: a stop id ends the sequence
  keys_br: jax.Array  # uint32 raw PRNG key per request
  temperature_b: jax.Array  # float32, <= 0 greedy
  top_k_b: jax.Array  # int32, 0 off
  top_p_b: jax.Array  # float32, 1 off


class StepOutput(NamedTuple):
  """What one generate call returns for the host, per step s and slot b."""
  tokens_sb: jax.Array  # int32 sampled token
  logprobs_sb: jax.Array  # float32 behaviour log-prob of that token
  valid_sb: jax.Array  # bool: the slot was decoding at that step
  finish_sb: jax.Array  # int32 FINISH_NONE | FINISH_STOP | FINISH_LENGTH
  generated_b: jax.Array  # int32 tokens sampled since insert, after the call


class Prefix(NamedTuple):
  """Dense K/V of one padded prompt (JetStream's `Prefix`).

  Positions 0..true_length-2 are written to pages at insert; the last prompt token
  is kept as the first decode input.
  """
  k_ltkd: jax.Array
  v_ltkd: jax.Array
  last_token: jax.Array  # int32 scalar
  true_length: jax.Array  # int32 scalar


class InsertBatch(NamedTuple):
  """Host-side description of sequences to start, padded to max_concurrent_decodes rows.

  Padding rows have slot == max_concurrent_decodes (dropped on device) and copy the null
  page onto itself.
  """
  slot_i: np.ndarray  # int32
  page_table_im: np.ndarray  # int32
  copy_src_i: np.ndarray  # int32 page to copy into copy_dst_i (copy-on-write)
  copy_dst_i: np.ndarray  # int32
  token_i: np.ndarray  # int32 last prompt token
  length_i: np.ndarray  # int32 cached prompt tokens (prompt length - 1)
  max_new_i: np.ndarray  # int32
  stop_on_eos_i: np.ndarray  # bool
  seed_i: np.ndarray  # int32
  sample_index_i: np.ndarray  # int32
  temperature_i: np.ndarray  # float32
  top_k_i: np.ndarray  # int32
  top_p_i: np.ndarray  # float32


def sample_tokens(*, logits_bv: jax.Array, keys_b: jax.Array, temperature_b: jax.Array,
                  top_k_b: jax.Array, top_p_b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(tokens_b int32, logprobs_b float32) for one step; see the module docstring.

  top-k keeps the k highest logits; top-p then keeps the smallest prefix of the sorted
  distribution whose mass reaches p (the top token always survives). The sort only runs
  when some slot truncates.
  """
  logits_bv = logits_bv.astype(jnp.float32)
  greedy_b = temperature_b <= 0
  scaled_bv = logits_bv / jnp.where(greedy_b, 1.0, temperature_b)[:, None]
  truncate = jnp.any(~greedy_b & ((top_k_b > 0) | (top_p_b < 1)))
  scaled_bv = lax.cond(truncate, _truncate, lambda x, *_: x, scaled_bv, top_k_b, top_p_b)
  sampled_b = jax.vmap(jax.random.categorical)(keys_b, scaled_bv)
  tokens_b = jnp.where(greedy_b, jnp.argmax(logits_bv, axis=-1), sampled_b).astype(jnp.int32)
  logp_bv = jax.nn.log_softmax(jnp.where(greedy_b[:, None], logits_bv, scaled_bv), axis=-1)
  logprobs_b = jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=-1)[:, 0]
  return tokens_b, logprobs_b


def _truncate(scaled_bv, top_k_b, top_p_b):
  """scaled_bv with everything outside each row's top-k / top-p set at -inf."""
  b, v = scaled_bv.shape
  order_bv = jnp.argsort(-scaled_bv, axis=-1)
  sorted_bv = jnp.take_along_axis(scaled_bv, order_bv, axis=-1)
  rank_v = jnp.arange(v)
  keep_bv = (top_k_b[:, None] <= 0) | (rank_v[None] < top_k_b[:, None])
  probs_bv = jax.nn.softmax(jnp.where(keep_bv, sorted_bv, -jnp.inf), axis=-1)
  mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
  # top_p == 1 keeps everything even when float rounding lets the cumulative mass hit 1.
  keep_bv &= (mass_before_bv < top_p_b[:, None]) | (top_p_b[:, None] >= 1)
  keep_orig_bv = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], order_bv].set(keep_bv)
  return jnp.where(keep_orig_bv, scaled_bv, -jnp.inf)


def _prefill_attention(q_bthd, k_btkd, v_btkd, layer_cache, attn_ctx, *, implementation):
  del layer_cache, attn_ctx
  return (model.causal_attention(q_bthd, k_btkd, v_btkd, implementation=implementation),
          (k_btkd, v_btkd))


def _paged_decode_attention(q_b1hd, k_b1kd, v_b1kd, layer_cache, attn_ctx):
  """One new token per slot attends over its gathered pages plus itself.

  The pools arrive through attn_ctx, a loop invariant of the layer scan, so they are
  read in place; the layer cache only carries this layer's index and returns the new
  K/V, which the caller scatters into the pools once after the scan.
  """
  layer = layer_cache["layer"]
  page_table_bm, lengths_b = attn_ctx["page_table_bm"], attn_ctx["lengths_b"]
  b, m = page_table_bm.shape
  k_pages, v_pages = attn_ctx["k_pages_lnpkd"], attn_ctx["v_pages_lnpkd"]
  p, kh, d = k_pages.shape[2:]
  past_k_bskd = k_pages[layer, page_table_bm].reshape(b, m * p, kh, d)
  past_v_bskd = v_pages[layer, page_table_bm].reshape(b, m * p, kh, d)
  k_bskd = jnp.concatenate([past_k_bskd, k_b1kd.astype(k_pages.dtype)], axis=1)
  v_bskd = jnp.concatenate([past_v_bskd, v_b1kd.astype(v_pages.dtype)], axis=1)
  past_bs = jnp.arange(m * p)[None] < lengths_b[:, None]
  mask_b1s = jnp.concatenate([past_bs, jnp.ones((b, 1), bool)], axis=1)[:, None]
  out_b1hd = model.gqa_attention(q_b1hd.astype(k_pages.dtype), k_bskd, v_bskd, mask_b1s)
  return out_b1hd, {"layer": layer, "k": k_b1kd.astype(k_pages.dtype),
                    "v": v_b1kd.astype(v_pages.dtype)}


def _decode_step(state: DecodeState, *, model_cfg, params, stop_ids, page_size):
  """One token for every slot: (new state, (tokens_b, logprobs_b, valid_b, finish_b))."""
  num_layers = model_cfg.num_layers
  b, m = state.page_table_bm.shape
  kh, d = state.k_pages_lnpkd.shape[3:]
  new_kv = jnp.zeros((num_layers, b, 1, kh, d), state.k_pages_lnpkd.dtype)
  cache = {"layer": jnp.arange(num_layers, dtype=jnp.int32), "k": new_kv, "v": new_kv}
  ctx = {"k_pages_lnpkd": state.k_pages_lnpkd, "v_pages_lnpkd": state.v_pages_lnpkd,
         "page_table_bm": state.page_table_bm, "lengths_b": state.lengths_b}
  logits_b1v, cache = model.forward(
      model_cfg, params, state.tokens_b[:, None], state.lengths_b[:, None],
      attn_fn=_paged_decode_attention, cache=cache, attn_ctx=ctx)

  pos_b = state.lengths_b
  col_b = jnp.minimum(pos_b // page_size, m - 1)
  page_b = jnp.take_along_axis(state.page_table_bm, col_b[:, None], axis=1)[:, 0]
  page_b = jnp.where(state.active_b, page_b, pt.NULL_PAGE)
  k_pages = state.k_pages_lnpkd.at[:, page_b, pos_b % page_size].set(cache["k"][:, :, 0])
  v_pages = state.v_pages_lnpkd.at[:, page_b, pos_b % page_size].set(cache["v"][:, :, 0])

  step_keys_b = jax.vmap(lambda raw, pos: jax.random.fold_in(jax.random.wrap_key_data(raw),
                                                             pos))(state.keys_br, pos_b)
  tokens_b, logprobs_b = sample_tokens(
      logits_bv=logits_b1v[:, 0], keys_b=step_keys_b, temperature_b=state.temperature_b,
      top_k_b=state.top_k_b, top_p_b=state.top_p_b)

  valid_b = state.active_b
  generated_b = state.generated_b + valid_b
  hit_stop_b = jnp.zeros_like(valid_b)
  for stop_id in stop_ids:
    hit_stop_b |= tokens_b == stop_id
  stop_b = valid_b & state.stop_on_eos_b & hit_stop_b
  length_b = valid_b & ~stop_b & (generated_b >= state.max_new_b)
  finish_b = jnp.where(stop_b, FINISH_STOP, jnp.where(length_b, FINISH_LENGTH, FINISH_NONE))
  new_state = state._replace(
      k_pages_lnpkd=k_pages, v_pages_lnpkd=v_pages,
      lengths_b=state.lengths_b + valid_b,
      tokens_b=jnp.where(valid_b, tokens_b, state.tokens_b),
      active_b=valid_b & ~stop_b & ~length_b,
      generated_b=generated_b)
  return new_state, (tokens_b, logprobs_b, valid_b, finish_b.astype(jnp.int32))


def _generate(params, state, *, model_cfg, stop_ids, page_size, steps):
  step = functools.partial(_decode_step, model_cfg=model_cfg, params=params,
                           stop_ids=stop_ids, page_size=page_size)
  state, (tokens_sb, logprobs_sb, valid_sb, finish_sb) = lax.scan(
      lambda s, _: step(s), state, None, length=steps)
  return state, StepOutput(tokens_sb, logprobs_sb, valid_sb, finish_sb, state.generated_b)


_SLOT_FIELDS = tuple(f for f in DecodeState._fields if f not in ("k_pages_lnpkd", "v_pages_lnpkd"))


def _generate_first(params, state, *, num_slots, **kw):
  """_generate over slots [0, num_slots) only: with the KV in pages, a smaller batch is
  just a slice of the per-slot registers."""
  sub = state._replace(**{f: getattr(state, f)[:num_slots] for f in _SLOT_FIELDS})
  sub, out = _generate(params, sub, **kw)
  return state._replace(
      k_pages_lnpkd=sub.k_pages_lnpkd, v_pages_lnpkd=sub.v_pages_lnpkd,
      **{f: getattr(state, f).at[:num_slots].set(getattr(sub, f)) for f in _SLOT_FIELDS}), out


def _move_slots(state, src_i, dst_i):
  """Move sequences from slots src_i to slots dst_i (registers and page tables only)."""
  moved = {f: getattr(state, f).at[dst_i].set(getattr(state, f)[src_i], mode="drop")
           for f in _SLOT_FIELDS}
  moved["active_b"] = moved["active_b"].at[src_i].set(False, mode="drop")
  return state._replace(**moved)


def _prefill(params, padded_tokens_t, true_length, *, model_cfg, kv_dtype):
  t = padded_tokens_t.shape[0]
  positions_1t = jnp.arange(t, dtype=jnp.int32)[None]
  # Logits are not returned, so XLA drops the vocabulary projection.
  _, (k_l1tkd, v_l1tkd) = model.forward(model_cfg, params, padded_tokens_t[None],
                                        positions_1t, attn_fn=functools.partial(
                                            _prefill_attention,
                                            implementation=model_cfg.attention))
  return Prefix(k_l1tkd[:, 0].astype(kv_dtype), v_l1tkd[:, 0].astype(kv_dtype),
                padded_tokens_t[true_length - 1].astype(jnp.int32),
                jnp.asarray(true_length, jnp.int32))


def _write_prefix(state, prefix, pages_m, *, page_size):
  """Scatter prompt positions 0..true_length-2 into pages_m (page j holds positions
  j*p .. j*p+p-1); the rest of the bucket goes to the null page."""
  t = prefix.k_ltkd.shape[1]
  m = pages_m.shape[0]
  pos_t = jnp.arange(t)
  page_t = jnp.where(pos_t < prefix.true_length - 1,
                     pages_m[jnp.minimum(pos_t // page_size, m - 1)], pt.NULL_PAGE)
  return state._replace(
      k_pages_lnpkd=state.k_pages_lnpkd.at[:, page_t, pos_t % page_size].set(prefix.k_ltkd),
      v_pages_lnpkd=state.v_pages_lnpkd.at[:, page_t, pos_t % page_size].set(prefix.v_ltkd))


def _insert(state, ins: InsertBatch):
  # Copy-on-write of the partial last prompt page: every new sequence writes its own
  # tokens after the prompt, so it gets a private copy before its first step.
  k_pages = state.k_pages_lnpkd.at[:, ins.copy_dst_i].set(state.k_pages_lnpkd[:, ins.copy_src_i])
  v_pages = state.v_pages_lnpkd.at[:, ins.copy_dst_i].set(state.v_pages_lnpkd[:, ins.copy_src_i])
  keys_ir = jax.vmap(lambda seed, j: jax.random.key_data(
      jax.random.fold_in(jax.random.key(seed), j)))(ins.seed_i, ins.sample_index_i)

  def put(x, v):
    return x.at[ins.slot_i].set(v.astype(x.dtype), mode="drop")

  return state._replace(
      k_pages_lnpkd=k_pages, v_pages_lnpkd=v_pages,
      page_table_bm=put(state.page_table_bm, ins.page_table_im),
      lengths_b=put(state.lengths_b, ins.length_i),
      tokens_b=put(state.tokens_b, ins.token_i),
      active_b=put(state.active_b, jnp.ones_like(ins.slot_i, bool)),
      generated_b=put(state.generated_b, jnp.zeros_like(ins.slot_i)),
      max_new_b=put(state.max_new_b, ins.max_new_i),
      stop_on_eos_b=put(state.stop_on_eos_b, ins.stop_on_eos_i),
      keys_br=put(state.keys_br, keys_ir),
      temperature_b=put(state.temperature_b, ins.temperature_i),
      top_k_b=put(state.top_k_b, ins.top_k_i),
      top_p_b=put(state.top_p_b, ins.top_p_i))


def _free_slots(state, slot_i):
  m = state.page_table_bm.shape[1]
  return state._replace(
      active_b=state.active_b.at[slot_i].set(False, mode="drop"),
      page_table_bm=state.page_table_bm.at[slot_i].set(
          jnp.full((slot_i.shape[0], m), pt.NULL_PAGE, jnp.int32), mode="drop"))


def _set_page_rows(state, slot_i, page_table_im):
  return state._replace(
      page_table_bm=state.page_table_bm.at[slot_i].set(page_table_im, mode="drop"))


class Engine:
  """Paged decode engine: JetStream's Engine methods plus rl_jax's page/log-prob extras.

  JetStream-shaped: load_params, init_decode_state, prefill, insert, generate,
  free_resource, max_concurrent_decodes, samples_per_slot, max_prefill_length, mesh,
  get_tokenizer. rl_jax extras used by the Generator: write_prefix (one prefill shared
  by many slots), insert_many (start many sequences in one call, with copy-on-write of
  a partial page), set_page_rows (grow page tables), free_slots, move_slots and
  generate(num_slots=k) (decode only the first k slots when few are busy), pad_tokens.
  Every device method is jitted once per input shape (prefill once per length bucket,
  generate once per slot bucket).
  """

  def __init__(self, model_cfg: model.ModelConfig, *, mesh: Mesh,
               max_concurrent_decodes: int, page_size: int, num_pages: int,
               max_prefill_length: int, max_new_tokens: int, dtype: str = "float32",
               steps_per_call: int = 1, stop_ids: Sequence[int] | None = None,
               tokenizer: Any = None, rules: shd.Rules = shd.SAMPLE_RULES):
    if mesh.shape.get("fsdp", 1) != 1:
      raise ValueError("the sampler mesh must have fsdp=1")
    for name, value in (("max_concurrent_decodes", max_concurrent_decodes),
                        ("page_size", page_size), ("max_prefill_length", max_prefill_length),
                        ("max_new_tokens", max_new_tokens), ("steps_per_call", steps_per_call)):
      if value < 1:
        raise ValueError(f"sampler.{name} must be >= 1, got {value}")
    self.model_cfg = model_cfg.replace(dtype=dtype, param_dtype=dtype)
    self.tokenizer = tokenizer
    self.stop_ids = tuple(sorted(int(i) for i in (
        stop_ids if stop_ids is not None else
        getattr(tokenizer, "stop_ids", None) or (model_cfg.eos_id,))))
    self._mesh = mesh
    self._rules = rules
    self._slots = int(max_concurrent_decodes)
    self.page_size = int(page_size)
    self.num_pages = int(num_pages)
    self._max_prefill_length = int(max_prefill_length)
    self.max_new_tokens = int(max_new_tokens)
    self.steps_per_call = int(steps_per_call)
    self.max_seq_len = self._max_prefill_length + self.max_new_tokens
    self.pages_per_seq = pt.pages_for(self.max_seq_len, self.page_size)
    self.kv_dtype = jnp.dtype(dtype)
    # JetStream's own padding uses power-of-two buckets from 16, capped at the maximum.
    self.prefill_buckets = tuple(sorted(
        {b for b in (2 ** i for i in range(4, 20)) if b < self._max_prefill_length} |
        {self._max_prefill_length}))

    cfg = self.model_cfg
    param_shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    self.param_shardings = shd.tree_shardings(model.param_logical_axes(cfg), param_shapes,
                                              mesh, rules)
    self.state_shardings = self._state_shardings()
    rep = shd.replicated(mesh)
    self.output_shardings = self._output_shardings(self._slots)
    # generate can run over the first k slots only; k is one of these.
    self.slot_buckets = tuple(sorted(
        {b for b in (2 ** i for i in range(20)) if b < self._slots} | {self._slots}))
    prefix_sh = self._sharding(_PREFIX_AXES, (cfg.num_layers, self._max_prefill_length,
                                              cfg.num_kv_heads, cfg.head_dim))
    self.prefix_shardings = Prefix(prefix_sh, prefix_sh, rep, rep)
    ins_sh = InsertBatch(*([rep] * len(InsertBatch._fields)))
    st = self.state_shardings

    self._init_params = jax.jit(functools.partial(model.init_params, cfg),
                                in_shardings=rep, out_shardings=self.param_shardings)
    self._init_state = jax.jit(self._zero_state, in_shardings=(), out_shardings=st)
    self._generate = {
        k: jax.jit(
            functools.partial(_generate_first, num_slots=k, model_cfg=cfg,
                              stop_ids=self.stop_ids, page_size=self.page_size,
                              steps=self.steps_per_call),
            in_shardings=(self.param_shardings, st),
            out_shardings=(st, self._output_shardings(k)), donate_argnums=(1,))
        for k in self.slot_buckets}
    self._prefill = jax.jit(
        functools.partial(_prefill, model_cfg=cfg, kv_dtype=self.kv_dtype),
        in_shardings=(self.param_shardings, rep, rep), out_shardings=self.prefix_shardings)
    self._write_prefix = jax.jit(
        functools.partial(_write_prefix, page_size=self.page_size),
        in_shardings=(st, self.prefix_shardings, rep), out_shardings=st, donate_argnums=(0,))
    self._insert = jax.jit(_insert, in_shardings=(st, ins_sh), out_shardings=st,
                           donate_argnums=(0,))
    self._free = jax.jit(_free_slots, in_shardings=(st, rep), out_shardings=st,
                         donate_argnums=(0,))
    self._set_rows = jax.jit(_set_page_rows, in_shardings=(st, rep, rep), out_shardings=st,
                             donate_argnums=(0,))
    self._move = jax.jit(_move_slots, in_shardings=(st, rep, rep), out_shardings=st,
                         donate_argnums=(0,))

  @classmethod
  def from_config(cls, sampler_cfg, model_cfg: model.ModelConfig, *, mesh: Mesh,
                  tokenizer: Any = None) -> Engine:
    """An engine from the `sampler` config section; num_pages 0 derives the pool size
    from kv_cache_bytes (per sampler replica)."""
    num_pages = int(sampler_cfg.num_pages) or pt.num_pages_for_budget(
        kv_cache_bytes=int(sampler_cfg.kv_cache_bytes), num_layers=model_cfg.num_layers,
        num_kv_heads=model_cfg.num_kv_heads, head_dim=model_cfg.head_dim,
        page_size=int(sampler_cfg.page_size),
        dtype_bytes=jnp.dtype(sampler_cfg.dtype).itemsize)
    return cls(model_cfg, mesh=mesh,
               max_concurrent_decodes=int(sampler_cfg.max_concurrent_decodes),
               page_size=int(sampler_cfg.page_size), num_pages=num_pages,
               max_prefill_length=int(sampler_cfg.max_prefill_length),
               max_new_tokens=int(sampler_cfg.max_new_tokens), dtype=sampler_cfg.dtype,
               steps_per_call=int(sampler_cfg.steps_per_call), tokenizer=tokenizer)

  def _output_shardings(self, num_slots: int) -> StepOutput:
    s_b = self._sharding((None, "batch"), (self.steps_per_call, num_slots))
    return StepOutput(s_b, s_b, s_b, s_b, self._sharding(("batch",), (num_slots,)))

  def _sharding(self, axes, shape) -> NamedSharding:
    return NamedSharding(self._mesh, shd.logical_to_spec(axes, self._rules, self._mesh, shape))

  def _state_shapes(self) -> DecodeState:
    cfg, b = self.model_cfg, self._slots
    pool = jax.ShapeDtypeStruct((cfg.num_layers, self.num_pages, self.page_size,
                                 cfg.num_kv_heads, cfg.head_dim), self.kv_dtype)
    raw_key = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))

    def vec(dtype):
      return jax.ShapeDtypeStruct((b,), dtype)

    return DecodeState(
        pool, pool, jax.ShapeDtypeStruct((b, self.pages_per_seq), jnp.int32),
        vec(jnp.int32), vec(jnp.int32), vec(jnp.bool_), vec(jnp.int32), vec(jnp.int32),
        vec(jnp.bool_), jax.ShapeDtypeStruct((b,) + raw_key.shape, raw_key.dtype),
        vec(jnp.float32), vec(jnp.int32), vec(jnp.float32))

  def _state_shardings(self) -> DecodeState:
    shapes = self._state_shapes()
    return DecodeState(*[
        self._sharding(_POOL_AXES if x.ndim == 5 else ("batch",) + (None,) * (x.ndim - 1),
                       x.shape) for x in shapes])

  def _zero_state(self) -> DecodeState:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._state_shapes())

  def load_params(self, params: Any = None, *, rng: jax.Array | None = None) -> Any:
    """`params` cast to the sampler dtype and placed with the sampler shardings (no copy
    when already there); random weights from `rng` when params is None."""
    if params is None:
      return self._init_params(jax.random.key(0) if rng is None else rng)
    return jax.tree.map(lambda x, s: jax.device_put(x.astype(self.kv_dtype), s), params,
                        self.param_shardings)

  def init_decode_state(self) -> DecodeState:
    return self._init_state()

  def pad_tokens(self, tokens) -> tuple[np.ndarray, int]:
    """(tokens right-padded with pad_id to the smallest bucket that fits, true length)."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    n = tokens.shape[0]
    if not 1 <= n <= self._max_prefill_length:
      raise ValueError(f"prompt has {n} tokens; sampler.max_prefill_length allows 1.."
                       f"{self._max_prefill_length}")
    bucket = next(b for b in self.prefill_buckets if b >= n)
    padded = np.full((bucket,), self.model_cfg.pad_id, np.int32)
    padded[:n] = tokens
    return padded, n

  def prefill(self, *, params: Any, existing_prefix: Prefix | None = None,
              padded_tokens, true_length: int) -> Prefix:
    """Dense K/V of one padded prompt (batch 1)."""
    if existing_prefix is not None:
      raise ValueError("prefill on top of an existing prefix is not supported: rl_jax "
                       "prefills whole prompts and shares their pages instead")
    if not 1 <= int(true_length) <= min(len(padded_tokens), self._max_prefill_length):
      raise ValueError(f"true_length {true_length} outside 1..{len(padded_tokens)}")
    if not isinstance(padded_tokens, jax.Array):
      padded_tokens = np.asarray(padded_tokens, np.int32)
    return self._prefill(params, padded_tokens.astype(jnp.int32), np.int32(true_length))

  def write_prefix(self, prefix: Prefix, decode_state: DecodeState, *, pages) -> DecodeState:
    """Write a prefix's cached positions into `pages` (one id per page of prompt)."""
    return self._write_prefix(decode_state, prefix, pt.page_table_row(pages, self.pages_per_seq))

  def insert_many(self, decode_state: DecodeState, entries: Sequence[dict]) -> DecodeState:
    """Start several sequences in one call.

    Each entry: slot, pages (the sequence's page table), token (last prompt token),
    length (cached prompt tokens), max_new_tokens, stop_on_eos, seed, sample_index,
    sampling (Sampling), and optionally copy=(src_page, dst_page).
    """
    if len(entries) > self._slots:
      raise ValueError(f"{len(entries)} inserts for {self._slots} slots")
    n, b, m = len(entries), self._slots, self.pages_per_seq

    def col(key, fill, dtype, fn=lambda x: x):
      out = np.full((b,), fill, dtype)
      out[:n] = [fn(e[key]) for e in entries]
      return out

    table_im = np.full((b, m), pt.NULL_PAGE, np.int32)
    for i, e in enumerate(entries):
      table_im[i] = pt.page_table_row(e["pages"], m)
    copies = [e.get("copy") or (pt.NULL_PAGE, pt.NULL_PAGE) for e in entries]
    copy_src = np.full((b,), pt.NULL_PAGE, np.int32)
    copy_dst = np.full((b,), pt.NULL_PAGE, np.int32)
    copy_src[:n] = [c[0] for c in copies]
    copy_dst[:n] = [c[1] for c in copies]
    ins = InsertBatch(
        slot_i=col("slot", b, np.int32), page_table_im=table_im,
        copy_src_i=copy_src, copy_dst_i=copy_dst,
        token_i=col("token", 0, np.int32), length_i=col("length", 0, np.int32),
        max_new_i=col("max_new_tokens", 0, np.int32),
        stop_on_eos_i=col("stop_on_eos", False, np.bool_),
        seed_i=col("seed", 0, np.int32, lambda s: np.int64(s) % (2 ** 31)),
        sample_index_i=col("sample_index", 0, np.int32),
        temperature_i=col("sampling", 0.0, np.float32, lambda s: s.temperature),
        top_k_i=col("sampling", 0, np.int32, lambda s: s.top_k),
        top_p_i=col("sampling", 1.0, np.float32, lambda s: s.top_p))
    return self._insert(decode_state, ins)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *, pages,
             sampling: Sampling = Sampling(), seed: int = 0, sample_index: int = 0,
             max_new_tokens: int | None = None, stop_on_eos: bool = True) -> DecodeState:
    """JetStream insert: write `prefix` into the slot's own `pages` and start decoding.

    `pages` must cover the whole sequence the slot may reach (prompt + new tokens).
    """
    decode_state = self.write_prefix(prefix, decode_state, pages=pages)
    return self.insert_many(decode_state, [dict(
        slot=slot, pages=pages, token=int(prefix.last_token),
        length=int(prefix.true_length) - 1,
        max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
        stop_on_eos=stop_on_eos, seed=seed, sample_index=sample_index, sampling=sampling)])

  def generate(self, params: Any, decode_state: DecodeState, *,
               num_slots: int | None = None) -> tuple[DecodeState, StepOutput]:
    """steps_per_call decode steps in one call, over all slots or over the first
    `num_slots` (one of slot_buckets; StepOutput then has num_slots columns)."""
    k = self._slots if num_slots is None else int(num_slots)
    if k not in self._generate:
      raise ValueError(f"num_slots must be one of {self.slot_buckets}, got {num_slots}")
    return self._generate[k](params, decode_state)

  def move_slots(self, decode_state: DecodeState, src, dst) -> DecodeState:
    """Move the sequences in slots `src` to the idle slots `dst` (their pages stay)."""
    src, dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
    if src.shape != dst.shape or set(src.tolist()) & set(dst.tolist()):
      raise ValueError(f"move_slots needs disjoint src/dst of one length, got {src}, {dst}")
    return self._move(decode_state, self._pad_slots(src), self._pad_slots(dst))

  def _pad_slots(self, slots) -> np.ndarray:
    out = np.full((self._slots,), self._slots, np.int32)
    slots = np.asarray(slots, np.int32).reshape(-1)
    out[:slots.shape[0]] = slots
    return out

  def free_slots(self, decode_state: DecodeState, slots) -> DecodeState:
    """Stop decoding in `slots` and point their page tables at the null page, so the
    host may hand their pages to other sequences."""
    return self._free(decode_state, self._pad_slots(slots))

  def free_resource(self, decode_state: DecodeState, slot: int) -> DecodeState:
    return self.free_slots(decode_state, [slot])

  def set_page_rows(self, decode_state: DecodeState, slots, pages_per_slot) -> DecodeState:
    """Replace the page tables of `slots` (e.g. after growing a sequence)."""
    rows = np.full((self._slots, self.pages_per_seq), pt.NULL_PAGE, np.int32)
    for i, pages in enumerate(pages_per_slot):
      rows[i] = pt.page_table_row(pages, self.pages_per_seq)
    return self._set_rows(decode_state, self._pad_slots(slots), rows)

  @property
  def max_concurrent_decodes(self) -> int:
    return self._slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill_length

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  def get_tokenizer(self) -> Any:
    return self.tokenizer

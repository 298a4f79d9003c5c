"""Paged-KV decode engine for the rl_jax transformer, shaped like JetStream's Engine API.

Shape letters:
  b decode slots, t prefill positions (a length bucket), s decode steps per call,
  l layers, n pages in the pool, p tokens per page, k kv heads, h query heads,
  d head_dim, v vocab, m pages per sequence (page-table width), r words of a raw
  PRNG key.

Device state (`DecodeState`, decode.py) is one pytree: the K/V page pools (per layer
[k, n, p, d], see decode.py for the layer modes), a page table per slot, and per-slot
decode registers (current token, cache length, sampling settings, PRNG key). Every
operation is a jitted function with explicit in/out shardings on the sampler mesh that
donates the state, so the pools are updated in place.

The cache of a slot holds `lengths_b` tokens; `tokens_b` is the token at position
`lengths_b` whose K/V is not yet written. A decode step writes that token's K/V into
its page, attends over the slot's pages, samples the next token and advances. So
`prefill` caches all prompt tokens but the last, and the last prompt token is fed to
the first decode step, which returns the first completion token (JetStream 0.2.2
semantics: the first token comes from the first generate).

Sampling (per slot, on device; sampling.py): temperature <= 0 is greedy, otherwise
temperature, top-k, top-p, then a Gumbel-max draw keyed by
fold_in(fold_in(key(seed), sample_index), position), so a request's tokens do not depend
on its slot or batch. The log-prob is the sampled token's under the distribution sampled
from; greedy slots report the model's temperature-1 log-prob of the argmax token.
Truncation is a program variant: the top-k pass runs only once this engine has
inserted a request that truncates (decided on the host, no conditional in the step).

Page ownership is host-side (page_table.py); the engine only follows page tables. Page
`NULL_PAGE` absorbs the writes of idle slots. A sequence that may sample n tokens after
c cached prompt tokens needs pages for c + n positions (every decode input is cached).

Programs: generate compiles per (slot bucket, page-width bucket, truncation) triple
(Engine.__init__), and the fused apply_and_generate likewise, without a prefill lane
and with each lane size the passes use (prefill_lane.sizes). Slot and page-width
buckets are 2^i and 1.5 x 2^i (at most 1/3 padding). Where they compile (first call,
background, or only the covering programs ahead): programs.py.
`sampler.dtype` "auto" is bfloat16 on GPU/TPU and float32 on CPU.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.model.presets import resolve_dtype  # the one dtype-auto rule (re-exported)
from rl_jax.sampler import decode, extend, lora_merge
from rl_jax.sampler import page_table as pt
from rl_jax.sampler import prefill as prefill_lib
from rl_jax.sampler import prefill_lane as prefill_lane_lib
from rl_jax.sampler import programs as programs_lib
from rl_jax.sampler.prefill import Prefix
from rl_jax.sampler import updates
from rl_jax.sampler.decode import (FINISH_LENGTH, FINISH_NONE, FINISH_STOP,  # noqa: F401
                                   DecodeState, StepOutput)  # (re-exported)
from rl_jax.sampler.sampling import Sampling, sample_tokens  # noqa: F401  (re-exported)

_LAYER_POOL_AXES = ("kv_heads", "pages", "page_slot", "head_dim")
_PREFIX_AXES = ("layers", "kv_heads", "length", "head_dim")


# sampler.steps_per_call "auto": 8 on accelerators, where one call per token would pay a
# host round trip per decode step; CPU_STEPS_PER_CALL on CPU, where the host and the
# "device" share the cores (measured with launch/bench.py sampler --peer, notes/PERFORMANCE.md).
ACCELERATOR_STEPS_PER_CALL = 8
CPU_STEPS_PER_CALL = 4


def resolve_steps_per_call(value: int | str, backend: str | None = None) -> int:
  """Decode steps per generate call: "auto" is ACCELERATOR_STEPS_PER_CALL on GPU and
  TPU and CPU_STEPS_PER_CALL on CPU; an integer is returned as is."""
  if value != "auto":
    return int(value)
  cpu = (backend or jax.default_backend()) == "cpu"
  return CPU_STEPS_PER_CALL if cpu else ACCELERATOR_STEPS_PER_CALL


def _buckets(largest: int) -> tuple[int, ...]:
  """2^i and 3 x 2^i (1.5 x 2^(i+1)) below `largest`, then `largest`: a bucket pads at
  most a third of its size."""
  return tuple(sorted({b for i in range(31) for b in (2 ** i, 3 * 2 ** i) if b < largest} |
                      {largest}))


class Engine:
  """Paged decode engine: JetStream's Engine methods plus rl_jax's page/log-prob extras.

  JetStream-shaped: load_params, init_decode_state, prefill, insert, generate,
  free_resource, max_concurrent_decodes, samples_per_slot, max_prefill_length, mesh,
  get_tokenizer. rl_jax extras used by the Generator: write_prefix (one prefill shared
  by many slots), prefill_into_pages (many prompts prefilled and written in one call),
  insert_many (start many sequences in one call, with copy-on-write of
  a partial page), set_page_rows (grow page tables), free_slots, move_slots (one
  program for all four: updates.apply), generate(num_slots=k, num_pages=w, live=...)
  (decode only the first k slots when few are busy, reading only the pages they use),
  apply_and_generate (prompts in a prefill lane of up to `prefill_lane` tokens, default
  twice max_prefill_length, in one of lane_sizes; then updates staged in an
  updates.Pending, then generate: the Generator's one dispatch per pass), pad_tokens,
  set_base (a LoRA policy's frozen base, after which load_params merges adapters).
  Every device method is jitted once per input shape (prefill once per length bucket,
  generate once per (slot bucket, page-width bucket, truncation) it is called with, and
  apply_and_generate once per such key without the lane and once per lane size used).
  """

  def __init__(self, model_cfg: model.ModelConfig, *, mesh: Mesh,
               max_concurrent_decodes: int, page_size: int, num_pages: int,
               max_prefill_length: int, max_new_tokens: int, dtype: str = "auto",
               steps_per_call: int = 1, stop_ids: Sequence[int] | None = None,
               tokenizer: Any = None, rules: shd.Rules = shd.SAMPLE_RULES,
               layers: str = "auto", attention: str = "auto", prefill_lane: int | None = None):
    if mesh.shape.get("fsdp", 1) != 1:
      raise ValueError("the sampler mesh must have fsdp=1")
    for name, value in (("max_concurrent_decodes", max_concurrent_decodes),
                        ("page_size", page_size), ("max_prefill_length", max_prefill_length),
                        ("max_new_tokens", max_new_tokens), ("steps_per_call", steps_per_call)):
      if value < 1:
        raise ValueError(f"sampler.{name} must be >= 1, got {value}")
    dtype = resolve_dtype(dtype)
    self.model_cfg = model_cfg.replace(dtype=dtype, param_dtype=dtype)
    self.layers = decode.resolve_layers(layers)
    self.attention = decode.resolve_attention(attention)
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
    # Prompt tokens the fused generate call can prefill (prefill_lane.py).
    self.prefill_lane = int(prefill_lane_lib.default_tokens(self._max_prefill_length)
                            if prefill_lane is None else prefill_lane)
    self.lane_sizes = prefill_lane_lib.sizes(self.prefill_lane)
    self.max_seq_len = self._max_prefill_length + self.max_new_tokens
    self.pages_per_seq = pt.pages_for(self.max_seq_len, self.page_size)
    self.kv_dtype = jnp.dtype(dtype)
    # JetStream's own padding uses power-of-two buckets from 16, capped at the maximum.
    self.prefill_buckets = tuple(sorted(
        {b for b in (2 ** i for i in range(4, 20)) if b < self._max_prefill_length} |
        {self._max_prefill_length}))
    # generate runs over the first k slots and the first w page-table columns only.
    self.slot_buckets = _buckets(self._slots)
    self.page_buckets = _buckets(self.pages_per_seq)
    self.live_buckets = _buckets(self._slots * self.pages_per_seq)  # ragged attention
    # The truncating sampling variant, once any request has asked for top-k / top-p.
    self.truncate = False

    cfg = self.model_cfg
    param_shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    self.stacked_shardings = shd.tree_shardings(model.param_logical_axes(cfg), param_shapes,
                                              mesh, rules)
    self.param_shardings = self.stacked_shardings
    if self.layers == "unrolled":  # per-layer weights (_layout): the layer axis dropped
      layer = jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(*s.spec[1:])),
                           self.stacked_shardings["layers"])
      self.param_shardings = {**self.stacked_shardings,
                              "layers": (layer,) * cfg.num_layers}
    self.state_shardings = self._state_shardings()
    self.output_shardings = self._output_shardings(self._slots)
    prefix_sh = self._sharding(_PREFIX_AXES, (cfg.num_layers, cfg.num_kv_heads,
                                              self._max_prefill_length, cfg.head_dim))
    self.prefix_shardings = Prefix(prefix_sh, prefix_sh, shd.replicated(mesh),
                                   shd.replicated(mesh))
    self._generate: dict[tuple, Any] = {}  # (k, w, u, fused, truncate, lane) -> jitted
    self.merger: lora_merge.Merger | None = None  # a LoRA policy's base (set_base)
    self.programs: programs_lib.Programs | None = None  # compile_in_background
    self._build_programs()

  def compile_in_background(self, executor) -> None:
    """Compile new buckets on `executor` (None: inline at the first call, the default)
    while a compiled program covering a call serves it (programs.py; the program a
    call runs then depends on timing)."""
    self.programs = None if executor is None else programs_lib.Programs(executor)

  def compile_covers_only(self) -> None:
    """sampler.compile="ahead": every call on a covering program, no other bucket."""
    self.programs = programs_lib.Programs(None)

  def _build_programs(self) -> None:
    cfg, st, rep = self.model_cfg, self.state_shardings, shd.replicated(self._mesh)
    self._init_params = jax.jit(lambda rng: self._layout(model.init_params(cfg, rng)),
                                in_shardings=rep, out_shardings=self.param_shardings)
    self._unstack = jax.jit(decode.unstack_layers, in_shardings=(self.stacked_shardings,),
                            out_shardings=self.param_shardings)
    self._init_state = jax.jit(self._zero_state, in_shardings=(), out_shardings=st)
    self._init_registers = jax.jit(
        functools.partial(self._zero_state, pools=False), in_shardings=(),
        out_shardings=st._replace(k_pages=None, v_pages=None))
    self._prefill = jax.jit(
        functools.partial(prefill_lib.prefill, model_cfg=cfg, kv_dtype=self.kv_dtype),
        in_shardings=(self.param_shardings, rep, rep), out_shardings=self.prefix_shardings)
    self._write_prefix = jax.jit(
        functools.partial(prefill_lib.write_prefix, page_size=self.page_size),
        in_shardings=(st, self.prefix_shardings, rep), out_shardings=st, donate_argnums=(0,))
    self._prefill_pages = jax.jit(
        functools.partial(prefill_lib.prefill_into_pages, model_cfg=cfg, kv_dtype=self.kv_dtype,
                          page_size=self.page_size),
        in_shardings=(self.param_shardings, st, rep, rep, rep), out_shardings=st,
        donate_argnums=(1,))
    # Slot / page-table updates: alone (every slot may change) or fused into generate,
    # with or without a prefill lane of `prefill_lane` tokens (prefill_lane.py).
    self.update_layout = updates.Layout(self._slots, self._slots, self.pages_per_seq,
                                        self.num_pages, 0, self.page_size)
    self.fused_layout = self.update_layout._replace(rows=min(self._slots,
                                                             max(8, self._slots // 4)))
    self._apply = jax.jit(functools.partial(updates.apply, layout=self.update_layout),
                          in_shardings=(st, rep), out_shardings=st, donate_argnums=(0,))

  def generate_program(self, num_slots: int, num_pages: int, num_live: int = 0,
                       fused: int = 0, truncate: bool | None = None,
                       lane: int | None = None):
    """The jitted generate over slots [0, num_slots) and page columns [0, num_pages);
    with "ragged" attention, over num_live (slot, column) pairs (one of live_buckets).
    fused 1: updates.apply_and_generate (a packed update applied first, outputs packed),
    2: the same with a prefill lane of `lane` tokens (one of lane_sizes; None: the
    largest). truncate: the sampling variant (None: the engine's current `truncate`)."""
    truncate = self.truncate if truncate is None else bool(truncate)
    lane = (self.prefill_lane if lane is None else int(lane)) if fused == 2 else 0
    if lane and lane not in self.lane_sizes:
      raise ValueError(f"lane must be one of {self.lane_sizes}, got {lane}")
    key = (int(num_slots), int(num_pages), int(num_live), int(fused), truncate, lane)
    ragged = self.attention == "ragged"
    if (key[0] not in self.slot_buckets or key[1] not in self.page_buckets or
        (key[2] not in self.live_buckets if ragged else key[2])):
      raise ValueError(f"num_slots must be one of {self.slot_buckets} and num_pages one "
                       f"of {self.page_buckets}, got {num_slots}, {num_pages} ({num_live} "
                       f"live pages, attention {self.attention})")
    if key not in self._generate:
      rep = shd.replicated(self._mesh)
      kw = dict(num_slots=key[0], num_pages=key[1], steps=self.steps_per_call,
                model_cfg=self.model_cfg, stop_ids=self.stop_ids, layers=self.layers,
                attention=self.attention, truncate=truncate)
      if fused:
        layout = self.fused_layout._replace(lane=lane)
        fn = functools.partial(updates.apply_and_generate, layout=layout, **kw)
        args, out = (self.param_shardings, self.state_shardings, rep), rep
      else:
        fn = functools.partial(decode.generate, **kw)
        args, out = (self.param_shardings, self.state_shardings), self._output_shardings(key[0])
      self._generate[key] = jax.jit(
          fn, in_shardings=args + ((rep,) if ragged else ()),
          out_shardings=(self.state_shardings, out), donate_argnums=(1,))
    return self._generate[key]

  def page_bucket(self, max_positions: int) -> int:
    """The smallest page-width bucket whose pages hold `max_positions` positions."""
    need = pt.pages_for(max(int(max_positions), 1), self.page_size)
    return next((w for w in self.page_buckets if w >= need), self.pages_per_seq)

  @classmethod
  def from_config(cls, sampler_cfg, model_cfg: model.ModelConfig, *, mesh: Mesh,
                  tokenizer: Any = None) -> Engine:
    """An engine from the `sampler` config section; num_pages 0 derives the pool size
    from kv_cache_bytes (per sampler replica)."""
    dtype = resolve_dtype(sampler_cfg.dtype)
    num_pages = int(sampler_cfg.num_pages) or pt.num_pages_for_budget(
        kv_cache_bytes=int(sampler_cfg.kv_cache_bytes), num_layers=model_cfg.num_layers,
        num_kv_heads=model_cfg.num_kv_heads, head_dim=model_cfg.head_dim,
        page_size=int(sampler_cfg.page_size), dtype_bytes=jnp.dtype(dtype).itemsize)
    return cls(model_cfg, mesh=mesh,
               max_concurrent_decodes=int(sampler_cfg.max_concurrent_decodes),
               page_size=int(sampler_cfg.page_size), num_pages=num_pages,
               max_prefill_length=int(sampler_cfg.max_prefill_length),
               max_new_tokens=int(sampler_cfg.max_new_tokens), dtype=dtype,
               steps_per_call=resolve_steps_per_call(sampler_cfg.steps_per_call),
               tokenizer=tokenizer,
               layers=sampler_cfg.get("layers", "auto"),
               attention=sampler_cfg.get("attention", "auto"))

  def _output_shardings(self, num_slots: int) -> StepOutput:
    s_b = self._sharding((None, "batch"), (self.steps_per_call, num_slots))
    return StepOutput(s_b, s_b, s_b, s_b, self._sharding(("batch",), (num_slots,)))

  def _sharding(self, axes, shape) -> NamedSharding:
    return NamedSharding(self._mesh, shd.logical_to_spec(axes, self._rules, self._mesh, shape))

  def _state_shapes(self) -> DecodeState:
    cfg, b = self.model_cfg, self._slots
    layer_pool = (cfg.num_kv_heads, self.num_pages, self.page_size, cfg.head_dim)
    pool_dtype = decode.pool_dtype(self.kv_dtype)
    if self.layers == "unrolled":
      pool = tuple(jax.ShapeDtypeStruct(layer_pool, pool_dtype) for _ in range(cfg.num_layers))
    else:
      pool = jax.ShapeDtypeStruct((cfg.num_layers,) + layer_pool, pool_dtype)
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

    def pool_sharding(x):
      axes = _LAYER_POOL_AXES if x.ndim == 4 else ("layers",) + _LAYER_POOL_AXES
      return self._sharding(axes, x.shape)

    return shapes._replace(
        k_pages=jax.tree.map(pool_sharding, shapes.k_pages),
        v_pages=jax.tree.map(pool_sharding, shapes.v_pages),
        **{f: self._sharding(("batch",) + (None,) * (getattr(shapes, f).ndim - 1),
                             getattr(shapes, f).shape) for f in decode.SLOT_FIELDS})

  def _zero_state(self, pools: bool = True) -> DecodeState:
    shapes = self._state_shapes()
    if not pools:
      shapes = shapes._replace(k_pages=None, v_pages=None)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def _layout(self, params):
    """params in the sampler's layer layout: per-layer weights with unrolled layers
    (decode.layer_params: no slice copy per step), stacked with scanned layers."""
    return decode.unstack_layers(params) if self.layers == "unrolled" else params

  def load_params(self, params: Any = None, *, rng: jax.Array | None = None,
                  reuse: Any = None, after: Any = None) -> Any:
    """`params` (stacked layers, as the model and trainer hold them, or already in the
    sampler layout) cast to the sampler dtype, placed with the sampler shardings (no
    copy when already there) and in the sampler's layer layout (`_layout`: one copy of
    the layer weights when it unstacks); random weights from `rng` when params is None.
    A LoRA adapter tree (after set_base) is merged into the base (lora_merge.py), in place
    of `reuse` (decode weights of an earlier merge nobody reads again) once `after` is
    ready."""
    if self.merges(params):
      return self.merger.merge(params, reuse=reuse, after=after)
    if params is None:
      return self._init_params(jax.random.key(0) if rng is None else rng)
    stacked = self.layers == "unrolled" and not isinstance(params["layers"], (tuple, list))
    placed = jax.tree.map(lambda x, s: jax.device_put(x.astype(self.kv_dtype), s), params,
                          self.stacked_shardings if stacked else self.param_shardings)
    return self._unstack(placed) if stacked else placed

  def set_base(self, base_params: Any) -> None:
    """The frozen base of a LoRA policy (stacked layers, any placement), once: copied in
    the sampler dtype and decode layout onto the sampler devices (never aliasing the
    caller's buffers). From then on load_params merges adapter trees into it."""
    if self.merger is not None:
      raise ValueError("the sampler's LoRA base is set once per engine")
    if lora_merge.is_adapters(base_params):
      raise ValueError("set_base takes the base model's params, got an adapter tree")
    unrolled = self.layers == "unrolled"  # (unstacking copies anyway)
    placed = jax.device_put(jax.tree.map(lambda x: x.astype(self.kv_dtype), base_params),
                            self.stacked_shardings, may_alias=None if unrolled else False)
    base = self._unstack(placed) if unrolled else placed
    self.merger = lora_merge.Merger(self.model_cfg, base, self.param_shardings,
                                    mesh=self._mesh, rules=self._rules)

  def merges(self, params: Any) -> bool:
    """Whether load_params(params) merges an adapter tree (a LoRA policy's publication)."""
    if not lora_merge.is_adapters(params):
      return False
    if self.merger is None:
      raise ValueError("LoRA adapters reached the sampler before its base: call "
                       "Engine.set_base(base_params) first")
    return True

  def sampler_params(self, params: Any) -> Any:
    """params as the device programs take them: load_params when they still hold
    stacked layers (unrolled layers only; e.g. model.init_params output), else as is."""
    if self.layers == "unrolled" and not isinstance(params["layers"], (tuple, list)):
      return self.load_params(params)
    return params

  def init_decode_state(self, *, pools: bool = True) -> DecodeState:
    """A zeroed state; with pools=False its k_pages / v_pages are None (registers only:
    a Generator that borrows another's pools, Generator.lend_pool)."""
    return self._init_state() if pools else self._init_registers()

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
    """Dense K/V of one padded prompt (batch 1), after `existing_prefix` if given (extend.py)."""
    params = self.sampler_params(params)
    if existing_prefix is not None:
      return extend.Extender.of(self).prefill(params, existing_prefix, padded_tokens,
                                              true_length)
    if not 1 <= int(true_length) <= min(len(padded_tokens), self._max_prefill_length):
      raise ValueError(f"true_length {true_length} outside 1..{len(padded_tokens)}")
    if not isinstance(padded_tokens, jax.Array):
      padded_tokens = np.asarray(padded_tokens, np.int32)
    return self._prefill(params, padded_tokens.astype(jnp.int32), np.int32(true_length))

  def write_prefix(self, prefix: Prefix, decode_state: DecodeState, *, pages) -> DecodeState:
    """Write a prefix's cached positions into `pages` (one id per page of prompt)."""
    return self._write_prefix(decode_state, prefix, pt.page_table_row(pages, self.pages_per_seq))

  def prefill_into_pages(self, params: Any, decode_state: DecodeState, prompts: Sequence,
                         pages: Sequence) -> DecodeState:
    """Prefill several prompts in one call and write each one's cached positions (all
    but its last token) into its `pages`. The batch is padded to a power of two and
    the prompts to the longest one's length bucket: one program per pair of buckets."""
    if not prompts or len(prompts) != len(pages):
      raise ValueError(f"need one page list per prompt, got {len(prompts)} and {len(pages)}")
    padded = [self.pad_tokens(p) for p in prompts]
    t = max(len(x) for x, _ in padded)
    n = 1 << (len(padded) - 1).bit_length()
    params = self.sampler_params(params)
    args = (params, decode_state) + self.prefill_arrays(padded, pages, n, t)
    if self.programs is None:
      return self._prefill_pages(*args)
    return programs_lib.covered_prefill(self, args, padded, pages)

  @property
  def prefill_pages_program(self):
    """The jitted batched prefill (programs.py compiles its buckets ahead)."""
    return self._prefill_pages

  def prefill_arrays(self, padded, pages, n: int, t: int):
    """(tokens_nt, true_n, pages_nm) of padded prompts [(tokens, length)] and their pages,
    the batch padded to n prompts and the positions to t."""
    tokens_nt = np.full((n, t), self.model_cfg.pad_id, np.int32)
    true_n = np.ones((n,), np.int32)
    pages_nm = np.full((n, self.pages_per_seq), pt.NULL_PAGE, np.int32)
    for i, ((x, length), pg) in enumerate(zip(padded, pages)):
      tokens_nt[i, :len(x)] = x
      true_n[i] = length
      pages_nm[i] = pt.page_table_row(pg, self.pages_per_seq)
    return tokens_nt, true_n, pages_nm

  def insert_many(self, decode_state: DecodeState, entries: Sequence[dict]) -> DecodeState:
    """Start several sequences in one call.

    Each entry: slot, pages (the sequence's page table), token (last prompt token),
    length (cached prompt tokens), max_new_tokens, stop_on_eos, seed, sample_index,
    sampling (Sampling), and optionally copy=(src_page, dst_page).
    """
    if len(entries) > self._slots:
      raise ValueError(f"{len(entries)} inserts for {self._slots} slots")
    pending = updates.Pending(self._slots)
    for e in entries:
      pending.insert(e)
    return self.apply_updates(decode_state, pending)

  def apply_updates(self, decode_state: DecodeState, pending: updates.Pending) -> DecodeState:
    """Apply staged slot / page-table updates now, in one call."""
    self.truncate |= pending.truncates()
    return self._apply(decode_state, pending.pack(self.update_layout))

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
               num_slots: int | None = None, num_pages: int | None = None,
               live=None) -> tuple[DecodeState, StepOutput]:
    """steps_per_call decode steps in one call, over all slots or over the first
    `num_slots` (one of slot_buckets; StepOutput then has num_slots columns), reading
    all page-table columns or the first `num_pages` (one of page_buckets: every busy
    slot's positions this call must lie in those pages, see page_bucket). With
    attention "ragged", `live` = (slots, columns) lists the page-table cells busy slots
    read this call (all cells of the first num_slots rows when None)."""
    program, args = self._generate_call(num_slots, num_pages, live, fused=0)
    return program(self.sampler_params(params), decode_state, *args)

  def apply_and_generate(self, params: Any, decode_state: DecodeState,
                         pending: updates.Pending, **generate_kw) -> tuple[DecodeState, Any]:
    """The prompts staged in `pending` prefilled (its lane), its updates applied, then
    generate (same keywords): one dispatch when the updates fit fused_layout's rows,
    else the lane and the updates go first by calls of their own. Returns the new state
    and the outputs packed in one array, not waited for: updates.unpack_output(
    np.asarray(x), steps_per_call) gives the StepOutput. Clears `pending`."""
    self.truncate |= pending.truncates()
    lane = next(n for n in self.lane_sizes if n >= pending.lane_used) if pending.lane else 0
    layout = self.fused_layout._replace(lane=lane)
    if not pending.fits(layout):  # more inserts or rows than one fused call carries
      lane = pending.take_lane()
      if lane:  # the template pages first, as the fused program would
        decode_state = self.prefill_into_pages(params, decode_state, *zip(*lane))
      decode_state = self.apply_updates(decode_state, pending)
      pending.clear()
      layout = self.fused_layout
    params = self.sampler_params(params)
    if self.programs is not None and self.attention != "ragged":
      return programs_lib.covered_generate(self, params, decode_state, pending, layout,
                                           **generate_kw)
    program, args = self._generate_call(fused=1 + bool(layout.lane), lane=layout.lane,
                                        **generate_kw)
    upd_v = pending.pack(layout)
    pending.clear()
    return program(params, decode_state, upd_v, *args)

  def _generate_call(self, num_slots=None, num_pages=None, live=None, *, fused, lane=None):
    k = self._slots if num_slots is None else int(num_slots)
    w = self.pages_per_seq if num_pages is None else int(num_pages)
    if self.attention != "ragged":
      return self.generate_program(k, w, fused=fused, lane=lane), ()
    if live is None:  # every column of every slot
      live = (np.repeat(np.arange(k), w), np.tile(np.arange(w), k))
    w = self.pages_per_seq  # only the KV writes read the table: one width
    slot_u, col_u = (np.asarray(x, np.int32).reshape(-1) for x in live)
    u = next(n for n in self.live_buckets if n >= max(slot_u.shape[0], 1))
    pad = u - slot_u.shape[0]
    slot_u = np.concatenate([slot_u, np.zeros((pad,), np.int32)])
    col_u = np.concatenate([col_u, np.full((pad,), -1, np.int32)])
    return self.generate_program(k, w, u, fused=fused, lane=lane), ((slot_u, col_u),)

  def move_slots(self, decode_state: DecodeState, src, dst) -> DecodeState:
    """Move the sequences in slots `src` to the idle slots `dst` (their pages stay)."""
    src, dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
    if src.shape != dst.shape or set(src.tolist()) & set(dst.tolist()):
      raise ValueError(f"move_slots needs disjoint src/dst of one length, got {src}, {dst}")
    pending = updates.Pending(self._slots)
    for s, d in zip(src.tolist(), dst.tolist()):
      pending.move(s, d)
    return self.apply_updates(decode_state, pending)

  def free_slots(self, decode_state: DecodeState, slots) -> DecodeState:
    """Stop decoding in `slots` and point their page tables at the null page, so the
    host may hand their pages to other sequences."""
    pending = updates.Pending(self._slots)
    for s in np.asarray(slots, np.int32).reshape(-1).tolist():
      pending.free(s)
    return self.apply_updates(decode_state, pending)

  def free_resource(self, decode_state: DecodeState, slot: int) -> DecodeState:
    return self.free_slots(decode_state, [slot])

  def set_page_rows(self, decode_state: DecodeState, slots, pages_per_slot) -> DecodeState:
    """Replace the page tables of `slots` (e.g. after growing a sequence)."""
    pending = updates.Pending(self._slots)
    for s, pages in zip(np.asarray(slots, np.int32).reshape(-1).tolist(), pages_per_slot):
      pending.set_rows(s, pages)
    return self.apply_updates(decode_state, pending)

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

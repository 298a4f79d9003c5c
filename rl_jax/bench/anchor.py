"""The plain-JAX anchor run in this process, at this run's shapes, so rl_jax / plain-JAX
ratios compare like with like on the same device.

The anchor is rl_jax/bench/reference.py (in the repository), or any script given with
`--anchor PATH` that keeps the same contract (e.g. an external gpu_anchor.py). An anchor
is a script: its shapes are module constants (V, D, L, H, KVH, HD, F,
BATCHES, CTX, PAGE, TRAIN_B, TRAIN_T; and STEPS, TIE, DTYPE where it defines them),
its BW / PEAK constants normalise its roofline
and MFU columns, and its last statement is a bare `main()` call that writes
`$OUT/anchor.json` when OUT is set. Loading it here drops that bare call, sets the
constants to the model preset and the suite's sizes (and BW / PEAK to this run's
probes), runs `main()` with OUT pointing at a temporary folder and reads the rows back.
"""
from __future__ import annotations

import ast
import contextlib
import json
import os
import tempfile
import types

import jax.numpy as jnp

REQUIRED = ("main", "V", "D", "L", "H", "KVH", "HD", "F", "BATCHES", "CTX", "PAGE",
            "TRAIN_B", "TRAIN_T", "BW", "PEAK")


REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference.py")


def find(explicit: str = "") -> str | None:
  """The anchor script: `explicit` (None if it is not a file), else the in-repo reference."""
  if explicit:
    return explicit if os.path.isfile(explicit) else None
  return REFERENCE


def load(path: str) -> types.ModuleType:
  """The script's definitions as a module, without running its top-level calls."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  tree.body = [node for node in tree.body
               if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call))]
  module = types.ModuleType("rl_jax_anchor")
  module.__file__ = path
  exec(compile(tree, path, "exec"), module.__dict__)  # noqa: S102  (a trusted repo script)
  missing = [name for name in REQUIRED if name not in module.__dict__]
  if missing:
    raise ValueError(f"{path} no longer defines {missing}; update rl_jax/bench/anchor.py")
  return module


@contextlib.contextmanager
def _env(name: str, value: str):
  old = os.environ.get(name)
  os.environ[name] = value
  try:
    yield
  finally:
    if old is None:
      del os.environ[name]
    else:
      os.environ[name] = old


def configure(module, model_cfg, sizes, *, dtype: str | None = None,
              copy_gbps: float | None = None, peak_tflops: float | None = None) -> None:
  """Sets an anchor module's constants to the model preset and the suite's sizes; the
  optional ones (STEPS: rl_jax's steps per call, TIE, DTYPE) only where it defines them."""
  c = model_cfg
  shapes = dict(V=c.vocab_size, D=c.hidden_size, L=c.num_layers, H=c.num_heads,
                KVH=c.num_kv_heads, HD=c.head_dim, F=c.intermediate_size,
                BATCHES=list(sizes.decode_batches), CTX=sizes.ctx, PAGE=sizes.page_size,
                TRAIN_B=sizes.train_batch, TRAIN_T=sizes.train_seq)
  optional = dict(STEPS=sizes.steps_per_call, TIE=c.tie_embeddings)
  if dtype:
    optional["DTYPE"] = jnp.dtype(dtype).type
  shapes.update({k: v for k, v in optional.items() if k in module.__dict__})
  if copy_gbps:
    shapes["BW"] = copy_gbps * 1e9
  if peak_tflops:
    shapes["PEAK"] = peak_tflops * 1e12
  for name, value in shapes.items():
    setattr(module, name, value)


def run(path: str, model_cfg, sizes, *, dtype: str | None = None, copy_gbps: float | None,
        peak_tflops: float | None) -> dict:
  """{"path", "nparam", "rows"} from the anchor's main() at this run's shapes."""
  module = load(path)
  configure(module, model_cfg, sizes, dtype=dtype, copy_gbps=copy_gbps,
            peak_tflops=peak_tflops)
  with tempfile.TemporaryDirectory() as out, _env("OUT", out):
    module.main()
    with open(os.path.join(out, "anchor.json")) as f:
      result = json.load(f)
  return dict(path=path, nparam=result["nparam"], rows=result["rows"],
              bw_gbps=module.BW / 1e9, peak_tflops=module.PEAK / 1e12)


# The anchor's train-step row: reference.py's, gpu_anchor.py's, or the first anchor's.
TRAIN_KINDS = ("train-step-bf16", "train-step-bf16-cudnn-attn", "train-step-fp32-params")


def train_row(anchor: dict) -> dict | None:
  """The anchor's train-step row, whichever version of the anchor wrote it."""
  rows = [r for kind in TRAIN_KINDS for r in anchor.get("rows", []) if r["kind"] == kind]
  return rows[0] if rows else None


def ratios(anchor: dict, results: dict) -> dict:
  """rl_jax / plain JAX, per comparable row (> 1: rl_jax is faster)."""
  out = {}
  by_kind = {}
  for row in anchor["rows"]:
    by_kind.setdefault(row["kind"], {})[row.get("B")] = row
  for row in results.get("decode", []):
    for kind, name in (("decode-dense", "dense"), ("decode-paged-gather", "paged")):
      ref = by_kind.get(kind, {}).get(row["batch"])
      if ref:
        out[f"decode_b{row['batch']}_over_{name}"] = row["tokens_per_s"] / ref["tok_s"]
  train = results.get("train")
  ref = train_row(anchor)
  if train and ref:
    out["train_over_anchor"] = train["tokens_per_s"] / ref["tok_s"]
  sync = results.get("sync")
  ref = next(iter(by_kind.get("param-copy-d2d", {}).values()), None)
  if sync and ref:
    out["sync_over_param_copy"] = sync["effective_gbps"] / ref["GBps"]
  return out

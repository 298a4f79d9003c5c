"""The benchmark suite (rl_jax.bench) at tiny sizes: result keys and sane values, the
anchor loader, the e2e config, AOT memory without allocation, and the benchmark import
path with grain / ml_collections / TensorFlow / JetStream unavailable."""
import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap

from rl_jax import config as config_lib
from rl_jax import model
from rl_jax.bench import anchor, aot, e2e, measure, options, suite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(*argv):
  p = argparse.ArgumentParser()
  options.add_suite_args(p)
  return p.parse_args(list(argv))


def _skip_all_but(*keep):
  return ",".join(s for s in options.SECTIONS if s not in keep)


def test_suite_small_sections(tmp_path, capsys):
  out = tmp_path / "bench.json"
  # A 2 MiB copy stays in CPU caches like the tiny model's weights, so the fractions
  # compare like with like.
  args = _args("--preset", "tiny_char", "--small", "--decode-batches", "4", "--copy-mib", "2",
               "--ctx", "32", "--page-size", "8", "--steps-per-call", "2", "--decode-calls", "2",
               "--train-batch", "2", "--train-seq", "32",
               "--skip", _skip_all_but("probes", "decode", "decode_tail", "sync", "anchor"),
               "--out", str(out))
  assert suite.main(args) == 0
  res = json.loads(out.read_text())
  assert res["errors"] == {}
  assert set(res["skipped"]) == {"cost", "aot", "prefill", "train", "e2e"}
  assert res["probes"]["copy_gbps"] > 0 and res["probes"]["matmul_tflops"] > 0
  gather, ragged = res["decode_tail"]
  assert gather["attention"] == "jnp" and ragged["attention"] == "ragged"
  assert gather["long_slots"] == 1 and 0 < gather["pages_read_frac"] < 1
  assert gather["pages_read_frac"] <= ragged["pages_read_frac"] <= 1
  (row,) = res["decode"]
  assert row["batch"] == 4 and row["tokens_per_s"] > 0
  assert 0 < row["roofline_frac"] and math.isfinite(row["roofline_frac"])  # timing: no bound
  assert row["bytes_per_step"] > row["weight_bytes"] > 0
  sync = res["sync"]
  assert sync["sampler_bytes"] * 2 == sync["master_bytes"]  # fp32 -> bf16
  assert sync["effective_gbps"] > 0 and sync["frac_of_copy"] > 0
  # The anchor is the in-repository plain-JAX reference: nothing outside the clone.
  assert res["anchor"]["path"] == anchor.REFERENCE
  ratios = res["anchor"]["ratios"]
  assert {"decode_b4_over_dense", "decode_b4_over_paged", "sync_over_param_copy"} <= set(ratios)
  assert all(r > 0 and math.isfinite(r) for r in ratios.values())
  printed = capsys.readouterr().out.rstrip().splitlines()
  assert printed[-1].startswith("section wall s:")  # the table comes last
  assert any(line.startswith("decode") and "roofline" in line for line in printed)


def test_trainer_defaults_match_base_config():
  from configs import base
  assert dict(base.get_config().trainer) == measure.TRAINER_DEFAULTS


def test_anchor_loader_runs_main_only_when_asked(tmp_path):
  script = tmp_path / "gpu_anchor.py"
  script.write_text(textwrap.dedent("""
      import json, os
      V, D, L, H, KVH, HD, F = 1, 1, 1, 1, 1, 1, 1
      BATCHES, CTX, PAGE, TRAIN_B, TRAIN_T = [1], 1, 1, 1, 1
      BW, PEAK = 1.0, 1.0
      def main():
          rows = [dict(kind="decode-dense", B=b, tok_s=10.0 * b, step_ms=1.0) for b in BATCHES]
          rows.append(dict(kind="shapes", V=V, CTX=CTX, BW=BW))
          with open(os.path.join(os.environ["OUT"], "anchor.json"), "w") as f:
              json.dump(dict(nparam=V * D, rows=rows), f)
      main()
      """))
  module = anchor.load(str(script))  # would raise KeyError on OUT if main() ran
  assert module.V == 1
  sizes = options.SMALL
  res = anchor.run(str(script), model.get_preset("tiny_char"), sizes, copy_gbps=2.0,
                   peak_tflops=None)
  shapes = res["rows"][-1]
  assert shapes["V"] == 128 and shapes["CTX"] == sizes.ctx and shapes["BW"] == 2e9
  assert res["peak_tflops"] == 1e-12  # not overridden without a probe
  ratios = anchor.ratios(res, {"decode": [dict(batch=4, tokens_per_s=80.0)]})
  assert ratios == {"decode_b4_over_dense": 2.0}


def test_e2e_config_is_valid():
  cfg = e2e.make_config(os.path.join(ROOT, "configs", "default.py"), preset="qwen2_0_5b",
                        dtype="bfloat16", sizes=options.FULL)
  config_lib.validate(cfg, num_devices=1)
  assert cfg.mesh.colocated and cfg.rl.total_steps == options.FULL.e2e_steps
  assert len(cfg.trainer.length_buckets) == 1


def test_aot_decode_memory_without_allocation(aot_default_emitters):
  sizes = options.SMALL
  out = aot.decode_program(model.get_preset("tiny_char"), measure.one_device_mesh(),
                           batch=4, sizes=sizes, dtype="float32", device_bytes=2 ** 30)
  assert out["construct_allocated_bytes"] == 0
  assert out["alias_bytes"] > 0  # the donated decode state is updated in place
  assert out["peak_bytes"] >= out["argument_bytes"] > 0


BLOCKER = textwrap.dedent("""
    import runpy, sys
    BLOCKED = {"grain", "ml_collections", "tensorflow", "jetstream"}
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked")
            return None
    sys.meta_path.insert(0, Block())
    sys.argv = ["launch/bench.py"] + sys.argv[1:]
    runpy.run_path("launch/bench.py", run_name="__main__")
    """)


def test_suite_runs_without_grain_ml_collections_tensorflow_jetstream(tmp_path):
  out = tmp_path / "bench.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
      "--xla_force_host_platform_device_count=8", "").strip()
  proc = subprocess.run(
      [sys.executable, "-c", BLOCKER, "suite", "--preset", "tiny_char", "--small",
       "--skip", _skip_all_but("sync", "e2e"), "--out", str(out)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  res = json.loads(out.read_text())
  assert res["errors"] == {}
  assert res["sync"]["ms_p50"] > 0  # the suite module (every section's imports) loaded
  assert "grain, ml_collections not installed" in res["skipped"]["e2e"]


def _tiny_reference(monkeypatch, **constants):
  """reference.py at its own tiny shapes in float32, constants overridden."""
  import jax.numpy as jnp
  from rl_jax.bench import reference as ref
  for name, value in dict(DTYPE=jnp.float32, **constants).items():
    monkeypatch.setattr(ref, name, value)
  return ref


def test_reference_decode_agrees_with_its_forward_pass(monkeypatch):
  """The plain-JAX reference is a real model: its greedy dense and paged decodes (KV
  caches written at each slot's own position, RoPE, GQA) produce the tokens that argmax
  of its full causal forward pass (dot_product_attention, no cache) gives, position by
  position, one step per call and STEPS steps per call alike."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  ref = _tiny_reference(monkeypatch, CTX=16, PAGE=4, STEPS=6, TIE=False)
  p = ref.init(jax.random.key(3), jnp.float32)
  p = dict(p, embed=p["embed"] * 4.0)  # distinct tokens give distinct argmaxes
  first, pos0 = jnp.array([5, 17], jnp.int32), jnp.array([0, 3], jnp.int32)
  nine = jnp.array([9, 9], jnp.int32)

  def prompted_cache(kind, one):
    """Slot 1 holds a prompt [9, 9, 9] (slot 0's position 0 is rewritten by its step)."""
    cache = ref.CACHES[kind][0](2, jnp.float32)
    for i in range(3):
      _, cache = one(p, nine, jnp.array([0, i], jnp.int32), cache)
    return cache
  seqs = []
  for kind in ref.KINDS:
    one = ref.decoder(kind, 1)
    tok, cache, out = first, prompted_cache(kind, one), [first]
    for s in range(ref.STEPS):
      tok, cache = one(p, tok, pos0 + s, cache)
      out.append(tok)
    seqs.append(np.stack([np.asarray(t) for t in out], 1))
    tok2, _ = ref.decoder(kind)(p, first, pos0, prompted_cache(kind, one))  # the fori_loop form
    np.testing.assert_array_equal(np.asarray(tok2), seqs[-1][:, -1])
  np.testing.assert_array_equal(seqs[0], seqs[1])
  forward = jax.jit(lambda p, t: ref.hidden(p, t) @ ref.head_weight(p))
  full = lambda t: np.argmax(np.asarray(forward(p, jnp.asarray(t))), -1)
  dense = seqs[0]
  np.testing.assert_array_equal(dense[0, 1:], full(dense[:1, :-1])[0])
  prompted = np.concatenate([[9, 9, 9], dense[1, :-1]])[None]
  np.testing.assert_array_equal(dense[1, 1:], full(prompted)[0, 3:])
  assert len(set(dense.ravel().tolist())) > 2  # not a constant sequence


def test_reference_train_step_is_the_policy_gradient_with_a_chunked_head(monkeypatch):
  """The reference's GRPO-shaped step: its gradient (seen in Adam's first moment, 0.1 g)
  is that of -sum(A * logp) / tokens, which r = exp(logp - sg(logp)) differentiates to,
  with logp from full [B, T, V] logits here and from a head chunked by 3 positions (so
  the last chunk is padded) in the step."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  ref = _tiny_reference(monkeypatch, HEAD_CHUNK=3)
  w = ref.init(jax.random.key(0), jnp.float32)
  tok = jnp.asarray(np.random.default_rng(1).integers(0, ref.V, (2, 8)), jnp.int32)
  adv = jnp.array([1.0, -0.5])

  def surrogate(w):  # -sum(A * logp) / tokens, written independently of train_step
    logits = ref.hidden(w, tok) @ w["embed"].T
    logp = jax.nn.log_softmax(logits[:, :-1])
    picked = jnp.take_along_axis(logp, tok[:, 1:, None], -1)[..., 0]
    return -jnp.sum(adv[:, None] * picked) / picked.size
  zeros = jax.tree.map(jnp.zeros_like, w)
  _, m, _, loss = jax.jit(ref.train_step)(w, zeros, zeros, tok, adv, jnp.ones((2, 8)))
  assert abs(float(loss) + float(jnp.sum(adv) * 7) / 14) < 1e-5  # r = 1: -sum(A * 7) / 14
  g = jax.jit(jax.grad(surrogate))(w)
  for a, mm in zip(jax.tree.leaves(g), jax.tree.leaves(m)):
    np.testing.assert_allclose(mm, 0.1 * np.asarray(a), rtol=1e-4, atol=1e-7)  # Adam's m


def test_cost_control_flow_and_bytes_of_trivial_programs(aot_default_emitters):
  """The HLO reading on programs whose cost is known by hand: y = x + 1 over 1024 f32
  reads 4 KiB and writes 4 KiB; a fori_loop of 7 trips is found with its trip count and
  carried state (s32 counter + the f32[1024]), and its body counted once."""
  import jax
  import jax.numpy as jnp
  from rl_jax.bench import cost
  x = jax.ShapeDtypeStruct((1024,), jnp.float32)
  add = cost.analyse(jax.jit(lambda x: x + 1).lower(x).compile())
  assert add["bytes"] == 2 * 4096 and add["flops"] == 1024 and add["control_flow"] == []

  def loop(x, n):
    return jax.lax.fori_loop(0, 7, lambda i, y: jnp.sin(y) * n, x)
  looped = cost.analyse(jax.jit(loop).lower(x, jax.ShapeDtypeStruct((), jnp.float32)).compile())
  (w,) = [c for c in looped["control_flow"] if c["op"] == "while"]
  assert w["trip_count"] == 7 and w["source"] == "loop"
  assert w["carried_bytes"] >= 4 + 4096
  assert 1024 <= looped["flops"] < 2 * 1024  # the body's 1024 multiplies once, not 7 times


def test_cost_section_small_against_independent_counts(aot_default_emitters):
  """The cost rows at tiny shapes: the floor is the weight count of an independently
  built parameter tree plus B x ctx x (2 L KVH HD 4) bytes, recomputed in NumPy; every
  ratio is the quotient of the rows' own bytes; the reference steps read at least the
  floor and the paged one moves more than the dense one (its gather); rl_jax's rows
  exist for every attention option this CPU can compile."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from rl_jax.bench import cost
  cfg = model.get_preset("tiny_char")
  sizes = dataclasses.replace(options.SMALL, decode_batches=(4,), ctx=32, page_size=8)
  rows = {r["program"]: r for r in cost.decode_rows(cfg, batch=4, sizes=sizes,
                                                     dtype="float32")}
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  weights = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) * 4
  kv = 4 * 32 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
  fl = rows["floor"]
  assert (fl["weight_bytes"], fl["kv_bytes"], fl["bytes"]) == (weights, kv, weights + kv)
  dense, paged = rows["reference dense"]["bytes"], rows["reference paged"]["bytes"]
  assert fl["bytes"] <= dense < paged
  for r in rows.values():
    if "bytes" in r:
      np.testing.assert_allclose([r["over_paged"], r["over_dense"], r["over_floor"]],
                                 [r["bytes"] / paged, r["bytes"] / dense, r["bytes"] / fl["bytes"]])
  assert rows["reference paged"]["over_paged"] == 1.0
  for name in ("rl_jax generate jnp", "rl_jax generate ragged", "rl_jax fused, no lane",
               "rl_jax fused + lane 32"):
    assert rows[name]["bytes"] > fl["bytes"] and rows[name]["flops"] > 0, name
  assert rows["rl_jax fused + lane 32"]["flops"] > rows["rl_jax fused, no lane"]["flops"]
  assert "error" in rows["rl_jax generate pallas_tpu"]  # a TPU kernel, off TPU
  table = cost.format_table(dict(dtype="float32", backend="cpu", train={},
                                 decode=[dict(r, preset="tiny_char") for r in rows.values()]))
  own = rows["rl_jax fused + lane 32"]["bytes"] - rows["rl_jax fused, no lane"]["bytes"]
  assert (f"lane 32: own bytes (with - without) {own / 1e9:,.4g} GB = "
          f"{own / (8 * rows['rl_jax generate jnp']['bytes']):.3f} x 8 steps") in table


def test_cost_train_rows_from_train_cost_or_a_skip_note(monkeypatch):
  """A missing module makes the train row a skip note naming it; otherwise the row is
  train_cost's dict and the table prints it."""
  import sys
  import types
  from rl_jax.bench import cost
  cfg = model.get_preset("tiny_char")
  monkeypatch.setitem(sys.modules, "rl_jax.bench.train_cost", None)
  assert cost.train_row(cfg, options.SMALL, dtype="bfloat16", remat="dots",
                        logprob_chunk=16) == dict(skipped="train rows need rl_jax.bench.train_cost")
  seen = {}

  def train_step_matmul(model_cfg, **kw):
    seen.update(kw, cfg=model_cfg)
    return dict(total_tflop=2.0, bf16_tflop=1.5, f32_operand_tflop=0.5, needed_tflop=1.6,
                ratio_to_needed=1.25, bf16_share=0.75)
  monkeypatch.setitem(sys.modules, "rl_jax.bench.train_cost",
                      types.SimpleNamespace(train_step_matmul=train_step_matmul))
  row = cost.train_row(cfg, options.SMALL, dtype="bfloat16", remat="dots", logprob_chunk=16)
  assert seen == dict(cfg=cfg, batch=options.SMALL.train_batch, seq=options.SMALL.train_seq,
                      dtype="bfloat16", remat="dots",
                      micro_batch=options.SMALL.train_micro_batch, logprob_chunk=16)
  table = cost.format_table(dict(dtype="float32", backend="cpu", decode=[],
                                 train={"tiny_char": row}))
  assert "total 2.00, both bf16 1.50 (75%), an f32 operand 0.50" in table


def test_cost_section_is_opt_in():
  assert options.sections_from_args(_args())["cost"] == "opt-in: --cost"
  assert options.sections_from_args(_args("--cost"))["cost"] == ""
  only = options.sections_from_args(_args("--cost-only"))
  assert [s for s, why in only.items() if not why] == ["cost"]
  assert only["decode"] == "--cost-only"

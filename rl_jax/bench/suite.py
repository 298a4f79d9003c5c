"""The benchmark suite: every section on one device in one process, JSON, then a table.

Sections run in options.SECTIONS order; each is skippable and one that fails records
its error and lets the others run (a lost accelerator session costs more than a
missing row). Fractions use this run's probes (copy bandwidth, bf16 matmul) and, with
the `_ref` suffix, the reference figures given by --ref-gbps / --peak-tflops.

Targets (notes/PERFORMANCE.md): decode >= 50% of the memory roofline at batch 256,
train MFU >= 35%, weight sync >= 50% of the copy bandwidth, and no plain-JAX anchor
figure faster than rl_jax's (every rl_jax / plain ratio >= 1).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import tempfile
import time
import traceback

import jax

import rl_jax
from rl_jax import model
from rl_jax.bench import anchor as anchor_lib
from rl_jax.bench import aot as aot_lib
from rl_jax.bench import cost as cost_lib
from rl_jax.bench import e2e as e2e_lib
from rl_jax.bench import measure
from rl_jax.bench import options

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(rl_jax.__file__)))
TARGETS = dict(decode_roofline_frac=0.5, train_mfu=0.35, sync_frac_of_copy=0.5,
               ratio_over_plain=1.0)


class Skip(Exception):
  """A section that cannot run here; the message says why (recorded, not an error)."""


def _compile_only_fns(args, sizes, model_cfg):
  """The sections that only compile: cost (its own presets) and aot."""
  def cost():
    cfgs = {p: model.get_preset(p).replace(attention=args.attention)
            for p in args.cost_presets.split(",") if p}
    return cost_lib.run(cfgs, sizes, dtype=args.cost_dtype, train_dtype=args.dtype,
                        remat=args.remat, logprob_chunk=args.logprob_chunk)

  def aot():
    return aot_lib.run(model_cfg, sizes, dtype=args.dtype, remat=args.remat,
                       device_gib=args.device_gib, logprob_chunk_len=args.logprob_chunk)
  return dict(cost=cost, aot=aot)


def _section_fns(args, sizes, model_cfg, res, sections):
  """name -> function filling res[name]; later sections read earlier results."""
  mesh = measure.one_device_mesh()
  probes = lambda: res.get("probes", {})
  shared = {}
  # decode, decode_tail and prefill share one set of sampler weights, freed after the last.
  last_weights_user = next(s for s in ("prefill", "decode_tail", "decode", "")
                           if s in sections or not s)

  def params(section):
    if "params" not in shared:
      shared["params"] = measure.sampler_params(model_cfg, mesh, args.dtype)
    weights = shared["params"]
    if section == last_weights_user:
      shared.clear()
    return weights

  def probe():
    return dict(measure.copy_bandwidth(nbytes=sizes.copy_mib * 2 ** 20, repeats=sizes.repeats),
                **measure.matmul_peak(n=sizes.matmul_n, repeats=sizes.repeats))

  def decode():
    weights = params("decode")
    return [measure.decode(model_cfg, weights, mesh, batch=b, ctx=sizes.ctx,
                           page_size=sizes.page_size, steps_per_call=sizes.steps_per_call,
                           calls=sizes.decode_calls, dtype=args.dtype,
                           copy_gbps=probes().get("copy_gbps"), ref_gbps=args.ref_gbps)
            for b in sizes.decode_batches]

  def decode_tail():
    weights = params("decode_tail")
    return [measure.decode_long_tail(
        model_cfg, weights, mesh, batch=b, ctx=sizes.ctx, page_size=sizes.page_size,
        steps_per_call=sizes.steps_per_call, calls=sizes.decode_calls, dtype=args.dtype,
        copy_gbps=probes().get("copy_gbps"), ref_gbps=args.ref_gbps, attention=attention)
            for b in sizes.decode_batches for attention in ("auto", "ragged")]

  def prefill():
    return measure.prefill(model_cfg, params("prefill"), mesh, length=sizes.prefill_len,
                           page_size=sizes.page_size, repeats=sizes.repeats, dtype=args.dtype,
                           peak_tflops=probes().get("matmul_tflops"),
                           ref_tflops=args.peak_tflops)

  def train():
    return measure.train(model_cfg, batch=sizes.train_batch, seq=sizes.train_seq,
                         steps=sizes.train_steps, warmup=sizes.train_warmup, dtype=args.dtype,
                         remat=args.remat, micro_batch=sizes.train_micro_batch,
                         logprob_chunk_len=args.logprob_chunk,
                         peak_tflops=probes().get("matmul_tflops"),
                         ref_tflops=args.peak_tflops)

  def sync():
    return measure.weight_sync(model_cfg, mesh, dtype=args.dtype, repeats=sizes.repeats,
                               copy_gbps=probes().get("copy_gbps"))

  def anchor():
    path = anchor_lib.find(args.anchor)
    if path is None:
      raise Skip(f"--anchor {args.anchor} not found")
    out = anchor_lib.run(path, model_cfg, sizes, dtype=args.dtype,
                         copy_gbps=probes().get("copy_gbps"),
                         peak_tflops=probes().get("matmul_tflops"))
    out["ratios"] = anchor_lib.ratios(out, res)
    return out

  def e2e():
    missing = e2e_lib.missing_modules()
    if missing:
      raise Skip(f"{', '.join(missing)} not installed; bring wheels as in notes/PERFORMANCE.md")
    config = args.e2e_config
    if not os.path.isabs(config):
      config = os.path.join(REPO_ROOT, config)
    workdir = args.workdir or tempfile.mkdtemp(prefix="rl_jax_bench_e2e_")
    return e2e_lib.run(config, workdir, preset=args.preset, dtype=args.dtype, sizes=sizes)

  return dict(_compile_only_fns(args, sizes, model_cfg), probes=probe, decode=decode,
              decode_tail=decode_tail, prefill=prefill, train=train, sync=sync,
              anchor=anchor, e2e=e2e)


def run(args) -> dict:
  """Runs the selected sections; returns the result dict (also written to --out)."""
  sizes = options.sizes_from_args(args)
  plan = options.sections_from_args(args)
  sections = [s for s, why in plan.items() if not why]
  # Every section (prefill, train, aot) runs the chosen attention kernel.
  model_cfg = model.get_preset(args.preset).replace(attention=args.attention)
  device = jax.devices()[0]
  res = dict(
      suite="rl_jax", preset=args.preset, params=model.num_params(model_cfg),
      dtype=args.dtype, remat=args.remat, attention=args.attention,
      logprob_chunk_len=args.logprob_chunk, backend=jax.default_backend(),
      device=device.device_kind, jax=jax.__version__, python=platform.python_version(),
      sizes=dataclasses.asdict(sizes),
      peak_tflops_ref=args.peak_tflops, copy_gbps_ref=args.ref_gbps, targets=TARGETS,
      sections=sections, skipped={s: why for s, why in plan.items() if why},
      errors={}, section_wall_s={}, device_peak_bytes={})
  fns = _section_fns(args, sizes, model_cfg, res, sections)
  for name in sections:
    print(f"[suite] {name} ...", flush=True)
    t0 = time.perf_counter()
    try:
      res[name] = fns[name]()
    except Skip as e:
      res["skipped"][name] = str(e)
    except Exception as e:  # noqa: BLE001  (recorded; the remaining sections still run)
      traceback.print_exc()
      res["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    res["section_wall_s"][name] = time.perf_counter() - t0
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:  # accelerators only; the peak since the process began
      res["device_peak_bytes"][name] = int(stats["peak_bytes_in_use"])
    if args.out:  # after every section, so a run cut short still leaves its results
      _write(args.out, res)
  return res


def _write(path: str, res: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(res, f, indent=1)
  os.replace(path + ".tmp", path)


def _fmt(v) -> str:
  if v is None or v == "":
    return ""
  if isinstance(v, float):
    return f"{v:,.4g}"
  return str(v)


def _bytes(n: int) -> str:
  return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.2f} MiB"


def _same_work(frac, ms, plain_ms):
  """The plain-JAX program's fraction under rl_jax's own FLOPs / bytes count: both do
  the same model work, so fractions scale inversely with step time."""
  if frac is None or not plain_ms:
    return None
  return frac * ms / plain_ms


def _kernels(*anchor_rows) -> str | None:
  """The attention kernels anchor rows record having run ("xla", "cudnn"), "/"-joined."""
  names = [r.get("attention", "?") for r in anchor_rows if r]
  return " / ".join(names) if names else None


def _decode_rows(decode: list, ref: dict, ratios: dict) -> list[tuple]:
  """The decode section's table rows against the anchor's rows `ref` {(kind, B): row}."""
  rows = []
  at_least_plain = f">= {TARGETS['ratio_over_plain']:g}"
  roof = f">= {TARGETS['decode_roofline_frac']:g}"
  for d in decode:
    b = d["batch"]
    dense, paged = ref.get(("decode-dense", b), {}), ref.get(("decode-paged-gather", b), {})
    tag = f"B={b} ctx={d['ctx']}"
    rows.append(("decode", f"{tag} tokens/s (plain: dense)", d["tokens_per_s"],
                 dense.get("tok_s"), ratios.get(f"decode_b{b}_over_dense"), at_least_plain))
    rows.append(("decode", f"{tag} tokens/s (plain: paged)", d["tokens_per_s"],
                 paged.get("tok_s"), ratios.get(f"decode_b{b}_over_paged"), at_least_plain))
    rows.append(("decode", f"{tag} step ms", d["step_ms"], dense.get("step_ms"), None, ""))
    rows.append(("decode", f"{tag} attention kernel (plain: dense / paged)", d["attention"],
                 _kernels(dense, paged), None, ""))
    rows.append(("decode", f"{tag} roofline frac (plain: dense)", d.get("roofline_frac"),
                 _same_work(d.get("roofline_frac"), d["step_ms"], dense.get("step_ms")), None,
                 roof if b >= 256 else f"({roof} at B=256)"))
    rows.append(("decode", f"{tag} roofline frac (ref bw)", d.get("roofline_frac_ref"),
                 None, None, ""))
  return rows


def table_rows(res: dict) -> list[tuple]:
  """(section, measure, rl_jax, plain JAX, rl_jax / plain, target) rows."""
  rows = []
  anchor = res.get("anchor") or {}
  ref = {}
  for row in anchor.get("rows", []):
    ref[(row["kind"], row.get("B"))] = row
  ratios = anchor.get("ratios", {})
  at_least_plain = f">= {TARGETS['ratio_over_plain']:g}"

  p = res.get("probes")
  if p:
    rows.append(("probes", f"copy GB/s ({p['copy_bytes'] / 2 ** 20:.0f} MiB)", p["copy_gbps"],
                 None, None, f"ref {res['copy_gbps_ref']:g}"))
    rows.append(("probes", f"bf16 matmul TFLOP/s (n={p['matmul_n']})", p["matmul_tflops"],
                 None, None, f"ref {res['peak_tflops_ref']:g}"))
  for name, m in (res.get("aot") or {}).items():
    if "peak_bytes" in m:
      rows.append(("aot", f"{name} peak (temp)",
                   f"{_bytes(m['peak_bytes'])} ({_bytes(m['temp_bytes'])})",
                   None, None, f"{m['frac_of_device']:.1%} of device"))
  rows += _decode_rows(res.get("decode") or [], ref, ratios)
  for d in res.get("decode_tail") or []:
    tag = (f"B={d['batch']} {d['batch'] - d['long_slots']}x{d['short_len']}"
           f"+{d['long_slots']}x{d['long_len']} {d['attention']}")
    rows.append(("decode_tail", f"{tag} tokens/s", d["tokens_per_s"], None, None, ""))
    rows.append(("decode_tail", f"{tag} step ms", d["step_ms"], None, None, ""))
    rows.append(("decode_tail", f"{tag} roofline frac (live KV)", d.get("roofline_frac"),
                 None, None, ""))
    rows.append(("decode_tail", f"{tag} live share of pages read", d["pages_read_frac"],
                 None, None, "(1 = live pages only)"))
  pf = res.get("prefill")
  if pf:
    rows.append(("prefill", f"T={pf['length']} tokens/s", pf["tokens_per_s"], None, None, ""))
    rows.append(("prefill", f"T={pf['length']} MFU", pf.get("mfu"), None, None, ""))
  tr = res.get("train")
  if tr:
    tref = anchor_lib.train_row(anchor) or {}
    tag = f"B={tr['batch']} T={tr['seq']}"
    rows.append(("train", f"{tag} tokens/s", tr["tokens_per_s"], tref.get("tok_s"),
                 ratios.get("train_over_anchor"), at_least_plain))
    rows.append(("train", f"{tag} step ms", tr["step_ms_p50"], tref.get("step_ms"), None, ""))
    rows.append(("train", f"{tag} attention kernel", tr.get("attention"), _kernels(tref), None,
                 tref.get("attention_note", "")))
    rows.append(("train", f"{tag} MFU (measured peak)", tr.get("mfu"),
                 _same_work(tr.get("mfu"), tr["step_ms_p50"], tref.get("step_ms")), None,
                 f">= {TARGETS['train_mfu']}"))
    rows.append(("train", f"{tag} MFU (ref peak)", tr.get("mfu_ref"), None, None, ""))
  sy = res.get("sync")
  if sy:
    copy = ref.get(("param-copy-d2d", None), {})
    rows.append(("sync", f"whole model ms ({sy['sampler_bytes'] / 2 ** 20:.0f} MiB out)",
                 sy["ms_p50"], sy["plain_cast_ms"], None, "(plain: one jitted cast)"))
    rows.append(("sync", "effective GB/s (plain: cast)", sy["effective_gbps"],
                 sy["plain_cast_gbps"], sy["ratio_over_plain_cast"], at_least_plain))
    rows.append(("sync", "effective GB/s (plain: anchor copy)", sy["effective_gbps"],
                 copy.get("GBps"), ratios.get("sync_over_param_copy"), at_least_plain))
    rows.append(("sync", "frac of copy bandwidth", sy.get("frac_of_copy"), None, None,
                 f">= {TARGETS['sync_frac_of_copy']}"))
  e = res.get("e2e")
  if e:
    rows.append(("e2e", f"{e['mode']} steps/hour ({e['steps']} steps)", e["steps_per_hour"],
                 None, None, ""))
    rows.append(("e2e", "sampler busy frac", e["sampler_busy_frac"], None, None, ""))
    rows.append(("e2e", "trainer busy frac", e["trainer_busy_frac"], None, None, ""))
    rows.append(("e2e", "sampler tokens/s", e["sampler_tokens_per_s"], None, None, ""))
    rows.append(("e2e", "weight sync s (mean)", e["weight_sync_s_mean"], None, None, ""))
  for name, why in res["skipped"].items():
    rows.append((name, "skipped", why, None, None, ""))
  for name, err in res["errors"].items():
    rows.append((name, "ERROR", err, None, None, ""))
  return rows


def format_table(res: dict) -> str:
  head = ("section", "measure", "rl_jax", "plain JAX", "rl/plain", "target")
  body = [tuple(_fmt(v) for v in row) for row in table_rows(res)]
  widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
  line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
  title = (f"rl_jax suite: {res['preset']} ({res['params'] / 1e6:.1f}M params, {res['dtype']}) "
           f"on {res['device']} [{res['backend']}], jax {res['jax']}")
  lines = [cost_lib.format_table(res["cost"]), ""] if res.get("cost") else []
  lines += [title, line(head), line(tuple("-" * w for w in widths))] + [line(r) for r in body]
  if res["device_peak_bytes"]:
    lines.append("device peak GiB after: " + ", ".join(
        f"{k} {v / 2 ** 30:.1f}" for k, v in res["device_peak_bytes"].items()))
  lines.append("section wall s: " + ", ".join(
      f"{k} {v:.1f}" for k, v in res["section_wall_s"].items()))
  return "\n".join(lines)


def main(args) -> int:
  res = run(args)
  if args.out:
    print(f"[suite] wrote {args.out}")
  print(format_table(res), flush=True)
  return 1 if res["errors"] else 0

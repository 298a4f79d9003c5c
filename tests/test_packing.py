"""Sequence packing (trainer.packing): row layouts, segment-masked attention kernels, the
packed step against padded rows, and the bounded set of compiled row shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from rl_jax import model
from rl_jax import sharding as shd
from rl_jax.model import attention
from rl_jax.trainer import buckets
from rl_jax.trainer import train_step as ts
from rl_jax.types import Group, Rollout


def test_row_bucket_is_a_fixed_set():
  got = [buckets.row_bucket(r, quantum=2, limit=200) for r in range(0, 80)]
  assert got[:33] == [2] * 3 + [2 * (m // 2 + m % 2) for m in range(3, 33)]
  assert got[33:38] == [36] * 4 + [40]  # 17 and 18 quanta -> 18, 19 -> 20
  assert all(g >= r and g % 2 == 0 for r, g in enumerate(got))
  assert len(set(got)) == 16 + 8 + 2  # quanta 1..16, then 18, 20, ..., 32, then 36, 40
  assert buckets.row_bucket(190, quantum=2, limit=120) == 120


def test_packed_layout_by_hand():
  """8 sequences, 2 minibatches, rows of 10: minibatch 0 holds sequences 0, 2, 4, 6 (the
  padded rows it would train) and fills rows 0, 2, 4, ...; minibatch 1 rows 1, 3, ..."""
  lengths = np.array([6, 9, 4, 3, 5, 0, 4, 2])
  layout = buckets.packed_layout(lengths, row_len=10, num_minibatches=2, quantum=1)
  # Minibatch 0: 6, 4, 5, 4 -> [6, 4], [5, 4]; minibatch 1: 9, 3, 2 -> [9], [3, 2].
  assert layout.shape == (4, 10)
  np.testing.assert_array_equal(layout.row_s[[0, 2, 4, 6]], [0, 0, 2, 2])
  np.testing.assert_array_equal(layout.row_s[[1, 3, 7]], [1, 3, 3])
  np.testing.assert_array_equal(layout.start_s[[0, 2, 4, 6, 1, 3, 7]], [0, 6, 0, 5, 0, 0, 3])
  seg = layout.segment_ids()
  np.testing.assert_array_equal(seg[0], [0] * 6 + [1] * 4)
  np.testing.assert_array_equal(seg[3], [0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
  np.testing.assert_array_equal(layout.positions()[3], [0, 1, 2, 0, 1, 0, 0, 0, 0, 0])
  x = np.arange(8 * 10).reshape(8, 10)
  rows = layout.scatter(x, -1)
  np.testing.assert_array_equal(rows[1], [10, 11, 12, 13, 14, 15, 16, 17, 18, -1])
  np.testing.assert_array_equal(rows[3], [30, 31, 32, 70, 71, -1, -1, -1, -1, -1])
  assert layout.padding_frac == pytest.approx(1 - 33 / 40)
  assert buckets.padded_layout(lengths, 10).padding_frac == pytest.approx(1 - 33 / 80)


def test_mixed_lengths_train_30_percent_fewer_positions():
  """Completions uniform in 64..1024 tokens after a 64-token prompt, 16 groups of 8,
  micro-batches of 8 rows: packed rows against padded rows (counted, no jax)."""
  rng = np.random.default_rng(0)
  for _ in range(5):
    lengths = 64 + rng.integers(64, 1025, 128)
    t = buckets.pick_bucket(lengths.max(), base.get_config().trainer.length_buckets)
    packed = buckets.packed_layout(lengths, row_len=t, num_minibatches=1, quantum=8)
    padded = buckets.padded_layout(lengths, t)
    assert packed.num_rows * packed.row_len <= 0.7 * padded.num_rows * padded.row_len


def _reference_packed(q, k, v, seg):
  """Float64 attention of each segment alone, written back in place."""
  out = np.zeros(q.shape, np.float64)
  g = q.shape[2] // k.shape[2]
  for b in range(q.shape[0]):
    for s in np.unique(seg[b]):
      cols = np.nonzero(seg[b] == s)[0]
      qs, ks, vs = (np.asarray(x[b, cols], np.float64) for x in (q, k, v))
      ks, vs = np.repeat(ks, g, axis=1), np.repeat(vs, g, axis=1)
      sc = np.einsum("thd,shd->hts", qs, ks) / np.sqrt(q.shape[-1])
      sc = np.where(np.tril(np.ones((len(cols),) * 2, bool)), sc, -np.inf)
      p = np.exp(sc - sc.max(-1, keepdims=True))
      out[b, cols] = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), vs)
  return out


@pytest.mark.parametrize("impl", attention.SEGMENT_KERNELS)
def test_segment_kernels_match_per_segment_reference(impl):
  """Two packed rows (GQA g=2, 13 positions): every kernel equals attention over each
  segment alone, and its gradient equals jnp's."""
  rng = np.random.RandomState(0)
  q, k, v = (rng.randn(2, 13, *s).astype(np.float32) for s in ((4, 8), (2, 8), (2, 8)))
  seg = np.array([[0] * 5 + [1] * 6 + [2] * 2, [0] * 9 + [1] * 4], np.int32)
  attend = lambda i, q, k, v: model.causal_attention(q, k, v, implementation=i,
                                                     segment_ids_bt=seg)
  np.testing.assert_allclose(jax.jit(lambda *a: attend(impl, *a))(q, k, v),
                             _reference_packed(q, k, v, seg), atol=1e-5, rtol=0)
  if impl != "jnp":
    w = rng.randn(*q.shape).astype(np.float32)
    grad = lambda i: jax.jit(jax.grad(lambda *a: jnp.sum(w * attend(i, *a)),
                                      argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(grad(impl), grad("jnp")):
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_cudnn_takes_no_segment_ids():
  x = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match="no packed"):
    attention.fused_causal_attention(x, x, x, implementation="cudnn",
                                     segment_ids_bt=jnp.zeros((1, 4), jnp.int32))


def _model_cfg():
  return model.get_preset("tiny_char").replace(
      hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)


def test_segments_are_isolated_in_the_model():
  """Three sequences in one row: each one's log-probs equal those of the sequence alone
  (positions from 0), and rewriting one sequence's tokens changes no other's."""
  mcfg = _model_cfg()
  params = model.init_params(mcfg, jax.random.key(1))
  rng = np.random.default_rng(0)
  seqs = [rng.integers(3, 100, n).astype(np.int32) for n in (7, 5, 9)]
  layout = buckets.packed_layout(np.array([len(s) for s in seqs]), row_len=24,
                                 num_minibatches=1, quantum=1)
  alone = np.zeros((3, 24), np.int32)
  for i, s in enumerate(seqs):
    alone[i, :len(s)] = s

  @jax.jit
  def logp(tokens_bt, positions_bt, segment_ids_bt):
    x_bte = model.hidden_states(mcfg, params, tokens_bt, positions_bt, segment_ids_bt)
    return model.token_stats(mcfg, params, x_bte, tokens_bt, chunk_len=8).logp_bt

  packed = layout.scatter(alone, 0)
  got = logp(packed, layout.positions(), layout.segment_ids())
  want = model.token_stats(mcfg, params, model.hidden_states(mcfg, params, alone), alone,
                           chunk_len=8).logp_bt
  for i, s in enumerate(seqs):  # a sequence's last position predicts nothing: left out
    r, c = layout.row_s[i], layout.start_s[i]
    np.testing.assert_allclose(got[r, c:c + len(s) - 1], want[i, :len(s) - 1], atol=1e-5)
  changed = alone.copy()
  changed[1, :5] = rng.integers(3, 100, 5)
  got2 = logp(layout.scatter(changed, 0), layout.positions(), layout.segment_ids())
  for i in (0, 2):
    r, c, n = layout.row_s[i], layout.start_s[i], len(seqs[i])
    np.testing.assert_array_equal(got2[r, c:c + n - 1], got[r, c:c + n - 1])
  r, c = layout.row_s[1], layout.start_s[1]
  assert np.abs(got2[r, c:c + 4] - got[r, c:c + 4]).max() > 1e-3


def _groups(seed, lengths):
  rng = np.random.default_rng(seed)
  prompt = np.array([1, 40, 41], np.int32)
  groups = []
  for g, group_lengths in enumerate(lengths):
    rollouts = []
    for k, n in enumerate(group_lengths):
      c = rng.integers(3, 100, n).astype(np.int32)
      rollouts.append(Rollout(
          group_id=g, sample_index=k, prompt_tokens=prompt, completion_tokens=c,
          behavior_logprobs=(-np.log(128) + rng.normal(0, 0.5, n)).astype(np.float32),
          token_versions=np.full(n, 3, np.int32), reward=float(rng.normal())))
    groups.append(Group(group_id=g, example=None, prompt_tokens=prompt, rollouts=rollouts))
  return groups


def _trainer(packing, **kw):
  c = base.get_config().trainer
  c.length_buckets = (16, 32)
  c.learning_rate = 1e-2
  c.packing = packing
  for k, v in kw.items():
    setattr(c, k, v)
  mesh = shd.make_mesh((2, 1, 1), jax.devices()[:2])
  return ts.Trainer(_model_cfg(), c, mesh, total_steps=4)


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def test_packed_step_equals_padded_rows_and_compiles_per_row_shape():
  """The same rollouts trained as packed rows and as padded rows: GSPO sequence ratios,
  Dr. GRPO sequence normalisation, two minibatches of 2-row micro-batches. Loss and
  gradient (pi_prox fixed) within 1e-5; one step's metrics and params likewise (the KL
  term is checked packed against full logits in test_train_step). Then the packed
  trainer compiles once per row shape, all from the fixed set (row_bucket counts x
  length buckets)."""
  kw = dict(ratio_level="sequence", loss_agg="seq_mean_token_sum_norm",
            num_minibatches=2, micro_batch_size=2, logprob_chunk_len=8)
  packed, padded = _trainer("auto", **kw), _trainer("off", **kw)
  assert packed.packed and not padded.packed
  params0 = model.init_params(_model_cfg(), jax.random.key(2))
  lengths = [[2, 9, 4, 12, 3, 6, 5, 7], [10, 2, 3, 8, 4, 11, 6, 2]]
  groups = _groups(0, lengths)
  batch = packed.make_train_batch(groups)
  layout, full = packed.layouts(batch)
  # Per minibatch, first-fit decreasing into rows of 16: 5 and 6 rows (by hand).
  assert layout.shape == (12, 16) and full.shape == (16, 16)

  states = [t.init_state(params=params0) for t in (packed, padded)]
  # Any pi_prox will do (no compile): the behaviour log-probs moved, so ratios vary.
  noise = np.random.default_rng(9).normal(0, 0.3, batch.mask_bt.shape)
  prox = np.where(batch.mask_bt, batch.behavior_logprobs_bt + noise, 0.0).astype(np.float32)
  (loss_p, g_p), (loss_u, g_u) = (t.loss_and_grad(s.params, batch, prox)
                                  for t, s in zip((packed, padded), states))
  np.testing.assert_allclose(loss_p, loss_u, atol=1e-6, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_u)):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert max(float(np.abs(g).max()) for g in jax.tree.leaves(_host(g_u))) > 1e-3

  (state_p, m_p), (state_u, m_u) = (t.step(s, batch) for t, s in zip((packed, padded), states))
  for k in ("loss", "pg_loss", "kl_behavior", "entropy", "grad_norm", "ratio_p1",
            "ratio_p50", "ratio_p99", "clip_frac_low", "clip_frac_high", "tis_weight_mean",
            "tokens"):
    np.testing.assert_allclose(m_p[k], m_u[k], atol=1e-6, rtol=1e-5, err_msg=k)
  assert m_p["ratio_p99"] != 1.0  # the second minibatch is off-policy
  # Adam's first step is lr * g / (|g| + eps): where |g| is near eps, rounding in g shows.
  diffs = np.concatenate([np.abs(a - b).ravel() for a, b in zip(
      jax.tree.leaves(_host(state_p.params)), jax.tree.leaves(_host(state_u.params)))])
  assert diffs.max() < 5e-4 and np.mean(diffs > 1e-6) < 1e-3
  assert m_p["train/padding_frac"] == pytest.approx(layout.padding_frac)
  assert m_p["train/padding_frac_unpacked"] == m_u["train/padding_frac"] == pytest.approx(
      1 - (sum(map(sum, lengths)) + 3 * 16) / (16 * 16))
  assert m_p["train/positions"] == 12 * 16 and m_u["train/positions"] == 16 * 16

  count, shapes = packed.compile_count, {layout.shape}
  for seed, ls in ((1, [[2] * 8, [3] * 8]), (2, [[12] * 8, [5] * 8])):
    b = packed.make_train_batch(_groups(seed, ls))
    shapes.add(packed.layouts(b)[0].shape)
    state_p, _ = packed.step(state_p, b)
  allowed = {(buckets.row_bucket(r, quantum=2, limit=8) * 2, t)
             for r in range(1, 9) for t in (16, 32)}
  # By hand: lengths 5 and 6 pack 4 rows per minibatch; 15 and 8 need 6 again.
  assert shapes <= allowed and shapes == {(12, 16), (8, 16)}
  assert packed.compile_count == count + 1


def test_no_segment_kernel_trains_padded_rows_and_says_so(caplog, monkeypatch):
  """cuDNN (bf16) takes no segment ids: auto falls back to padded rows with one warning;
  off never packs; anything else is a config error."""
  mesh = shd.make_mesh((1, 1, 1), jax.devices()[:1])
  c = base.get_config().trainer
  cudnn = _model_cfg().replace(attention="cudnn", dtype="bfloat16")
  select = ts.attention_lib.select
  # As if on a GPU where cuDNN runs (off a GPU an explicit cudnn stops the run).
  monkeypatch.setattr(ts.attention_lib, "select", lambda impl, *a: (
      ts.attention_lib.Kernel("cudnn", impl, "") if impl == "cudnn" else select(impl, *a)))
  with caplog.at_level("WARNING"):
    assert not ts.Trainer(cudnn, c, mesh, total_steps=1).packed
  assert [r.getMessage() for r in caplog.records if "packing" in r.getMessage()] == [
      f"trainer.packing=auto: the 'cudnn' attention kernel takes no segment ids (packed "
      f"rows) in jax {jax.__version__}; training padded rows"]
  assert ts.Trainer(_model_cfg(), c, mesh, total_steps=1).packed  # xla on CPU
  c.packing = "off"
  assert not ts.Trainer(_model_cfg(), c, mesh, total_steps=1).packed
  c.packing = "on"
  with pytest.raises(ValueError, match="trainer.packing"):
    ts.Trainer(_model_cfg(), c, mesh, total_steps=1)

"""The peer-workload bench (rl_jax/bench/peer.py): its requests and its ratio table.
No timing is asserted; the runners themselves are exercised by launch/bench.py."""
import numpy as np
import pytest

from rl_jax.bench import peer


def test_requests_uniform_and_long_tail():
  uni = peer.peer_requests("uniform", num=8, max_new=32, prompt_len=5, vocab_size=64, seed=0)
  assert [n for _, n in uni] == [32] * 8
  assert all(p.shape == (5,) and p.dtype == np.int32 and p.min() >= 3 for p, _ in uni)
  tail = peer.peer_requests("long_tail", num=200, max_new=32, prompt_len=5, vocab_size=64,
                            seed=0)
  lengths = np.array([n for _, n in tail])
  assert lengths.max() == 32 and np.median(lengths) == pytest.approx(8, abs=2)
  assert all(p.shape == (5,) for p, _ in tail)
  with pytest.raises(ValueError, match="unknown length mix"):
    peer.peer_requests("zipf", num=1, max_new=4, prompt_len=2, vocab_size=8, seed=0)


def test_table_ratios_to_tunix_and_to_the_first_steps_per_call():
  def row(slots, spc, tps, **kw):
    return dict(mix="uniform", name=f"v{slots}/{spc}", slots=slots, steps_per_call=spc,
                tokens_per_s=tps, tokens_per_cpu_s=tps / 2, **kw)
  counts = dict(generate_calls=4, slot_steps=64, idle_slot_steps=3)
  rows = [row(16, 0, 1000.0), row(16, 1, 500.0, **counts), row(16, 8, 1500.0, **counts),
          row(64, 1, 800.0, **counts)]
  rows[2]["tokens_per_cpu_s"] = 1000.0  # 2x spc 1 and tunix by CPU time, 3x by wall time
  lines = peer.table(rows).splitlines()
  assert lines[1].split()[2:] == ["1,000", "500"]  # tunix: no ratios, no counts
  assert lines[2].split()[2:] == ["500", "250", "0.50", "1.00", "0.50", "1.00", "4", "64", "3"]
  assert lines[3].split()[2:] == ["1,500", "1,000", "1.50", "3.00", "2.00", "4.00", "4", "64",
                                  "3"]
  assert lines[4].split()[2:] == ["800", "400", "1.00", "1.00", "4", "64", "3"]  # no tunix row

"""Host-side page allocator: free list, reference counts, no leaks, no double hand-out."""
import numpy as np
import pytest

from rl_jax.sampler import page_table as pt


def test_pages_for_and_budget():
  assert pt.pages_for(0, 16) == 0
  assert pt.pages_for(1, 16) == 1
  assert pt.pages_for(16, 16) == 1
  assert pt.pages_for(17, 16) == 2
  per_page = pt.page_bytes(num_layers=2, num_kv_heads=2, head_dim=32, page_size=16,
                           dtype_bytes=4)
  assert per_page == 2 * 2 * 16 * 2 * 32 * 4
  assert pt.num_pages_for_budget(kv_cache_bytes=10 * per_page + 7, num_layers=2,
                                 num_kv_heads=2, head_dim=32, page_size=16,
                                 dtype_bytes=4) == 10
  with pytest.raises(ValueError, match="kv_cache_bytes"):
    pt.num_pages_for_budget(kv_cache_bytes=per_page, num_layers=2, num_kv_heads=2,
                            head_dim=32, page_size=16, dtype_bytes=4)


def test_page_table_row():
  np.testing.assert_array_equal(pt.page_table_row([3, 5], 4), [3, 5, 0, 0])
  with pytest.raises(ValueError):
    pt.page_table_row([1, 2, 3], 2)


def test_allocate_never_hands_out_null_or_live_page():
  a = pt.PageAllocator(num_pages=9, page_size=4)
  assert a.capacity == 8 and a.num_free == 8 and a.num_used == 0
  x = a.allocate(5)
  y = a.allocate(3)
  got = np.concatenate([x, y])
  assert sorted(got.tolist()) == list(range(1, 9))
  assert a.allocate(1) is None  # exhausted: caller waits, nothing is taken
  assert a.num_free == 0
  a.release(x[:2])
  z = a.allocate(2)
  assert set(z.tolist()) == set(x[:2].tolist())
  assert a.allocate(3) is None and a.num_free == 0


def test_allocate_is_all_or_nothing():
  a = pt.PageAllocator(num_pages=5, page_size=4)
  a.allocate(3)
  assert a.allocate(2) is None
  assert a.num_free == 1


def test_shared_pages_free_on_last_reference():
  a = pt.PageAllocator(num_pages=6, page_size=4)
  prompt = a.allocate(2)
  a.share(prompt)
  a.share(prompt)
  assert [a.refcount(p) for p in prompt] == [3, 3]
  a.release(prompt)
  a.release(prompt)
  assert a.num_used == 2
  a.release(prompt)
  assert a.num_used == 0 and a.num_free == 5
  assert np.all(a.refcounts() == 0)


def test_release_errors_do_not_corrupt_state():
  a = pt.PageAllocator(num_pages=4, page_size=4)
  p = a.allocate(1)
  with pytest.raises(ValueError):
    a.release([pt.NULL_PAGE])
  with pytest.raises(ValueError):
    a.release([p[0], p[0]])  # one reference held, two dropped
  with pytest.raises(ValueError):
    a.share([2 if p[0] != 2 else 3])  # not live
  assert a.refcount(int(p[0])) == 1 and a.num_used == 1
  a.release(p)
  with pytest.raises(ValueError):
    a.release(p)  # double free
  assert a.num_used == 0


def test_random_workload_no_leak_and_exclusive_ownership():
  rng = np.random.default_rng(0)
  a = pt.PageAllocator(num_pages=33, page_size=8)
  live: list[np.ndarray] = []  # each entry: one reference held on these pages
  for _ in range(2000):
    if live and rng.random() < 0.45:
      a.release(live.pop(int(rng.integers(len(live)))))
    elif live and rng.random() < 0.2:
      src = live[int(rng.integers(len(live)))]
      a.share(src)
      live.append(src.copy())
    else:
      got = a.allocate(int(rng.integers(1, 5)))
      if got is not None:
        live.append(got)
    expected = np.zeros((33,), np.int32)
    for pages in live:
      np.add.at(expected, pages, 1)
    np.testing.assert_array_equal(a.refcounts(), expected)
    assert a.num_used == int(np.count_nonzero(expected))
  for pages in live:
    a.release(pages)
  assert a.num_free == a.capacity and np.all(a.refcounts() == 0)

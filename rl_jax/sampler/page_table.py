"""Host-side bookkeeping of the paged KV cache: a page allocator with reference counts.

The device holds one page pool per layer (`k_pages_lnpkd`, see engine.py); this module
only decides which page ids a sequence owns. Shape letters: m = pages per sequence
(page-table width).

Page `NULL_PAGE` (id 0) is never handed out. Unused page-table entries and idle decode
slots point at it, so a write from an idle slot lands in a page nobody reads, and a
freshly reset slot can never touch a page that another sequence owns.

Sharing: the G samples of one prompt point at the same full prompt pages. A page's
reference count is the number of page tables (plus the owning group while it still has
samples to insert) that name it; it returns to the free list when the count reaches
zero. Only shared prompt pages ever have a count above one: pages a sequence writes
into are always private to it.
"""
from __future__ import annotations

import numpy as np

NULL_PAGE = 0


def pages_for(num_tokens: int, page_size: int) -> int:
  """Pages needed to hold `num_tokens` tokens: ceil(num_tokens / page_size)."""
  return -(-int(num_tokens) // int(page_size))


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int) -> int:
  """KV cache bytes one token holds: 2 (K and V) * layers * kv_heads * head_dim * bytes."""
  return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def page_bytes(*, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
               dtype_bytes: int) -> int:
  """Bytes of one page id across the K and V pools of every layer."""
  return page_size * kv_bytes_per_token(num_layers=num_layers, num_kv_heads=num_kv_heads,
                                        head_dim=head_dim, dtype_bytes=dtype_bytes)


def num_pages_for_budget(*, kv_cache_bytes: int, num_layers: int, num_kv_heads: int,
                         head_dim: int, page_size: int, dtype_bytes: int) -> int:
  """Largest pool (including the null page) that fits in `kv_cache_bytes`."""
  per_page = page_bytes(num_layers=num_layers, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, page_size=page_size, dtype_bytes=dtype_bytes)
  n = int(kv_cache_bytes) // per_page
  if n < 2:
    raise ValueError(
        f"sampler.kv_cache_bytes={kv_cache_bytes} holds {n} pages of {per_page} bytes; "
        "need at least 2 (the null page and one usable page)")
  return n


def page_table_row(pages, width: int) -> np.ndarray:
  """int32 [m] page table for one sequence: its pages, then NULL_PAGE."""
  if len(pages) > width:
    raise ValueError(f"sequence owns {len(pages)} pages but the page table holds {width}")
  row = np.full((width,), NULL_PAGE, np.int32)
  row[:len(pages)] = pages
  return row


class PageAllocator:
  """Free list plus reference counts over page ids 1..num_pages-1.

  Not thread-safe: one generator loop owns it.
  """

  def __init__(self, *, num_pages: int, page_size: int):
    if num_pages < 2:
      raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
    if page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {page_size}")
    self.num_pages = int(num_pages)
    self.page_size = int(page_size)
    self._refcount = np.zeros((self.num_pages,), np.int32)
    # Popped from the end, so low ids are handed out first (stable, easy to read).
    self._free = list(range(self.num_pages - 1, NULL_PAGE, -1))

  @property
  def capacity(self) -> int:
    """Usable pages (the null page excluded)."""
    return self.num_pages - 1

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return self.capacity - len(self._free)

  def refcount(self, page: int) -> int:
    return int(self._refcount[page])

  def refcounts(self) -> np.ndarray:
    """Copy of the int32 [num_pages] reference counts (for tests and metrics)."""
    return self._refcount.copy()

  def allocate(self, n: int) -> np.ndarray | None:
    """`n` fresh pages with count 1, or None (nothing taken) if fewer are free.

    Returning None instead of raising lets the caller keep a request pending until
    running sequences finish and give pages back.
    """
    if n < 0:
      raise ValueError(f"cannot allocate {n} pages")
    if n > len(self._free):
      return None
    out = np.asarray([self._free.pop() for _ in range(n)], np.int32)
    self._refcount[out] = 1
    return out

  def share(self, pages) -> None:
    """One more reference to each live page in `pages`."""
    pages = np.asarray(pages, np.int32).reshape(-1)
    if pages.size and (np.any(pages == NULL_PAGE) or np.any(self._refcount[pages] <= 0)):
      raise ValueError(f"can only share live pages, got {pages.tolist()}")
    np.add.at(self._refcount, pages, 1)

  def release(self, pages) -> None:
    """Drop one reference to each page; pages reaching zero return to the free list."""
    pages = np.asarray(pages, np.int32).reshape(-1)
    if not pages.size:
      return
    # O(pages released), not O(pool): a pool may hold millions of pages.
    held, counts = np.unique(pages, return_counts=True)
    if held[0] == NULL_PAGE or np.any(counts > self._refcount[held]):
      raise ValueError(f"releasing pages that are not held: {pages.tolist()}")
    self._refcount[held] -= counts.astype(np.int32)
    freed = held[self._refcount[held] == 0]
    self._free.extend(int(p) for p in freed[::-1])

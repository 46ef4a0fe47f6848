"""The host page allocator: free list, ref counts, prefix caching by chained hash, LRU eviction."""

import pytest

from jaxserve.batching.kv_pages import PageAllocator, page_hash


def all_free(a: PageAllocator) -> bool:
  return a.num_free_pages == a.num_usable_pages and all(
      a.ref_count(b) == 0 for b in range(a.num_pages))


def fill(a: PageAllocator, tokens):
  """Allocates `tokens`, registers its full pages (as a finished prefill would) and frees it."""
  table, cached = a.allocate(tokens)
  a.cache_pages(table, tokens, cached // a.page_size, len(tokens) // a.page_size)
  a.free(table)
  return table


def test_blocks_for_tokens_round_up():
  a = PageAllocator(8, page_size=4)
  assert [a.num_pages_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_page_zero_is_never_handed_out():
  a = PageAllocator(5, page_size=2)
  table, cached = a.allocate([1, 2, 3, 4, 5])  # 3 pages
  assert cached == 0 and len(table) == 3
  assert a.append_page(table)  # The 4th and last usable page.
  assert sorted(table) == [1, 2, 3, 4]
  assert not a.append_page(table) and len(table) == 4  # Pool empty: no change.
  assert not a.can_allocate([7])
  a.free(table)
  assert all_free(a)


def test_rejects_a_pool_without_usable_blocks():
  with pytest.raises(ValueError, match="scratch"):
    PageAllocator(1, page_size=4)


def test_shared_prefix_reuses_blocks_and_counts_hits():
  a = PageAllocator(16, page_size=4)
  first = fill(a, list(range(10)))  # Pages [0..3] [4..7] full, [8, 9] partial.
  table, cached = a.allocate(list(range(8)) + [50, 51, 52])
  assert cached == 8
  assert table[:2] == first[:2] and table[2] not in first
  # Queried 10 + 11 tokens; 8 hit.
  assert (a.num_query_tokens, a.num_hit_tokens) == (21, 8)
  a.free(table)
  assert all_free(a)


def test_the_block_holding_the_last_token_is_never_a_hit():
  a = PageAllocator(16, page_size=4)
  first = fill(a, list(range(8)))  # Two full pages, both cached.
  table, cached = a.allocate(list(range(8)))
  # The last token must be prefilled to sample from it, so only the first page is reused.
  assert cached == 4 and table[0] == first[0] and table[1] != first[1]
  a.free(table)


def test_hash_chains_through_the_parent_block():
  a = PageAllocator(16, page_size=2)
  fill(a, [1, 2, 3, 4, 9])
  # Same second page [3, 4] after a different first page: no hit at all.
  assert a.allocate([7, 7, 3, 4, 9])[1] == 0
  a2 = PageAllocator(16, page_size=2)
  fill(a2, [1, 2, 3, 4, 9])
  assert a2.allocate([1, 2, 3, 5, 9])[1] == 2  # Only the first page matches.


def test_ref_counts_keep_shared_blocks_until_the_last_holder_frees():
  a = PageAllocator(8, page_size=2)
  fill(a, [1, 2, 3])
  t1, _ = a.allocate([1, 2, 5])
  t2, _ = a.allocate([1, 2, 6])
  shared = t1[0]
  assert t2[0] == shared and a.ref_count(shared) == 2
  a.free(t1)
  assert a.ref_count(shared) == 1
  a.free(t2)
  assert a.ref_count(shared) == 0 and all_free(a)
  assert a.num_cached_pages == 1  # Still findable after everyone let go.
  assert a.allocate([1, 2, 9])[1] == 2


def test_lru_evicts_the_least_recently_freed_tail_first():
  a = PageAllocator(5, page_size=2)  # 4 usable pages.
  ta = fill(a, [1, 2, 3, 4, 0])  # A: pages [1,2] [3,4] cached, 3rd page plain free.
  tb = fill(a, [5, 6, 7])  # B: page [5,6] cached; freed after A, so more recent.
  assert a.num_cached_pages == 3 and a.num_free_pages == 4
  # Three fresh pages: one plain free page, then evictions in LRU order: A's tail [3,4] first,
  # then A's head [1,2]. B's page survives.
  t, cached = a.allocate([100, 101, 102, 103, 104])
  assert cached == 0 and a.num_evictions == 2
  assert set(t) == set(ta)
  assert tb[0] not in t
  a.free(t)
  assert a.allocate([1, 2, 3, 4, 0])[1] == 0  # A is gone...
  a2 = PageAllocator(5, page_size=2)
  ta = fill(a2, [1, 2, 3, 4, 0])
  tb = fill(a2, [5, 6, 7])
  t, _ = a2.allocate([100, 101, 102])  # Two fresh: plain free, then A's tail evicted.
  assert a2.num_evictions == 1
  a2.free(t)
  t2, cached = a2.allocate([1, 2, 3, 4, 0])
  assert cached == 2 and t2[0] == ta[0]  # ...A's head outlived its tail...
  a2.free(t2)
  t3, cached = a2.allocate([5, 6, 7])
  assert cached == 2 and t3[0] == tb[0]  # ...and B was never touched.
  a2.free(t3)
  assert all_free(a2)


def test_a_cache_hit_refreshes_a_block_in_lru_order():
  a = PageAllocator(4, page_size=2)  # 3 usable.
  ta = fill(a, [1, 2, 9])  # A's page [1,2] cached first...
  tb = fill(a, [3, 4, 9])  # ...then B's [3,4].
  t, _ = a.allocate([1, 2, 5])  # A hit and freed again: now the most recent.
  a.free(t)
  t, _ = a.allocate([7, 8, 9])  # Two fresh pages: the plain free one, then B's is evicted.
  assert a.num_evictions == 1 and tb[0] in t
  a.free(t)
  tb, cached = a.allocate([3, 4, 9])
  assert cached == 0
  a.free(tb)
  ta, cached = a.allocate([1, 2, 9])
  assert cached == 2
  a.free(ta)
  assert all_free(a)


def test_can_allocate_counts_revived_cached_blocks_as_used():
  a = PageAllocator(4, page_size=2)  # 3 usable.
  fill(a, [1, 2, 3, 4, 5])  # Pages [1,2] [3,4] cached (evictable), one plain free.
  assert a.num_free_pages == 3
  # [1,2,3,4,6,7]: 2 hits (revived, so no longer free) + 1 new page = all 3. Leaves 0.
  assert a.can_allocate([1, 2, 3, 4, 6, 7])
  assert not a.can_allocate([1, 2, 3, 4, 6, 7], num_reserve=1)
  # Without hits, 4 new pages would be needed.
  assert not a.can_allocate([9, 9, 9, 9, 9, 9, 9])
  table, cached = a.allocate([1, 2, 3, 4, 6, 7])
  assert cached == 4 and a.num_free_pages == 0
  a.free(table)
  assert all_free(a)


def test_duplicate_contents_keep_one_findable_block():
  a = PageAllocator(8, page_size=2)
  t1, _ = a.allocate([1, 2, 3])
  t2, _ = a.allocate([1, 2, 3])  # Nothing cached yet: two private copies.
  a.cache_pages(t1, [1, 2, 3], 0, 1)
  a.cache_pages(t2, [1, 2, 3], 0, 1)
  assert a.num_cached_pages == 1
  a.free(t1)
  a.free(t2)
  assert all_free(a)
  table, cached = a.allocate([1, 2, 3])
  assert cached == 2 and table[0] == t1[0]
  a.free(table)


def test_no_hits_when_prefix_caching_is_off():
  a = PageAllocator(8, page_size=2, enable_prefix_caching=False)
  fill(a, [1, 2, 3, 4, 5])
  assert a.num_cached_pages == 0
  assert a.allocate([1, 2, 3, 4, 5])[1] == 0


def test_page_keys_are_sha256_of_the_parent_key_and_the_page_tokens():
  """A cryptographic key (vLLM's CVE-2025-25183 was Python hash() collisions): SHA-256 over the
  parent's 32-byte key, then the ids as little-endian int32s; the first page's parent is zeros."""
  import hashlib
  import struct
  a = PageAllocator(8, page_size=2)
  fill(a, [5, 6, 7, 8, 9])
  first = hashlib.sha256(bytes(32) + struct.pack("<2i", 5, 6)).digest()
  second = hashlib.sha256(first + struct.pack("<2i", 7, 8)).digest()
  assert page_hash(bytes(32), (5, 6)) == first and page_hash(first, (7, 8)) == second
  assert [h.page for h in a.match_prefix([5, 6, 7, 8, 1])] == [a._cached[first], a._cached[second]]
  assert page_hash(bytes(32), (5, 6)) != page_hash(bytes(31) + b"\1", (5, 6))

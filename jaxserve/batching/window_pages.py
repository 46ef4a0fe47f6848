"""Every running request's KV pages, from one pool or, with window pages, from two: one allocator.

The scheduler asks this allocator for pages and never does window arithmetic itself (as SGLang's
memory pools keep sliding-window and full-attention pages behind one allocator):

  full pool     the global layers' KV (every layer's, without window pages): every position of
                a request, prefix-cached (kv_pages.PageAllocator)
  window pool   with window pages (EngineInfo.window): the sliding-window layers' KV. A request
                holds only the pages its next query can still see; the ones before them are freed
                as the window moves. The pool holds every slot's largest window, so it never runs
                out.

Both pools register a page under the same prefix key, so a cached prefix is reused only as far as
the window pool still holds the window of its first recomputed position. `tables` is the
engine's view: each slot's table, then (with window pages) its window table, [Bs, Pg * W].

The pools are the page groups (`groups`, in the engine's order: 0 the full pool, 1 the window
pool). With a host tier each keeps its own (EngineInfo.num_host_pages slots each): a page of
either may be a host hit, and `take_copies` hands the plan each group's copies as its own list.

Shape letters: the key in jaxserve/model/__init__.py. Imports no jax.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxserve.batching.host_pages import PrefixHit
from jaxserve.batching.images import page_extras
from jaxserve.batching.kv_pages import PageAllocator
from jaxserve.batching.plan import EngineInfo
from jaxserve.batching.request import Request


class PagePools:

  def __init__(self, info: EngineInfo, enable_prefix_caching: bool):
    self.page_size = info.page_size
    self.window = info.window
    self.full = PageAllocator(info.num_pages, info.page_size, enable_prefix_caching,
                              info.num_host_pages)
    self.window_pool = (PageAllocator(info.num_window_pages, info.page_size, enable_prefix_caching,
                                      info.num_host_pages) if self.window else None)
    self.max_pages_per_seq = self.full.num_pages_for(info.max_model_len)  # W
    self.tables = np.zeros((info.num_slots, info.page_groups * self.max_pages_per_seq),
                           np.int32)  # [Bs, Pg * W]

  @property
  def groups(self) -> tuple[PageAllocator, ...]:
    """The allocator of each page group: the full pool, then with window pages the window's."""
    return (self.full,) if self.window_pool is None else (self.full, self.window_pool)

  def reset_prefix_cache(self) -> bool:
    """Forgets every cached page of every group, device and host (after a weight update no page
    computed before may be served again); False, changing nothing, while a request holds pages."""
    if any(g.num_held_pages for g in self.groups):
      return False
    for g in self.groups:
      g.reset_prefix_cache()
    return True

  # Admission.

  def match(self, token_ids: Sequence[int], cache_salt: str | None = None,
            lora: str | None = None, extras: Sequence[tuple[str, ...]] = ()) -> list[PrefixHit]:
    """The cached full-pool pages a request for `token_ids` may reuse: its longest cached
    prefix, and with window pages only as much of it as the window pool still holds the window
    of (the pages the first position to compute attends to). Made once per admission."""
    hits = self.full.match_prefix(token_ids, cache_salt, lora, extras)
    if self.window:
      while hits and not all(self._window_hit(hits[i]) is not None
                             for i in range(self._first_window_page(len(hits) * self.page_size),
                                            len(hits))):
        hits.pop()
    return hits

  def can_allocate(self, token_ids: Sequence[int], hits: Sequence[PrefixHit],
                   num_reserve: int) -> bool:
    return self.full.can_allocate(token_ids, num_reserve, hits=hits)

  def allocate(self, req: Request, slot: int, hits: Sequence[PrefixHit]) -> int:
    """Gives `req` (placed in `slot`) pages for every position of its tokens, reusing `hits`;
    returns how many leading tokens already have their KV."""
    tokens = req.all_token_ids
    table, num_cached = self.full.allocate(tokens, hits=hits, cache_salt=req.cache_salt)
    req.page_table = table
    self.tables[slot, :len(table)] = table
    if self.window:  # The cached pages' window part, from the window pool.
      req.window_table = [0] * len(hits)
      for i in range(self._first_window_page(num_cached), len(hits)):
        page = self.window_pool.revive(self._window_hit(hits[i]))
        self._set_window(req, slot, i, page)
    return num_cached

  # Growth.

  def grow(self, req: Request, num_tokens: int) -> bool:
    """Gives `req` the pages for positions [0, num_tokens), for a decode that writes position
    num_tokens - 1; False when the full pool is empty."""
    table = req.page_table
    while len(table) * self.page_size < num_tokens:
      if not self.full.append_page(table):
        return False
      self.tables[req.slot, len(table) - 1] = table[-1]
    self.hold_window(req, num_tokens - 1, num_tokens)
    return True

  def hold_window(self, req: Request, start: int, end: int) -> None:
    """Holds the window pages the queries at positions [start, end) attend to, and frees those
    before them, which no later position sees. Held pages are always one run, so the dead ones
    sit just below it. Nothing to do without window pages."""
    if not self.window:
      return
    table, first = req.window_table, self._first_window_page(start)
    table.extend([0] * ((end - 1) // self.page_size + 1 - len(table)))
    i = first - 1
    while i >= 0 and table[i]:
      self.window_pool.free([table[i]])
      self._set_window(req, req.slot, i, 0)
      i -= 1
    for i in range(first, len(table)):
      if not table[i]:
        page = self.window_pool.take()
        if page is None:  # The pool holds every slot's largest window: never reached.
          raise RuntimeError("the window page pool is exhausted")
        self._set_window(req, req.slot, i, page)

  # Caching and release.

  def cache_full_pages(self, req: Request, num_full: int) -> None:
    """Registers pages [req.num_cached_pages, num_full) of `req` in the prefix cache: their
    tokens are known and their KV writes dispatched. Window pages still held are registered
    under the same keys, so their local layers' KV is findable too."""
    start, tokens = req.num_cached_pages, req.all_token_ids
    self.full.cache_pages(req.page_table, tokens, start, num_full, req.cache_salt,
                          None if req.lora is None else req.lora.cache_key,
                          page_extras(req.images, self.page_size))
    for i in range(start, min(num_full, len(req.window_table))):
      if req.window_table[i]:
        self.window_pool.register(req.window_table[i], self.full.key_of(req.page_table[i]),
                                  self._page_tokens(tokens, i))

  def release(self, req: Request) -> None:
    """Frees every page `req` holds (cached ones stay findable) and clears its slot's tables."""
    self.full.free(req.page_table)
    req.page_table = []
    if self.window:
      self.window_pool.free([page for page in req.window_table if page])
      req.window_table = []
    self.tables[req.slot] = 0

  def take_copies(self) -> tuple[tuple, tuple]:
    """The host tier's copies for the plan being built, a list per page group: ((device page,
    host slot) saves, (host slot, device page) loads); ((), ()) when there are none."""
    copies = [pool.take_copies() for pool in self.groups]
    saves, loads = tuple(s for s, _ in copies), tuple(l for _, l in copies)
    return (saves, loads) if any(saves) or any(loads) else ((), ())

  def slot_tables(self) -> np.ndarray:
    """[Bs, Pg * W]: a copy of every slot's tables (rows of idle slots are 0), for a plan."""
    return self.tables.copy()

  # Window arithmetic.

  def _first_window_page(self, position: int) -> int:
    """The first page a local layer's query at `position` attends to."""
    return max(0, position - self.window + 1) // self.page_size

  def _window_hit(self, hit: PrefixHit) -> PrefixHit | None:
    """The window pool's hit (a cached page, or a host slot) for the full pool's `hit`: the
    same key and tokens."""
    return self.window_pool.find_hit(hit.key, hit.tokens)

  def _page_tokens(self, token_ids, i: int) -> tuple[int, ...]:
    return tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])

  def _set_window(self, req: Request, slot: int, i: int, page: int) -> None:
    req.window_table[i] = self.tables[slot, self.max_pages_per_seq + i] = page

"""The host side of the paged KV cache: which pages are free, who holds which, which are cached.

Pages (pages) 1..num_pages-1 are handed out; page 0 is the engine's scratch page (padding rows of
page tables point at it). A page is in exactly one of three states:

  held       ref count > 0, in some request's page table
  cached     ref count 0 but its KV is still valid and findable by hash (evictable, LRU order)
  free       ref count 0, no valid contents

Automatic prefix caching: a full page is keyed by its prefix (page_keys.py), and its own tokens
are compared too. A new request walks its prompt page by page and reuses every page whose key is
cached; only the rest is prefilled. When no free page is left, the least recently freed cached
page is evicted.

With a host tier (`host_slots`, host_pages.py) an evicted page is saved to host memory first, and
a prompt that reaches a saved key copies it back into a fresh page: a hit with a copy's cost.
A hit (`PrefixHit`) names its device page or, when its page is on the host (`on_host`), its
host slot.
The copies go into the next plan (`take_copies`): saves (device page -> host slot) before
loads (host slot -> device page), both before the step, which may overwrite a saved page.

"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from jaxserve.batching.host_pages import HostPages, PrefixHit
from jaxserve.batching.kv_events import KVEventLog
from jaxserve.batching.page_keys import page_extra, page_hash, prefix_keys, root_key

__all__ = ["PageAllocator", "page_hash", "prefix_keys", "root_key"]


class PageAllocator:

  def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
               host_slots: int = 0):
    if num_pages < 2:
      raise ValueError(f"num_pages must be >= 2 (page 0 is the scratch page), got {num_pages}")
    self.page_size = page_size
    self.num_pages = num_pages
    self.enable_prefix_caching = enable_prefix_caching
    self._free = collections.deque(range(1, num_pages))
    self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first.
    self._ref = [0] * num_pages
    self._hash: list[bytes | None] = [None] * num_pages
    self._tokens: list[tuple[int, ...] | None] = [None] * num_pages  # Guards against collisions.
    self._cached: dict[bytes, int] = {}  # key -> page
    self.num_query_tokens = 0  # Tokens looked up in the prefix cache at allocation.
    self.num_hit_tokens = 0  # ...of which were found there.
    self.num_evictions = 0
    self.num_host_hit_tokens = 0  # ...of which were found in the host tier.
    # The host tier (None: evicted pages are dropped), and the copies of the plan being built.
    self.host = HostPages(host_slots) if host_slots and enable_prefix_caching else None
    self._saves: list[tuple[int, int]] = []  # (device page, host slot)
    self._loads: list[tuple[int, int]] = []  # (host slot, device page)
    self.events: KVEventLog | None = None  # Set to publish the cache's changes (kv_events.py).

  @property
  def num_usable_pages(self) -> int:
    return self.num_pages - 1

  @property
  def num_free_pages(self) -> int:
    """Pages an allocation may take: free ones and evictable cached ones."""
    return len(self._free) + len(self._evictable)

  @property
  def num_cached_pages(self) -> int:
    return len(self._cached)

  def num_pages_for(self, num_tokens: int) -> int:
    return -(-num_tokens // self.page_size)

  def ref_count(self, page: int) -> int:
    return self._ref[page]

  def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None,
                   lora: str | None = None, extras: Sequence[tuple[str, ...]] = ()
                   ) -> list[PrefixHit]:
    """The cached pages that hold a prefix of `token_ids`: device pages, or host tier hits.

    The page holding the last token never matches: its prefill samples the next token, and
    rewriting a page other requests share is best avoided.
    """
    if not self.enable_prefix_caching:
      return []
    hits = []
    for i, (key, tokens) in enumerate(prefix_keys(token_ids, self.page_size, cache_salt, lora,
                                                  extras)):
      hit = self.find_hit(key, tokens)
      if hit is None:
        break
      hits.append(dataclasses.replace(hit, images=page_extra(extras, i)) if extras else hit)
    return hits

  def find(self, key: bytes, tokens: tuple[int, ...]) -> int | None:
    """The cached page of `key`, whose tokens must be `tokens` (a guard against collisions)."""
    page = self._cached.get(key)
    return page if page is not None and self._tokens[page] == tokens else None

  def find_hit(self, key: bytes, tokens: tuple[int, ...]) -> PrefixHit | None:
    """`find`, then the host tier."""
    page = self.find(key, tokens)
    if page is not None:
      return PrefixHit(key, tokens, page=page)
    return None if self.host is None else self.host.find(key, tokens)

  def key_of(self, page: int) -> bytes | None:
    return self._hash[page]

  def can_allocate(self, token_ids: Sequence[int], num_reserve: int = 0, reuse: bool = True,
                   hits: Sequence[PrefixHit] | None = None) -> bool:
    """Whether `allocate(token_ids, reuse, hits)` would leave at least `num_reserve` pages free."""
    hits = self._hits(token_ids, reuse, hits)
    on_device = [h.page for h in hits if not h.on_host]  # Host hits take fresh pages.
    num_revived = sum(self._ref[b] == 0 for b in on_device)  # They leave the evictable pool.
    num_new = self.num_pages_for(len(token_ids)) - len(on_device)
    return self.num_free_pages - num_revived >= num_new + num_reserve

  def allocate(self, token_ids: Sequence[int], reuse: bool = True,
               hits: Sequence[PrefixHit] | None = None,
               cache_salt: str | None = None) -> tuple[list[int], int]:
    """A page table covering every position of `token_ids`, reusing its cached prefix: `hits`
    when the caller matched it already (a leading part of `match_prefix`'s), else the whole
    match; none when not `reuse` (all fresh pages, for a request that must compute every
    position).

    Returns the table and how many leading tokens already have their KV in it (a host hit's
    once its load has run, before the step). Check `can_allocate` first. `cache_salt` is read
    by the events only.
    """
    hits = self._hits(token_ids, reuse, hits)
    for hit in hits:  # Held (pinned) first: the fresh pages below may evict others.
      self.host.pin(hit.slot) if hit.on_host else self.hold(hit.page)
    table = []
    for hit in hits:
      table.append(self._load(hit, table[-1] if table else None, cache_salt)
                   if hit.on_host else hit.page)
    num_new = self.num_pages_for(len(token_ids)) - len(hits)
    table += [self._take_fresh() for _ in range(num_new)]
    num_cached = len(hits) * self.page_size
    self.num_query_tokens += len(token_ids)
    self.num_hit_tokens += num_cached
    self.num_host_hit_tokens += sum(hit.on_host for hit in hits) * self.page_size
    return table, num_cached

  def revive(self, hit: PrefixHit) -> int:
    """A held device page for one hit: the page itself, or a fresh one its host copy loads."""
    if hit.on_host:
      self.host.pin(hit.slot)
      return self._load(hit, None, None, publish=False)
    self.hold(hit.page)
    return hit.page

  def _load(self, hit: PrefixHit, parent: int | None, cache_salt: str | None,
            publish: bool = True) -> int:
    """A fresh page that `hit`'s host copy is loaded into (before the plan's step), findable."""
    page = self._take_fresh()
    self._loads.append((hit.slot, page))
    findable = self.register(page, hit.key, hit.tokens)
    if self.events is not None and publish:
      self.events.stored(page, parent, hit.tokens, cache_salt if parent is None else None,
                         findable, hit.images)
    return page

  def adopt(self, key: bytes, tokens: tuple[int, ...]) -> int | None:
    """A host tier slot for a page that arrives from elsewhere (P/D: kv_handoff.py), whose
    bytes the caller writes; None when the tier has no slot to give."""
    slot, evicted = self.host.put(key, tokens)
    if evicted is not None and self.events is not None:
      self.events.host_dropped(evicted)
    return slot

  def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(saves, loads) since the last call, for the plan being built: the engine runs the saves
    (device page -> host slot), then the loads (host slot -> device page), then the step."""
    copies, self._saves, self._loads = (self._saves, self._loads), [], []
    if self.host is not None:
      self.host.unpin_all()
    return copies

  def _hits(self, token_ids, reuse: bool,
            hits: Sequence[PrefixHit] | None) -> Sequence[PrefixHit]:
    if not reuse:
      return ()
    return self.match_prefix(token_ids) if hits is None else hits

  def append_page(self, table: list[int]) -> bool:
    """Grows `table` by one fresh page; False (and no change) when none is left."""
    if not self.num_free_pages:
      return False
    table.append(self._take_fresh())
    return True

  def take(self) -> int | None:
    """One fresh page, or None when none is left."""
    return self._take_fresh() if self.num_free_pages else None

  def hold(self, page: int) -> None:
    """One more reference to `page` (a cached one leaves the evictable pool)."""
    if self._ref[page] == 0:
      del self._evictable[page]
    self._ref[page] += 1

  def cache_pages(self, table: Sequence[int], token_ids: Sequence[int], start: int, end: int,
                  cache_salt: str | None = None, lora: str | None = None,
                  extras: Sequence[tuple[str, ...]] = ()):
    """Registers pages [start, end) of `table`, now full of the KV of `token_ids`, by hash.

    Pages [0, start) must be registered already (their keys chain into these). If another page
    already holds the same prefix, this one keeps its key for chaining but is not findable.
    """
    if not self.enable_prefix_caching:
      return
    bs = self.page_size
    parent = self._hash[table[start - 1]] if start else root_key(cache_salt, lora)
    for i in range(start, end):
      tokens = tuple(token_ids[i * bs:(i + 1) * bs])
      parent = page_hash(parent, tokens, page_extra(extras, i))
      findable = self.register(table[i], parent, tokens)
      if self.events is not None:
        self.events.stored(table[i], table[i - 1] if i else None, tokens,
                           None if i else cache_salt, findable, page_extra(extras, i))

  def register(self, page: int, key: bytes, tokens: tuple[int, ...]) -> bool:
    """Makes held `page` findable by `key` (unless another page already is); whether it is."""
    if not self.enable_prefix_caching:
      return False
    self._hash[page], self._tokens[page] = key, tokens
    return self._cached.setdefault(key, page) == page

  def free(self, table: Sequence[int]) -> None:
    """Drops one reference to each page of `table`.

    Tail pages go first, so within one sequence the pages furthest from the prompt's start are
    the first evicted: a shorter shared prefix stays useful longer.
    """
    for page in reversed(table):
      self._ref[page] -= 1
      if self._ref[page]:
        continue
      if self._is_findable(page):
        self._evictable[page] = None
        continue
      if self.events is not None and self._hash[page] is not None:
        self.events.dropped(page, evicted=False)
      self._hash[page] = self._tokens[page] = None
      self._free.append(page)

  @property
  def num_held_pages(self) -> int:
    return sum(1 for r in self._ref if r)

  def reset_prefix_cache(self) -> None:
    """Forgets every cached page and the host tier's (vLLM's reset_prefix_cache): no KV computed
    before is found again. Only with no page held (PagePools.reset_prefix_cache checks)."""
    assert not self.num_held_pages, "reset_prefix_cache with pages held"
    for page in self._evictable:
      if self.events is not None:
        self.events.dropped(page, evicted=True)
      self._hash[page] = self._tokens[page] = None
      self._free.append(page)
    self._evictable.clear()
    self._cached.clear()
    for slot in [] if self.host is None else self.host.clear():
      if self.events is not None:
        self.events.host_dropped(slot)

  def _is_findable(self, page: int) -> bool:
    h = self._hash[page]
    return h is not None and self._cached.get(h) == page

  def _take_fresh(self) -> int:
    if self._free:
      page = self._free.popleft()
    else:
      page, _ = self._evictable.popitem(last=False)
      self._save(page)
      del self._cached[self._hash[page]]
      self._hash[page] = self._tokens[page] = None
      self.num_evictions += 1
      if self.events is not None:
        self.events.dropped(page, evicted=True)
    self._ref[page] = 1
    return page

  def _save(self, page: int) -> None:
    """Keeps an evicted page's KV in the host tier, unless it is there already or every slot
    is pinned."""
    if self.host is None:
      return
    key, tokens = self._hash[page], self._tokens[page]
    hit = self.host.find(key, tokens)
    if hit is not None:
      self.host.touch(hit.slot)
      return
    slot, evicted = self.host.put(key, tokens)
    if slot is None:
      return
    self._saves.append((page, slot))
    if self.events is not None:
      if evicted is not None:
        self.events.host_dropped(evicted)
      self.events.saved(page, slot)

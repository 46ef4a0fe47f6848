"""Prefill/decode disaggregation, the host side: a prompt's cached KV pages out of one engine's
prefix cache, and into another's host tier.

A prefill server runs a prompt (and its first token), then exports the pages its prefix cache
keeps for it: every full page but the one holding the prompt's last token (what a prefix hit
can reuse, page_keys.prefix_keys), of each page group (the KV pool, and with window pages the
window pool, whichever of its pages are still cached). A decode server imports them into its
host tier under the keys it computes from the prompt itself (a sender names no key), then
queues the request as any other: its admission finds them there, loads them in one batched
copy and prefills only the rest, so its first token is its own, sampled as without a handoff
(vLLM's NIXL connector also leaves the last tokens to the decode side). Whatever did not arrive
is recomputed: a shorter prefix, or none.

The selection of pages and their import run on the engine thread, between steps
(AsyncRunner.on_engine): the prefix cache is the scheduler's. The bytes move off it: the
engine's `PageStore` (engine/host_kv.py) only dispatches an export's copies there (the caller
reads the bytes on a worker), and a decode server imports pages in batches as they arrive
(`Importer`), so it never holds more than a batch of them.
Imports no jax.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from jaxserve.batching.host_pages import PrefixHit
from jaxserve.batching.page_keys import prefix_keys
from jaxserve.batching.plan import PageStore
from jaxserve.batching.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class Page:
  group: int  # 0 the KV pool, 1 the window pool.
  index: int  # Its page of the prompt: the prefix up to and with it is its key.
  data: bytes


def export_prefix(scheduler: Scheduler, store: PageStore, token_ids: Sequence[int],
                  cache_salt: str | None = None, lora: str | None = None,
                  skip: int = 0) -> Callable[[], list[Page]]:
  """The cached pages of `token_ids`'s prefix, in prompt order: those of the KV pool up to the
  first one not cached, and the window pool's among them that are; none of the first `skip`
  (which the receiver has). Selects them and dispatches their copies; the callable, for a
  worker, gives the pages."""
  found: dict[int, list[tuple[int, PrefixHit]]] = {}
  pools = scheduler.pools.groups
  for index, (key, tokens) in enumerate(prefix_keys(token_ids, scheduler.page_size,
                                                    cache_salt, lora)):
    hits = [pool.find_hit(key, tokens) for pool in pools]
    if hits[0] is None:
      break
    if index < skip:
      continue
    for group, hit in enumerate(hits):
      if hit is not None:
        found.setdefault(group, []).append((index, hit))
  parts = []
  for group, hits in found.items():
    device = [(i, h) for i, h in hits if not h.on_host]
    host = [(i, h) for i, h in hits if h.on_host]
    parts += [(group, device, store.export(group, [h.page for _, h in device])),
              (group, host, store.read(group, [h.slot for _, h in host]))]

  def pages() -> list[Page]:
    out = [Page(g, i, d) for g, hits, data in parts for (i, _), d in zip(hits, data())]
    return sorted(out, key=lambda p: (p.index, p.group))
  return pages


class Importer:
  """Puts one prompt's pages in the host tier of their pools, batch by batch, as they arrive
  (each `add` on the engine thread): each pool takes at most its host tier's size of them
  (more would evict the prompt's own first pages), and none it has already. Nothing is held:
  a page evicted before the request is admitted is recomputed."""

  def __init__(self, scheduler: Scheduler, store: PageStore, token_ids: Sequence[int],
               cache_salt: str | None = None, lora: str | None = None):
    self._pools, self._store = scheduler.pools.groups, store
    self._token_ids, self._cache_salt = token_ids, cache_salt
    self._keys = list(prefix_keys(token_ids, scheduler.page_size, cache_salt, lora))
    self._num_taken = [0] * len(self._pools)

  def add(self, pages: Sequence[Page]) -> int:
    """How many of `pages` it took (none of a group with a page the store refuses: a slot
    whose bytes were never written must not be found)."""
    writes: dict[int, tuple[list[int], list[int], list[bytes]]] = {}
    for page in sorted(pages, key=lambda p: (p.index, p.group)):
      slot = self._adopt(page)
      if slot is not None:
        indices, slots, blobs = writes.setdefault(page.group, ([], [], []))
        indices.append(page.index)
        slots.append(slot)
        blobs.append(page.data)
    return sum(self._write(group, *batch) for group, batch in writes.items())

  def _adopt(self, page: Page) -> int | None:
    """The host slot `page` goes to, or None."""
    if not (0 <= page.group < len(self._pools) and 0 <= page.index < len(self._keys)):
      return None
    pool, (key, tokens) = self._pools[page.group], self._keys[page.index]
    if pool.host is None or pool.find_hit(key, tokens) is not None or (
        self._num_taken[page.group] >= pool.host.num_slots):
      return None
    slot = pool.adopt(key, tokens)
    if slot is not None:
      self._num_taken[page.group] += 1
    return slot

  def _write(self, group: int, indices: list[int], slots: list[int], blobs: list[bytes]) -> int:
    pool = self._pools[group]
    try:
      self._store.write(group, slots, blobs)
    except ValueError:  # A page of the wrong size: none of the batch's is kept.
      for slot in slots:
        pool.host.drop(slot)
      return 0
    if group == 0 and pool.events is not None:  # Routers index the KV pool's pages.
      pool.events.adopted(self._token_ids, list(zip(indices, slots)), self._cache_salt)
    return len(slots)


def import_prefix(scheduler: Scheduler, store: PageStore, token_ids: Sequence[int],
                  pages: Sequence[Page], cache_salt: str | None = None,
                  lora: str | None = None) -> int:
  """`pages` (of `token_ids`'s prefix) in one batch (`Importer`); how many were taken."""
  return Importer(scheduler, store, token_ids, cache_salt, lora).add(pages)


def num_cached(scheduler: Scheduler, token_ids: Sequence[int], cache_salt: str | None = None,
               lora: str | None = None) -> int:
  """How many of `token_ids`'s full pages an admission would reuse now (either tier)."""
  return len(scheduler.pools.match(token_ids, cache_salt, lora))

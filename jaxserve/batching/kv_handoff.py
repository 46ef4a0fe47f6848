"""Prefill/decode disaggregation, the host side: a prompt's cached KV pages out of one engine's
prefix cache, and into another's host tier.

A prefill server runs a prompt (and its first token), then exports the pages its prefix cache
keeps for it: every full page but the one holding the prompt's last token (what a prefix hit
can reuse, kv_pages.prefix_keys), of each page group (the KV pool, and with window pages the
window pool, whichever of its pages are still cached). A decode server imports them into its
host tier under the keys it computes from the prompt itself (a sender names no key), then
queues the request as any other: its admission finds them there, loads them in one batched
copy and prefills only the rest, so its first token is its own, sampled as without a handoff
(vLLM's NIXL connector also leaves the last tokens to the decode side). Whatever did not arrive
is recomputed: a shorter prefix, or none.

Both run on the engine thread, between steps (AsyncRunner.on_engine): the prefix cache is the
scheduler's, and the bytes are read and written by the engine's `PageStore` (engine/host_kv.py).
Imports no jax.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from jaxserve.batching.host_pages import HostHit
from jaxserve.batching.kv_pages import prefix_keys
from jaxserve.batching.scheduler import Scheduler


class PageStore(Protocol):
  """The engine's page bytes: one page of one group is one `bytes` (its arrays' bytes, each
  [L, ...] in order, as `layout` names them)."""

  def layout(self) -> tuple[str, ...]:
    """Each page group's arrays, names, shapes and dtypes: two engines can exchange pages only
    when theirs are equal."""
    ...

  def export(self, group: int, pages: Sequence[int]) -> list[bytes]:
    """Device pages' bytes (waits for the steps dispatched before)."""
    ...

  def read(self, group: int, slots: Sequence[int]) -> list[bytes]:
    """Host tier slots' bytes."""
    ...

  def write(self, group: int, slots: Sequence[int], pages: Sequence[bytes]) -> None:
    """Sets host tier slots' bytes."""
    ...


@dataclasses.dataclass(frozen=True)
class Page:
  group: int  # 0 the KV pool, 1 the window pool.
  index: int  # Its page of the prompt: the prefix up to and with it is its key.
  data: bytes


def export_prefix(scheduler: Scheduler, store: PageStore, token_ids: Sequence[int],
                  cache_salt: str | None = None, lora: str | None = None,
                  skip: int = 0) -> list[Page]:
  """The cached pages of `token_ids`'s prefix, in prompt order: those of the KV pool up to the
  first one not cached, and the window pool's among them that are; none of the first `skip`
  (which the receiver has)."""
  found: dict[int, list[tuple[int, int | HostHit]]] = {}
  pools = _pools(scheduler)
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
  pages = []
  for group, hits in found.items():
    on_device = [(i, h) for i, h in hits if not isinstance(h, HostHit)]
    on_host = [(i, h) for i, h in hits if isinstance(h, HostHit)]
    data = store.export(group, [h for _, h in on_device]) + store.read(
        group, [h.slot for _, h in on_host])
    pages += [Page(group, i, d) for (i, _), d in zip(on_device + on_host, data)]
  return sorted(pages, key=lambda p: (p.index, p.group))


def import_prefix(scheduler: Scheduler, store: PageStore, token_ids: Sequence[int],
                  pages: Sequence[Page], cache_salt: str | None = None,
                  lora: str | None = None) -> int:
  """Puts `pages` (of `token_ids`'s prefix) in the host tier of their pools, but those the
  cache has already; returns how many it took (none of a group with a page the store refuses:
  a slot whose bytes were never written must not be found). Nothing is held: a page evicted
  from the host tier before the request is admitted is recomputed."""
  pools = _pools(scheduler)
  by_index = {(p.group, p.index): p.data for p in pages}
  writes: dict[int, tuple[list[int], list[int], list[bytes]]] = {}
  for index, (key, tokens) in enumerate(prefix_keys(token_ids, scheduler.page_size,
                                                    cache_salt, lora)):
    for group, pool in enumerate(pools):
      data = by_index.get((group, index))
      if data is None or pool.host is None or pool.find_hit(key, tokens) is not None:
        continue
      indices, slots, blobs = writes.setdefault(group, ([], [], []))
      if len(slots) >= pool.host.num_slots:
        continue  # More would evict this prompt's own first pages.
      slot = pool.adopt(key, tokens)
      if slot is not None:
        indices.append(index)
        slots.append(slot)
        blobs.append(data)
  taken = 0
  for group, (indices, slots, blobs) in writes.items():
    try:
      store.write(group, slots, blobs)
    except ValueError:  # A page of the wrong size: none of the group's is kept.
      for slot in slots:
        pools[group].host.drop(slot)
      continue
    taken += len(slots)
    events = pools[group].events
    if group == 0 and events is not None and slots:  # Routers index the KV pool's pages.
      events.adopted(token_ids, list(zip(indices, slots)), cache_salt)
  return taken


def num_cached(scheduler: Scheduler, token_ids: Sequence[int], cache_salt: str | None = None,
               lora: str | None = None) -> int:
  """How many of `token_ids`'s full pages an admission would reuse now (either tier)."""
  return len(scheduler.pools.match(token_ids, cache_salt, lora))


def _pools(scheduler: Scheduler):
  pools = scheduler.pools
  return (pools.full,) if pools.window_pool is None else (pools.full, pools.window_pool)

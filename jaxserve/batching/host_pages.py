"""The host tier of the prefix cache: which pages' KV sits in host memory, findable by key.

A cached device page that is evicted (kv_pages.PageAllocator) is saved here first when the tier
has room, and a later prompt that reaches its key copies it back into a free device page
instead of recomputing it (as vLLM's CPU offloading, SGLang's HiCache and tpu-inference's host
offload keep evicted KV). The tier is inclusive: a page brought back stays here too, so evicting
it from the device again costs no second copy.

This module is the index only: slots 0..num_slots-1 of the engine's host pool, an LRU over
them, and pins. The bytes live in the engine's host pool (engine/host_kv.py), which the plan's
copies fill and read. It also defines the one type of a prefix hit, `PrefixHit`, whose page is
on the device or, in a slot here, on the host. Imports no jax.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class PrefixHit:
  """A cached prefix page, found by its key and tokens: a device page (`page`), or, when its
  page sits in the host tier (`on_host`), a host slot (`slot`) that a copy loads back."""

  key: bytes
  tokens: tuple[int, ...]
  page: int | None = None  # Its device page; None on the host.
  slot: int | None = None  # Its host tier slot; None on the device.
  images: tuple[str, ...] = ()  # The image hashes in its key (for its KV event's extra keys).

  @property
  def on_host(self) -> bool:
    return self.page is None


class HostPages:

  def __init__(self, num_slots: int):
    if num_slots < 1:
      raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
    self.num_slots = num_slots
    self._free = collections.deque(range(num_slots))
    self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first.
    self._slot: dict[bytes, int] = {}  # key -> slot
    self._key: list[bytes | None] = [None] * num_slots
    self._tokens: list[tuple[int, ...] | None] = [None] * num_slots
    self._pinned: set[int] = set()  # Read by a copy not yet handed to the engine.
    self.num_evictions = 0

  @property
  def num_used(self) -> int:
    return len(self._slot)

  def find(self, key: bytes, tokens: tuple[int, ...]) -> PrefixHit | None:
    slot = self._slot.get(key)
    if slot is None or self._tokens[slot] != tokens:  # A guard against collisions.
      return None
    return PrefixHit(key, tokens, slot=slot)

  def touch(self, slot: int) -> None:
    """Marks `slot` most recently used."""
    self._lru.move_to_end(slot)

  def pin(self, slot: int) -> None:
    """Keeps `slot` from eviction until `unpin_all`: a copy of the plan being built reads it."""
    self._pinned.add(slot)
    self.touch(slot)

  def unpin_all(self) -> None:
    self._pinned.clear()

  def put(self, key: bytes, tokens: tuple[int, ...]) -> tuple[int | None, int | None]:
    """A slot for `key` (whose bytes a copy must then write): (slot, the slot's evicted key's
    slot or None), or (None, None) when every slot is pinned."""
    evicted = None
    if self._free:
      slot = self._free.popleft()
    else:
      slot = next((s for s in self._lru if s not in self._pinned), None)
      if slot is None:
        return None, None
      self._drop(slot)
      self._free.remove(slot)
      evicted = slot
      self.num_evictions += 1
    self._slot[key], self._key[slot], self._tokens[slot] = slot, key, tokens
    self._lru[slot] = None
    return slot, evicted

  def clear(self) -> list[int]:
    """Forgets every page; the slots that held one."""
    used = list(self._lru)
    for slot in used:
      self._drop(slot)
    return used

  def drop(self, slot: int) -> None:
    """Forgets `slot`'s page (its bytes could not be written: a failed transfer)."""
    if self._key[slot] is not None:
      self._drop(slot)

  def _drop(self, slot: int) -> None:
    del self._slot[self._key[slot]]
    del self._lru[slot]
    self._key[slot] = self._tokens[slot] = None
    self._free.append(slot)

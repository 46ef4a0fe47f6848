"""Which LoRA adapter sits in which of the engine's adapter slots: a small LRU table.

Slots 1..max_loras hold adapters (0 is the base model). A running request holds a reference to
its adapter's slot from admission to release; a slot nobody references keeps its adapter (a
later request finds it there, with no load) until it is the least recently released one and a
request for another adapter needs a slot. When every slot is referenced, a request for an
adapter not in one waits in the queue (Scheduler._admission) until one is released. The engine
keeps every added adapter's host copy; a load is the plan's (slot, adapter id) pair. No jax.
"""

from __future__ import annotations

import collections


class LoraSlots:

  def __init__(self, num_slots: int):
    self.num_slots = num_slots
    self._slot_of: dict[int, int] = {}  # adapter id -> its slot
    self._id_in = [0] * (num_slots + 1)  # slot -> adapter id (0: empty)
    self._refs = [0] * (num_slots + 1)  # slot -> running requests that use it
    self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first.
    self._empty = list(range(num_slots, 0, -1))  # Popped from the end: slot 1 first.
    self.num_loads = 0
    self.num_evictions = 0

  def slot_of(self, lora_id: int) -> int | None:
    return self._slot_of.get(lora_id)

  def can_take(self, lora_id: int) -> bool:
    """Whether `acquire(lora_id)` would find it a slot now."""
    return lora_id in self._slot_of or bool(self._empty) or bool(self._idle)

  def acquire(self, lora_id: int) -> tuple[int, bool]:
    """(slot, whether the adapter must be loaded into it); one more reference to the slot.
    Evicts the least recently released adapter if no slot is empty. Raises RuntimeError when
    none is free (check can_take first)."""
    slot = self._slot_of.get(lora_id)
    load = slot is None
    if load:
      slot = self._take_slot()
      self._slot_of[lora_id], self._id_in[slot] = slot, lora_id
      self.num_loads += 1
    elif self._refs[slot] == 0:
      del self._idle[slot]
    self._refs[slot] += 1
    return slot, load

  def release(self, slot: int) -> None:
    self._refs[slot] -= 1
    if self._refs[slot] == 0:
      self._idle[slot] = None

  def forget(self, lora_id: int) -> None:
    """The adapter leaves its slot (it was removed): the slot is empty. Raises ValueError while
    a running request uses it."""
    slot = self._slot_of.get(lora_id)
    if slot is None:
      return
    if self._refs[slot]:
      raise ValueError(f"LoRA adapter id {lora_id} is in use by {self._refs[slot]} running "
                       "requests")
    del self._idle[slot], self._slot_of[lora_id]
    self._id_in[slot] = 0
    self._empty.append(slot)

  def _take_slot(self) -> int:
    if self._empty:
      return self._empty.pop()
    if not self._idle:
      raise RuntimeError("every LoRA slot is in use")
    slot, _ = self._idle.popitem(last=False)
    del self._slot_of[self._id_in[slot]]
    self.num_evictions += 1
    return slot

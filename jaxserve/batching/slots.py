"""The engine's decode slots and adapter slots, as the scheduler hands them to requests.

An admitted request takes the lowest free decode slot, and its adapter's slot (lora_slots.py:
loading the adapter when no slot holds it); a request that leaves gives both back. Each plan
tells the engine what changed since the last one: the decode slots freed, and the adapters to
load before the step. No jax.
"""

from __future__ import annotations

import heapq

from jaxserve.batching.lora_slots import LoraSlots
from jaxserve.batching.request import Request


class Slots:

  def __init__(self, num_slots: int, max_loras: int):
    self.free = list(range(num_slots))  # A heap: the lowest free slot is used first.
    # The adapter slots (None: the engine runs no adapters).
    self.loras = LoraSlots(max_loras) if max_loras else None
    self._released: list[int] = []
    self._lora_loads: list[tuple[int, int]] = []  # (adapter slot, adapter id)

  def can_take(self, req: Request) -> bool:
    """A decode slot is free, and an adapter slot for `req`'s adapter (if it has one)."""
    if not self.free:
      return False
    return req.lora is None or self.loras.can_take(req.lora.lora_int_id)

  def take(self, req: Request) -> None:
    req.slot = heapq.heappop(self.free)
    if req.lora is not None:
      req.lora_slot, load = self.loras.acquire(req.lora.lora_int_id)
      if load:
        self._lora_loads.append((req.lora_slot, req.lora.lora_int_id))

  def give_back(self, req: Request) -> None:
    heapq.heappush(self.free, req.slot)
    self._released.append(req.slot)
    req.slot = None
    if req.lora_slot:
      self.loras.release(req.lora_slot)
      req.lora_slot = 0

  def changes(self) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """(decode slots freed, adapter loads) since the last call: the next plan's."""
    released, self._released = tuple(self._released), []
    loads, self._lora_loads = tuple(self._lora_loads), []
    return released, loads

"""The waiting queue: first come first served, or by priority (lower first, FCFS within one).

Both policies are one heap keyed by `order_key`. A preempted request goes back in with its
original arrival number, so it lands ahead of everything that arrived after it: under FCFS that is
the head of the queue, since admission never skips ahead.

Removal (an abort) is O(1): the request's heap entry is only marked dead, and dead entries are
skipped when they reach the top, or all dropped at once when they outnumber the live ones (so
the heap is never more than twice the queue). Aborting 10,000 queued requests used to re-heapify
the whole heap each time: 7.5 s of the engine thread.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from jaxserve.batching.request import Request
from jaxserve.config import QueuePolicy


def order_key(req: Request, policy: QueuePolicy) -> tuple[int, int]:
  """Who goes first (smaller); the running request with the largest key is preempted first."""
  return (req.priority if policy is QueuePolicy.PRIORITY else 0, req.arrival_seq)


class RequestQueue:

  def __init__(self, policy: QueuePolicy = QueuePolicy.FCFS):
    self.policy = policy
    # Entries [priority, arrival, push number, request or None once removed]; the push number
    # breaks ties, so a dead entry is never compared by its request.
    self._heap: list[list] = []
    self._entries: dict[int, list] = {}  # id(request) -> its live entry.
    self._pushes = itertools.count()

  def __len__(self) -> int:
    return len(self._entries)

  def __bool__(self) -> bool:
    return bool(self._entries)

  def __iter__(self) -> Iterator[Request]:
    """In the order they would be popped."""
    return (entry[-1] for entry in sorted(self._entries.values(), key=lambda e: e[:3]))

  def snapshot(self) -> list[Request]:
    """The waiting requests in no order, copied in one step: safe to read on another thread
    (a scrape) while the engine thread pushes and pops."""
    return [entry[-1] for entry in list(self._entries.values())]

  def push(self, req: Request) -> None:
    if id(req) in self._entries:
      raise ValueError(f"request {req.request_id} is queued already")
    entry = [*order_key(req, self.policy), next(self._pushes), req]
    self._entries[id(req)] = entry
    heapq.heappush(self._heap, entry)

  def peek(self) -> Request | None:
    self._drop_dead_top()
    return self._heap[0][-1] if self._heap else None

  def pop(self) -> Request:
    self._drop_dead_top()
    req = heapq.heappop(self._heap)[-1]
    del self._entries[id(req)]
    return req

  def remove(self, req: Request) -> bool:
    """O(1) (amortized), for aborts; returns whether `req` was queued."""
    entry = self._entries.pop(id(req), None)
    if entry is None:
      return False
    entry[-1] = None
    if len(self._heap) > 2 * len(self._entries) + 16:  # Mostly dead: rebuilt in O(live).
      self._heap = list(self._entries.values())
      heapq.heapify(self._heap)
    return True

  def _drop_dead_top(self) -> None:
    while self._heap and self._heap[0][-1] is None:
      heapq.heappop(self._heap)

"""The waiting queue: first come first served, or by priority (lower first, FCFS within one).

Both policies are one heap keyed by `order_key`. A preempted request goes back in with its
original arrival number, so it lands ahead of everything that arrived after it: under FCFS that is
the head of the queue, since admission never skips ahead.
"""

from __future__ import annotations

import heapq
from typing import Iterator

from jaxserve.batching.request import Request
from jaxserve.config import QueuePolicy


def order_key(req: Request, policy: QueuePolicy) -> tuple[int, int]:
  """Who goes first (smaller); the running request with the largest key is preempted first."""
  return (req.priority if policy is QueuePolicy.PRIORITY else 0, req.arrival_seq)


class RequestQueue:

  def __init__(self, policy: QueuePolicy = QueuePolicy.FCFS):
    self.policy = policy
    self._heap: list[tuple[int, int, Request]] = []

  def __len__(self) -> int:
    return len(self._heap)

  def __bool__(self) -> bool:
    return bool(self._heap)

  def __iter__(self) -> Iterator[Request]:
    """In the order they would be popped."""
    return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:2]))

  def push(self, req: Request) -> None:
    heapq.heappush(self._heap, (*order_key(req, self.policy), req))

  def peek(self) -> Request | None:
    return self._heap[0][-1] if self._heap else None

  def pop(self) -> Request:
    return heapq.heappop(self._heap)[-1]

  def remove(self, req: Request) -> bool:
    """O(n), for aborts; returns whether `req` was queued."""
    for i, entry in enumerate(self._heap):
      if entry[-1] is req:
        self._heap[i] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)
        return True
    return False

"""The real engine driven by hand, one chunk or one decode batch per call, for tests that check
its steps without a scheduler. The product has only `Engine.step(plan)`."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxserve.batching.plan import PrefillChunk, StepPlan


def prefill(engine, chunk: PrefillChunk, bitmask: np.ndarray | None = None):
  """A plan of one chunk: its first sampled token ([1]) when it ends its prompt (or scores its
  positions), else None."""
  future = engine.step(StepPlan(prefills=(chunk,)), bitmask)
  return future if chunk.is_last or chunk.prompt_logprob_targets is not None else None


class BySlot:
  """A decode step's samples at their slot's row of [S] arrays (rows of other slots are 0)."""

  def __init__(self, future, slots: Sequence[int], num_slots: int):
    self._future, self._slots, self._num_slots = future, list(slots), num_slots

  def _spread(self, x: np.ndarray) -> np.ndarray:
    full = np.zeros((self._num_slots,) + x.shape[1:], x.dtype)
    full[self._slots] = x
    return full

  def result(self) -> np.ndarray:
    return self._spread(self._future.result())

  def logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(self._spread(x) for x in self._future.logprobs())


def decode(engine, slots: Sequence[int], page_tables: np.ndarray,
           bitmask: np.ndarray | None = None) -> BySlot:
  """A plan of decodes only: [num_slots] tokens, row s for slot s."""
  plan = StepPlan(decode_slots=tuple(slots), page_tables=page_tables)
  return BySlot(engine.step(plan, bitmask), slots, engine.num_slots)

"""One step's results on their way to the host: the `StepFuture` the engine hands back for each
step (batching.plan.StepFuture), whose copies all start when it is made."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxserve.engine.step import StepOutput


class StepFuture:
  """One step's StepOutput on its way to the host: every copy starts now.

  `result()` and `logprobs()` give the plan's samples in its order: one per decode slot, then one
  per prompt that ends in the step; a scoring step's `prompt_logprobs(chunk)` and a verifying
  step's `verified(chunk)` give its chunks' extra results. `chunk_lens`: the plan's chunks'
  lengths, packed back to back in plan order (where a scoring step's positions are).

  Each sample packs its top n = min(SamplingParams.MAX_LOGPROBS, V) entries (sample.py): n is
  read from the packed arrays' width, never assumed to be 20."""

  def __init__(self, out: StepOutput, rows: list[int], chunk_lens: Sequence[int] = ()):
    self._out, self._rows = out, rows
    self._starts = np.cumsum([0, *chunk_lens]).tolist()
    self._host: dict[str, np.ndarray] = {}
    for x in jax.tree.leaves(out):
      x.copy_to_host_async()

  def _take(self) -> np.ndarray:
    if "sampled" not in self._host:
      self._host["sampled"] = np.asarray(self._out.sampled)[self._rows]
    return self._host["sampled"]

  def result(self) -> np.ndarray:
    return self._take()[:, 0].copy()

  def logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chosen [B], top ids [B, n], top logprobs [B, n])."""
    return _unpacked(self._take()[:, 1:])

  def prompt_logprobs(self, chunk: int):
    """(chosen [T], ranks [T], top ids [T, n], top logprobs [T, n]) of the chunk's positions."""
    p = self._out.prompt
    if p is None:
      raise ValueError(f"chunk {chunk} of this step did not ask for prompt logprobs")
    at, end = self._starts[chunk], self._starts[chunk + 1]
    return tuple(np.asarray(x)[at:end] for x in (p.logprobs, p.ranks, p.top_ids, p.top_logprobs))

  def pooled(self, chunk: int) -> np.ndarray:
    """float32 [D] or [C]: plan.prefills[chunk]'s share of its request's pooled vector."""
    if self._out.pooled is None:
      raise ValueError(f"chunk {chunk} of this step pooled nothing")
    if "pooled" not in self._host:
      self._host["pooled"] = np.asarray(self._out.pooled)
    return self._host["pooled"][chunk].copy()

  def verified(self, chunk: int):
    """(accepted a, tokens [k + 1], chosen logprobs [k + 1], top ids [k + 1, n], top logprobs
    [k + 1, n]) of plan.prefills[chunk]: its output is tokens[:a + 1]."""
    if self._out.verified is None:
      raise ValueError(f"chunk {chunk} of this step verified no proposals")
    if "verified" not in self._host:
      self._host["verified"] = np.asarray(self._out.verified)
    row = self._host["verified"][chunk]
    x = row[1:].reshape(-1, self._out.sampled.shape[1])  # pack_sampled's columns, as `sampled`
    return (int(row[0]), x[:, 0].copy(), *_unpacked(x[:, 1:]))


def _unpacked(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """[n, 1 + 2k] int32 (a logprob's bits, k top ids, their logprobs' bits) -> (logprobs [n],
  top ids [n, k], top logprobs [n, k])."""
  n = (x.shape[1] - 1) // 2
  as_float = lambda a: np.ascontiguousarray(a).view(np.float32)
  return as_float(x[:, 0]), x[:, 1:1 + n].copy(), as_float(x[:, 1 + n:])

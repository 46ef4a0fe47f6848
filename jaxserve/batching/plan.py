"""What the scheduler hands the runner each step, and what the runner hands back.

Plain dataclasses with no jax: the scheduler builds a `StepPlan`, the runner executes it on an
`Engine` and reads the sampled tokens back from its `TokenFuture`s; neither reaches into the other.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np

from jaxserve.config import SamplingParams


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
  """Prefill `token_ids` at positions [start_pos, start_pos + len) of one sequence.

  The KV entries of positions [0, start_pos) are already in the pages of `page_table` (an
  earlier chunk or a cached prefix); this chunk writes its own and attends to all of them.
  """

  request_id: str
  slot: int
  token_ids: Sequence[int]
  start_pos: int
  page_table: Sequence[int]  # Covers at least start_pos + len(token_ids) positions.
  # The chunk ends the sequence's prefill: sample its first token and make `slot` decode from it.
  is_last: bool
  sampling: SamplingParams
  seed: int  # The request's seed (drawn by the scheduler when SamplingParams.seed is None).
  # Only read when is_last: the whole sequence, for the penalties' token counts. After a
  # preemption the sequence holds the prompt plus the tokens generated before it.
  prompt_token_ids: Sequence[int] = ()
  output_token_ids: Sequence[int] = ()
  # Set for a request that asked for prompt logprobs: the token after each of token_ids (one
  # fewer on the last chunk, whose next token is sampled). The engine then scores them.
  prompt_logprob_targets: Sequence[int] | None = None


@dataclasses.dataclass(frozen=True)
class StepPlan:
  prefills: Sequence[PrefillChunk] = ()
  # Slots that decode one token this step; each reads its input token and position from the
  # engine's decode state, so planning step n+1 needs no value from step n.
  decode_slots: Sequence[int] = ()
  # [num_slots, width] page tables for decode (rows of idle slots are ignored).
  page_tables: np.ndarray | None = None

  @property
  def is_empty(self) -> bool:
    return not self.prefills and not self.decode_slots


class TokenFuture(Protocol):
  """Sampled tokens on their way to the host (an async device-to-host copy)."""

  def result(self) -> np.ndarray:
    """Blocks until the copy lands; returns int32 token ids."""
    ...


@dataclasses.dataclass(frozen=True)
class EngineInfo:
  """All the host side knows of an engine: its limits and shapes, fixed when it is built."""

  num_slots: int
  page_size: int
  num_pages: int  # Page 0 is the engine's scratch page: the allocator never hands it out.
  max_model_len: int
  max_prefill_len: int  # The largest prefill bucket: no chunk may be longer.
  can_share_pages: bool  # False: sequences cannot share KV pages, so no prefix caching.
  vocab_size: int
  decode_widths: tuple[int, ...]  # Page-table widths decode runs at (config.width_buckets).
  prefill_buckets: tuple[int, ...] = ()
  dtype: str = "float32"


class Engine(Protocol):
  """The device side, as the runner sees it. `jaxserve.engine.engine.Engine` is the real one; the
  tests have a mock whose tokens can be worked out by hand."""

  info: EngineInfo

  def prefill(self, chunk: PrefillChunk, bitmask: np.ndarray | None = None) -> TokenFuture | None:
    """Writes the chunk's KV; when `chunk.is_last`, returns the first sampled token ([1]),
    drawn from the tokens `bitmask` [1, ceil(V/32)] int32 allows (None: any). The runner passes
    a bitmask only for a constrained request, so an engine without constraints may omit it. A
    chunk with prompt_logprob_targets always returns a future, whose `prompt_logprobs()` gives
    (chosen [T], ranks [T], top ids [T, N], top logprobs [T, N]) for its positions."""
    ...

  def decode(self, slots: Sequence[int], page_tables: np.ndarray,
             bitmask: np.ndarray | None = None) -> TokenFuture:
    """One token for each of `slots`; returns [num_slots] tokens (entries of other slots are junk).
    bitmask [len(slots), ceil(V/32)] int32: row i holds the tokens slots[i] may sample (bit t % 32
    of word t // 32); None, or an all-ones row, leaves a slot free."""
    ...

  def free(self, slot: int) -> None:
    """The slot's request left: the slot stops decoding until a prefill refills it."""
    ...

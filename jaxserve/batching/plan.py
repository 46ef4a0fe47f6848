"""What the scheduler hands the engine each step, and what comes back.

Plain dataclasses with no jax. The scheduler builds a `StepPlan` that is final: it fits one
engine call (at most `EngineInfo.max_prefill_len` prefill tokens, at most `max_prefill_seqs`
prompts, one chunk per request, and chunks that score their prompt positions in a prefill-only
plan of their own), and the engine runs it as given. The runner reads the sampled tokens back
from its `StepFuture` and hands them to the scheduler in one call (`Scheduler.update`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Protocol, Sequence

import numpy as np

from jaxserve.batching.images import ImageSpan
from jaxserve.config import PoolingMode, SamplingParams, SpeculativeConfig
from jaxserve.config.vision import VisionConfig


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
  # With window pages (EngineInfo.window): the local layers' table, indexed as page_table; pages
  # no query of this chunk or later can see are 0 (the scratch page).
  window_table: Sequence[int] = ()
  # Speculative decoding: the last num_drafts of token_ids are proposed, not known. The chunk
  # (is_last) is verified: the engine keeps the longest run of proposals the model agrees with
  # plus one token of its own (StepFuture.verified). Its first token and start_pos are read
  # from the slot's decode state, as a decode's are: the host's (its latest token, its worst
  # case start) may be a step behind. With a draft model the proposals are placeholders the
  # engine writes its draft's proposals over. The sampling settings are the slot's too.
  num_drafts: int = 0
  lora_slot: int = 0  # The device slot of the request's LoRA adapter (0: the base model).
  # A pooling request's (SamplingParams.pooling) prompt length, 0 for any other: the engine pools
  # this chunk's positions into the request's vector (StepFuture.pooled), mean pooling weighing
  # each 1 / pool_len; the request's vector is the sum over its chunks.
  pool_len: int = 0
  # The request's images that start before the chunk ends: the engine puts their soft tokens in
  # place of the tokens this chunk holds (images.ImageSpan), and M-RoPE's positions after an
  # image depend on every image before them (mrope.py).
  images: Sequence[ImageSpan] = ()


class StepKind(enum.Enum):
  """What a step computes beside its samples; the engine runs one program per kind and shape."""

  PLAIN = "plain"
  SCORING = "scoring"  # Prefill only: every chunk scores its prompt positions (prompt logprobs).
  VERIFYING = "verifying"  # Chunks verify speculative proposals (PrefillChunk.num_drafts).
  POOLING = "pooling"  # Prefill only: every chunk pools its positions (PrefillChunk.pool_len).

  @classmethod
  def of(cls, chunks: Sequence[PrefillChunk]) -> StepKind:
    """The kind a plan of `chunks` is."""
    if any(ch.num_drafts for ch in chunks):
      return cls.VERIFYING
    if any(ch.prompt_logprob_targets is not None for ch in chunks):
      return cls.SCORING
    if any(ch.pool_len for ch in chunks):
      return cls.POOLING
    return cls.PLAIN


@dataclasses.dataclass(frozen=True)
class StepPlan:
  prefills: Sequence[PrefillChunk] = ()
  # Slots that decode one token this step; each reads its input token and position from the
  # engine's decode state, so planning step n+1 needs no value from step n.
  decode_slots: Sequence[int] = ()
  # [Bs, Pg * W] page tables for decode (rows of idle slots are ignored): each slot's
  # table, then with window pages (Pg = EngineInfo.page_groups = 2) its window table.
  page_tables: np.ndarray | None = None
  # Slots released since the last plan: their requests left. Nothing to do on the real engine
  # (a slot decodes only when a plan lists it); an engine that keeps per-slot state drops it.
  free_slots: Sequence[int] = ()
  # LoRA: each decode slot's adapter slot, parallel to decode_slots (empty: all the base model);
  # and (adapter slot, adapter id) pairs the engine writes before the step runs, so this step
  # and every later one find the adapter there (Engine.add_lora gave it the weights).
  decode_loras: Sequence[int] = ()
  lora_loads: Sequence[tuple[int, int]] = ()
  # The host tier's copies (EngineInfo.num_host_pages), a list per page group (both () when the
  # plan has none), run before the step in this order: (device page, host slot) saves of pages
  # this plan may overwrite, then (host slot, device page) loads of prefix pages its prompts reuse.
  kv_saves: Sequence[Sequence[tuple[int, int]]] = ()
  kv_loads: Sequence[Sequence[tuple[int, int]]] = ()
  kind: StepKind | None = None  # The scheduler's; None: the kind its chunks are (StepKind.of).

  def __post_init__(self):
    kind = StepKind.of(self.prefills)
    if self.kind not in (None, kind):
      raise ValueError(f"a plan of {kind.value} chunks cannot be a {self.kind.value} step")
    object.__setattr__(self, "kind", kind)

  @property
  def is_empty(self) -> bool:
    return not self.prefills and not self.decode_slots

  @property
  def has_work(self) -> bool:
    """Anything for the engine: a step to run, or slots, adapters or pages to move."""
    return not self.is_empty or bool(self.free_slots or self.lora_loads or self.kv_saves
                                     or self.kv_loads)


class StepFuture(Protocol):
  """Sampled tokens on their way to the host (an async device-to-host copy)."""

  def result(self) -> np.ndarray:
    """Blocks until the copy lands; returns int32 token ids."""
    ...

  def logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chosen [n], top ids [n, k], top logprobs [n, k]), rows as result()'s."""
    ...

  def verified(self, chunk: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For plan.prefills[chunk], one with num_drafts: (proposals accepted a, then for each of
    the chunk's positions its token [n + 1], chosen logprob [n + 1], top ids and top logprobs
    [n + 1, k]); the output is tokens[:a + 1]."""
    ...

  def prompt_logprobs(self, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For plan.prefills[chunk], one with prompt_logprob_targets: (chosen [n], ranks [n],
    top ids [n, k], top logprobs [n, k]) of its n positions."""
    ...

  def pooled(self, chunk: int) -> np.ndarray:
    """For plan.prefills[chunk], one with pool_len, in a pooling step: its share of its
    request's vector, float32 [D] (the hidden state) or [C] (PoolingConfig.logit_ids' logits)."""
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
  prefill_buckets: tuple[int, ...] = ()
  dtype: str = "float32"
  max_prefill_seqs: int | None = None  # Prompts one step may prefill (None: any number).
  # Window pages: the local layers' sliding window, whose pages come from a pool of their own
  # (num_window_pages, scratch page included) and are freed once no later query can see them.
  # None: every layer keeps every page.
  window: int | None = None
  num_window_pages: int = 0
  speculative: SpeculativeConfig | None = None  # Set: decode rows may be verified chunks.
  max_loras: int = 0  # LoRA adapter slots (1..max_loras; 0 is the base model). 0: no LoRA.
  max_cpu_loras: int | None = None  # Adapters that may be added at once (None: any number).
  # The prefix cache's host tier: pages each pool may keep in host memory (0: none).
  num_host_pages: int = 0
  pooling: PoolingMode | None = None  # How a pooling engine pools; None: it runs no pooling.
  max_images: int = 0  # Images one prompt may carry (batching/images.Image); 0: text only.
  # A vision-language model's image side (what images.place_images takes); None: text only.
  vision: VisionConfig | None = None

  @property
  def page_groups(self) -> int:
    """Pg: page tables per sequence, 2 with window pages (the pool's, then the window pool's)."""
    return 2 if self.window else 1


class PageStore(Protocol):
  """The engine's page bytes: one page of one group is one `bytes` (its arrays' bytes, each
  [L, ...] in order, as `layout` names them)."""

  def layout(self) -> tuple[str, ...]:
    """Each page group's arrays, names, shapes and dtypes: two engines can exchange pages only
    when theirs are equal."""
    ...

  def page_nbytes(self, group: int) -> int:
    """Bytes of one page of group `group`."""
    ...

  def fingerprint(self) -> str:
    """The weights' fingerprint: pages travel only between engines of the same weights."""
    ...

  def export(self, group: int, pages: Sequence[int]) -> Callable[[], list[bytes]]:
    """Dispatches a copy of device pages; the callable (any thread) gives their bytes."""
    ...

  def read(self, group: int, slots: Sequence[int]) -> Callable[[], list[bytes]]:
    """Copies host tier slots; the callable (any thread) gives their bytes."""
    ...

  def write(self, group: int, slots: Sequence[int], pages: Sequence[bytes]) -> None:
    """Sets host tier slots' bytes."""
    ...


class Engine(Protocol):
  """The device side, as the runner sees it. `jaxserve.engine.engine.Engine` is the real one; the
  tests have a mock whose tokens can be worked out by hand."""

  info: EngineInfo
  page_store: PageStore | None  # Its pages' bytes, for P/D handoffs; None: no host tier.
  sleep_level: int  # 0 awake; 1 its KV cache freed, 2 its weights too: no plan may run.

  def step(self, plan: StepPlan, bitmask: np.ndarray | None = None) -> StepFuture:
    """Runs the whole plan in one call: writes every chunk's KV, decodes every decode slot. The
    future holds one sample per `plan.decode_slots` entry, then one per chunk with `is_last` and
    no drafts, in plan order (a verified chunk's tokens come from `verified`). bitmask
    [samples, ceil(V/32)] int32, rows in that order: the tokens each sample may be (bit t % 32
    of word t // 32); None, or an all-ones row, leaves a sample free. The runner passes one only
    when a sample is constrained, so an engine without constraints may omit it. Only an engine
    whose info.speculative is set gets chunks with drafts. Only an engine whose info.max_loras
    is set gets lora slots and loads, of adapters given to it by `add_lora`."""
    ...

  def add_lora(self, lora_id: int, adapter) -> None:
    """Keeps a host copy of adapter `lora_id` (loading.lora.LoraAdapter) for plans to load."""
    ...

  def remove_lora(self, lora_id: int, slot: int | None = None) -> None:
    """Drops the host copy, and zeros `slot`, the device slot it was in (None: none); no plan
    loads it again until it is added again."""
    ...

  def sleep(self, level: int = 1) -> int:
    """Frees the KV cache (level 1) and the weights too (2) until `wake_up`; the bytes freed."""
    ...

  def wake_up(self) -> None:
    """Back from `sleep`: the same weights, an empty KV cache."""
    ...

  def check_weights(self, params) -> None:
    """Raises ValueError naming the first weight of `params` `update_weights` would refuse."""
    ...

  def update_weights(self, params) -> None:
    """Writes new weights (the model's pure-dict layout) into the engine's, compiling no step
    again; KV computed before is stale from then on."""
    ...

  def update_lora(self, lora_id: int, adapter, slot: int | None = None) -> None:
    """Replaces adapter `lora_id`'s weights: its host copy, and `slot` (None: in no slot)."""
    ...

"""A mock of plan.Engine whose tokens can be worked out by hand, plus a mock tokenizer.

The mock's "KV cache" stores, in each page slot, the token id whose KV would live there. Every
sampled token is `next_token(context)` where the context is read back *through the page table*
from those pages, so a wrong page table, a prefix-cache hit on the wrong page or a missing
recompute after preemption all change the tokens (or trip an assertion on an unwritten page).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from jaxserve.batching.plan import EngineInfo, PrefillChunk, StepPlan


def next_plus_one(context: Sequence[int], vocab_size: int = 1000) -> int:
  """The default model: the last token plus one."""
  return (context[-1] + 1) % vocab_size


def weighted_sum(context: Sequence[int], vocab_size: int = 1000) -> int:
  """A model that depends on every position of the context."""
  return sum((i + 1) * t for i, t in enumerate(context)) % vocab_size


def reference_generate(prompt: Sequence[int], num_tokens: int,
                       next_token: Callable[[Sequence[int]], int] = next_plus_one) -> list[int]:
  """What any correct scheduler must produce: the model applied to its own output, no paging."""
  seq = list(prompt)
  for _ in range(num_tokens):
    seq.append(next_token(seq))
  return seq[len(prompt):]


class MockFuture:

  def __init__(self, tokens: np.ndarray, engine: MockEngine, label: str):
    self._tokens, self._engine, self.label = tokens, engine, label

  def result(self) -> np.ndarray:
    self._engine.events.append(("result", self.label))
    return self._tokens

  def logprobs(self):
    n = len(self._tokens)
    return np.zeros(n, np.float32), np.zeros((n, 20), np.int32), np.zeros((n, 20), np.float32)


class MockEngine:
  page_store = None  # No page bytes to hand over (P/D runs on the real engine only).
  sleep_level = 0  # Always awake: sleep mode is the real engine's (test_training_loop.py).

  def __init__(self, num_slots: int = 4, page_size: int = 4, num_pages: int = 64,
               max_model_len: int = 128, max_prefill_len: int = 16,
               next_token: Callable[[Sequence[int]], int] = next_plus_one,
               window: int | None = None, num_window_pages: int = 0,
               vocab_size: int = 2**31 - 1, num_host_pages: int = 0):
    """`window`: the engine has window pages (EngineInfo.window): every position is written
    through the window table too, and every step checks that the last `window` positions of
    each query read back through it as through the page table. `num_host_pages`: a host tier of
    that many pages a pool, whose copies move the pages' token ids."""
    self.num_slots = num_slots
    self.page_size = page_size
    self.num_pages = num_pages
    self.max_model_len = max_model_len
    self.max_prefill_len = max_prefill_len
    self.can_share_pages = True
    self.info = EngineInfo(num_slots, page_size, num_pages, max_model_len, max_prefill_len,
                           can_share_pages=True, vocab_size=vocab_size,
                           window=window, num_window_pages=num_window_pages,
                           num_host_pages=num_host_pages)
    self.window = window
    self.window_pages = np.full((max(num_window_pages, 1), page_size), -1, np.int64)
    self.next_token = next_token
    self.pages = np.full((num_pages, page_size), -1, np.int64)  # [pages, page_size] token ids
    self.host = [np.full((num_host_pages, page_size), -1, np.int64) for _ in range(2)]
    self.num_saved = self.num_loaded = 0
    self.page_writes = np.zeros(num_pages, np.int64)  # Positions written, per page.
    self.num_prefill_tokens = 0  # Prompt tokens whose KV the engine computed.
    self.num_decode_steps = 0
    self.num_steps = 0  # Engine calls: one per plan.
    self.chunks: list[PrefillChunk] = []
    self.events: list[tuple] = []  # ("prefill", id, start, n) ("decode", slots) ("free", slot) ...
    self._token = [None] * num_slots  # Decode state: the slot's next input token and position.
    self._pos = [None] * num_slots

  def step(self, plan: StepPlan) -> MockFuture:
    """One call for the whole plan: its freed slots, its chunks' KV and first tokens, then its
    decodes. Tokens in the engine's order: one per decode slot, then one per chunk that ends its
    prompt."""
    for slot in plan.free_slots:
      self._free(slot)
    pools = (self.pages, self.window_pages)
    for group, saves in enumerate(plan.kv_saves):  # Saves, then loads, then the step.
      for page, slot in saves:
        self.host[group][slot] = pools[group][page]
        self.num_saved += 1
    for group, loads in enumerate(plan.kv_loads):
      for slot, page in loads:
        assert (self.host[group][slot] >= 0).all(), f"host slot {slot} was never saved"
        pools[group][page] = self.host[group][slot]
        self.num_loaded += 1
    if plan.is_empty:
      return MockFuture(np.zeros(0, np.int32), self, "free")
    self.num_steps += 1
    # The plan is final: it fits one call of an engine with these limits.
    assert len({c.slot for c in plan.prefills}) == len(plan.prefills), "two chunks of one slot"
    assert sum(len(c.token_ids) for c in plan.prefills) <= self.info.max_prefill_len
    assert len(plan.prefills) <= (self.info.max_prefill_seqs or self.num_slots)
    scored = [c.prompt_logprob_targets is not None for c in plan.prefills]
    assert not any(scored) or (all(scored) and not plan.decode_slots), "a mixed scoring plan"
    firsts = [self.prefill(chunk) for chunk in plan.prefills]
    out = []
    if plan.decode_slots:
      tokens = self.decode(plan.decode_slots, plan.page_tables)._tokens
      out = [tokens[s] for s in plan.decode_slots]
    out += [int(f._tokens[0]) for f in firsts if f is not None]
    return MockFuture(np.array(out, np.int32), self, f"step:{self.num_steps}")

  def prefill(self, chunk: PrefillChunk) -> MockFuture | None:
    n = len(chunk.token_ids)
    assert 0 < n <= self.max_prefill_len, n
    assert self._pos[chunk.slot] is None, f"slot {chunk.slot} prefilled while still decoding"
    assert len(chunk.page_table) * self.page_size >= chunk.start_pos + n
    self.events.append(("prefill", chunk.request_id, chunk.start_pos, n))
    self.chunks.append(chunk)
    for i, token in enumerate(chunk.token_ids):
      self._write(chunk.page_table, chunk.start_pos + i, token)
      if self.window:
        self._write(chunk.window_table, chunk.start_pos + i, token, self.window_pages)
    if self.window:
      self._check_window(chunk.page_table, chunk.window_table, chunk.start_pos, chunk.start_pos + n)
    self.num_prefill_tokens += n
    if not chunk.is_last:
      return None
    end = chunk.start_pos + n
    token = self.next_token(self._context(chunk.page_table, end))
    self._token[chunk.slot], self._pos[chunk.slot] = token, end
    return MockFuture(np.array([token], np.int32), self, f"prefill:{chunk.request_id}")

  def decode(self, slots: Sequence[int], page_tables: np.ndarray) -> MockFuture:
    assert page_tables.shape[0] == self.num_slots and page_tables.dtype == np.int32
    self.num_decode_steps += 1
    self.events.append(("decode", tuple(slots)))
    out = np.full(self.num_slots, -1, np.int32)
    for slot in slots:
      pos = self._pos[slot]
      assert pos is not None, f"decode of free slot {slot}"
      assert pos < self.max_model_len
      table = page_tables[slot]
      if self.window:
        table, window_table = table[:len(table) // 2], table[len(table) // 2:]
        self._write(window_table, pos, self._token[slot], self.window_pages)
      self._write(table, pos, self._token[slot])
      if self.window:
        self._check_window(table, window_table, pos, pos + 1)
      out[slot] = self.next_token(self._context(table, pos + 1))
      self._token[slot], self._pos[slot] = int(out[slot]), pos + 1
    return MockFuture(out, self, f"decode:{self.num_decode_steps}")

  def _free(self, slot: int) -> None:
    self.events.append(("free", slot))
    self._token[slot] = self._pos[slot] = None

  def _write(self, table: Sequence[int], pos: int, token: int, pages=None) -> None:
    page = table[pos // self.page_size]
    assert page != 0, f"position {pos} written to the scratch page"
    if pages is not None:  # A window page.
      pages[page, pos % self.page_size] = token
      return
    self.pages[page, pos % self.page_size] = token
    self.page_writes[page] += 1

  def _check_window(self, table, window_table, start: int, end: int) -> None:
    """Queries at [start, end) see positions [start - window + 1, end) through the window table
    as they are through the page table."""
    bs = self.page_size
    for p in range(max(0, start - self.window + 1), end):
      page = window_table[p // bs]
      assert page != 0, f"position {p}, inside the window, is not held in the window table"
      assert self.window_pages[page, p % bs] == self.pages[table[p // bs], p % bs], (
          f"position {p} reads a different token through the window table")

  def _context(self, table: Sequence[int], length: int) -> list[int]:
    bs = self.page_size
    pages = [table[p // bs] for p in range(length)]
    assert 0 not in pages, "attention read the scratch page"
    context = [int(self.pages[b, p % bs]) for p, b in zip(range(length), pages)]
    assert min(context) >= 0, "attention read an unwritten position"
    return context


class MockTokenizer:
  """Token i decodes to `pieces[i]` (default " t<i>"); `eos_id` ends a turn."""

  def __init__(self, pieces: dict[int, str] | None = None, eos_id: int = 999):
    self.pieces = pieces or {}
    self.eos_id = eos_id
    self.stop_ids = frozenset({eos_id})

  def piece(self, i: int) -> str:
    return self.pieces.get(i, f" t{i}")

  def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return "".join(self.piece(i) for i in ids if not (skip_special_tokens and i == self.eos_id))


def assert_all_free(scheduler) -> None:
  """Nothing queued or running, every page back in the pool, every slot free."""
  assert not scheduler.waiting and not scheduler.running
  pages = scheduler.pages
  assert pages.num_free_pages == pages.num_usable_pages
  assert all(pages.ref_count(b) == 0 for b in range(pages.num_pages))
  window = scheduler.window_pages
  if window is not None:
    assert window.num_free_pages == window.num_usable_pages
    assert all(window.ref_count(b) == 0 for b in range(window.num_pages))
  assert sorted(scheduler.slots.free) == list(range(len(scheduler.pools.tables)))

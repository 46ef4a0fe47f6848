"""Continuous batching: each step, pack running requests into the engine's fixed decode slots.

`schedule()` returns the next step's plan from token counters alone (no sampled token value is
needed: decode reads its input token from the engine's device state), so the runner can plan and
dispatch step n+1 while step n is still on the device. One step:

  1. decode: every running request that has finished its prefill decodes one token. A request whose
     next position needs a new page gets one; when none is left, the running request with the
     lowest priority, newest first, is preempted: its pages are freed and it goes back to the head of
     the waiting queue, to recompute its prompt and output tokens later.
  2. prefill: requests part-way through their prefill continue, then waiting requests are admitted
     in queue order while a slot is free and the pool has pages for the whole prompt plus
     `reserve_pages`. Prefill chunks share a budget of `max_num_batched_tokens` tokens and are at
     most `engine.info.max_prefill_len` long. Admission reuses cached prefix pages and prefills the rest.

Imports no jax.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import time

import numpy as np

from jaxserve.batching.kv_pages import PageAllocator
from jaxserve.batching.plan import Engine, PrefillChunk, StepPlan
from jaxserve.batching.request import QueueFull, Request, RequestRejected, RequestStatus
from jaxserve.batching.request_queue import RequestQueue, order_key
from jaxserve.config import SamplingParams, SchedulerConfig


@dataclasses.dataclass(frozen=True)
class ScheduledStep:
  plan: StepPlan
  free_slots: tuple[int, ...]  # Released since the last step: engine.free them before the plan.
  prefill_requests: tuple[Request, ...]  # Parallel to plan.prefills.
  decode_requests: tuple[Request, ...]  # Parallel to plan.decode_slots.


class Scheduler:

  def __init__(self, config: SchedulerConfig, engine: Engine):
    """Reads the engine's shape attributes only; never calls it."""
    self.config = config
    info = engine.info
    self.page_size = info.page_size
    self.max_model_len = info.max_model_len
    self.max_prefill_len = info.max_prefill_len
    self._max_prefill_seqs = info.max_prefill_seqs  # Prompts one step may hold.
    prefix_caching = config.enable_prefix_caching and info.can_share_pages
    self.pages = PageAllocator(info.num_pages, info.page_size, prefix_caching)
    # Window pages: the local layers' pages, in a pool of their own, held only while some query
    # to come can see them (their window); every running request can always get its window's.
    self.window = info.window
    self.window_pages = (PageAllocator(info.num_window_pages, info.page_size, prefix_caching)
                         if self.window else None)
    self.waiting = RequestQueue(config.policy)
    self.running: list[Request] = []  # Sorted by order_key: the last one is preempted first.
    self._free_slots = list(range(info.num_slots))  # A heap: the lowest free slot is used first.
    self._released: list[int] = []
    self._max_pages_per_seq = self.pages.num_pages_for(info.max_model_len)
    self._groups = 2 if self.window else 1  # Each slot's table, then its window table.
    self._tables = np.zeros((info.num_slots, self._groups * self._max_pages_per_seq), np.int32)  # [S, G * W]
    self._decode_widths = info.decode_widths
    self.num_steps = 0
    self.num_prefill_tokens = 0  # Prefill tokens computed (recomputation included).
    self.num_cached_tokens = 0  # Prefill tokens skipped thanks to the prefix cache.
    self.num_decode_tokens = 0
    self.num_preemptions = 0

  @property
  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running)

  def _key(self, req: Request) -> tuple[int, int]:
    return order_key(req, self.config.policy)

  # Requests in and out.

  def check(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
    """Raises RequestRejected for a request that could never run."""
    if num_prompt_tokens <= 0:
      raise RequestRejected("the prompt is empty")
    total = num_prompt_tokens + sampling.max_tokens
    if total > self.max_model_len:
      raise RequestRejected(
          f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({sampling.max_tokens}) is "
          f"{total} tokens, more than the context window of {self.max_model_len}")
    # The last sampled token never has its KV written.
    num_pages = self.pages.num_pages_for(total - 1)
    if num_pages > self.pages.num_usable_pages:
      raise RequestRejected(
          f"the prompt plus max_tokens needs {num_pages} KV pages of {self.page_size} tokens, "
          f"but the pool has only {self.pages.num_usable_pages}")

  def add(self, req: Request) -> None:
    self.check(req.num_prompt_tokens, req.sampling)
    if len(self.waiting) >= self.config.max_queue_len:
      raise QueueFull(f"{len(self.waiting)} requests are waiting already (max_queue_len)")
    self.waiting.push(req)

  def append_token(self, req: Request, token: int) -> None:
    """A token sampled for `req` reached the host."""
    req.all_token_ids.append(token)
    req.num_pending_tokens -= 1
    self._cache_full_pages(req)

  def finish(self, req: Request) -> None:
    self._cache_full_pages(req)
    self._release(req)
    req.status = RequestStatus.FINISHED
    req.epoch += 1

  def abort(self, req: Request) -> None:
    if req.status is RequestStatus.WAITING:
      self.waiting.remove(req)
    elif req.status is RequestStatus.RUNNING:
      self._cache_full_pages(req)
      self._release(req)
    req.status = RequestStatus.ABORTED
    req.epoch += 1

  # One step.

  def schedule(self) -> ScheduledStep:
    self.num_steps += 1
    decodes, num_preempted = self._schedule_decodes()
    # A preemption means memory is short: admitting now would only preempt again.
    chunks, prefill_reqs = self._schedule_prefills(admit=not num_preempted)
    tables = self._decode_page_tables(decodes) if decodes else None
    plan = StepPlan(tuple(chunks), tuple(r.slot for r in decodes), tables)
    released, self._released = tuple(self._released), []
    return ScheduledStep(plan, released, tuple(prefill_reqs), tuple(decodes))

  def _schedule_decodes(self) -> tuple[list[Request], int]:
    decodes, num_preempted = [], 0
    queue = collections.deque(self.running)  # Best first, so victims come off the far end.
    while queue:
      req = queue.popleft()
      num_tokens = len(req.all_token_ids) + req.num_pending_tokens
      # Still prefilling, or every token it may have is sampled already, or constrained and its
      # last token (which its next mask needs) is still in flight (constrained.py).
      if (req.num_computed_tokens < req.num_prefill_tokens or num_tokens >= req.max_num_tokens
          or (req.grammar is not None and req.num_pending_tokens)):
        continue
      while not self._grow(req, num_tokens):
        victim = queue.pop() if queue else req
        self._preempt(victim)
        num_preempted += 1
        if victim is req:
          break
      else:
        # Decode writes the KV of position num_tokens - 1 and samples the next token.
        req.num_computed_tokens = num_tokens
        req.num_pending_tokens += 1
        decodes.append(req)
    self.num_decode_tokens += len(decodes)
    return decodes, num_preempted

  def _grow(self, req: Request, num_tokens: int) -> bool:
    """Gives `req` the pages for positions [0, num_tokens); False when the pool is empty."""
    table = req.page_table
    while len(table) * self.page_size < num_tokens:
      if not self.pages.append_page(table):
        return False
      self._tables[req.slot, len(table) - 1] = table[-1]
    if self.window:
      self._sync_window(req, num_tokens - 1, num_tokens)
    return True

  def _preempt(self, req: Request) -> None:
    self._cache_full_pages(req)  # Its own prefix may still be cached when it comes back.
    self._release(req)
    req.status = RequestStatus.WAITING
    req.num_prefill_tokens = req.num_computed_tokens = req.num_pending_tokens = 0
    req.num_cached_pages = 0
    req.epoch += 1  # Its token in flight is dropped; the recompute samples it again.
    req.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.push(req)

  def _schedule_prefills(self, admit: bool) -> tuple[list[PrefillChunk], list[Request]]:
    budget = self.config.max_num_batched_tokens
    chunks, reqs = [], []
    static = self.config.static_batching
    # The engine's limit on prompts per step (static batching admits its group whole: the engine
    # then runs the plan as several calls).
    cap = None if static else self._max_prefill_seqs
    room = lambda: cap is None or len(set(map(id, reqs))) < cap
    for req in self.running:
      if req.is_prefilling and budget > 0 and room():
        budget = self._add_chunks(req, budget, chunks, reqs)
    # Static batching admits a whole group at once, and only when the last group has finished.
    admit = admit and not (static and self.running)
    while (admit and (budget > 0 or static) and room() and self.waiting
           and self._can_admit(self.waiting.peek())):
      req = self.waiting.pop()
      self._admit(req)
      budget = self._add_chunks(req, budget, chunks, reqs)
    return chunks, reqs

  def _can_admit(self, req: Request) -> bool:
    # The reserve is headroom for other requests' decode; alone, a request may use every page.
    reserve = self.config.reserve_pages if self.running else 0
    return bool(self._free_slots) and self.pages.can_allocate(req.all_token_ids, reserve,
                                                              *self._reuse(req))

  def _reuse(self, req: Request) -> tuple[bool, int | None]:
    """(reuse, max_hits) of `req`'s allocation. Prompt logprobs need every position computed:
    the cache keeps KV, not logits (as vLLM). With window pages a cached prefix is only as good
    as the window pages the window pool still holds for it."""
    reuse = not _wants_prompt_logprobs(req)
    return reuse, self._window_hits(req.all_token_ids) if reuse and self.window else None

  def _window_hits(self, token_ids) -> int:
    """The most leading cached pages a request may reuse with window pages: those whose window
    (the pages its first computed position attends to) the window pool also holds."""
    hits = self.pages.match_prefix(token_ids)
    for n in range(len(hits), 0, -1):
      if all(self._window_page(hits[i], token_ids, i) is not None
             for i in range(self._first_window_page(n * self.page_size), n)):
        return n
    return 0

  def _window_page(self, page: int, token_ids, i: int) -> int | None:
    """The window pool's cached page for page i of `token_ids`, held (or cached) as `page`."""
    return self.window_pages.find(self.pages.key_of(page), self._page_tokens(token_ids, i))

  def _page_tokens(self, token_ids, i: int) -> tuple[int, ...]:
    return tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])

  def _first_window_page(self, position: int) -> int:
    """The first page a local layer's query at `position` attends to."""
    return max(0, position - self.window + 1) // self.page_size

  def _sync_window(self, req: Request, start: int, end: int) -> None:
    """Holds the window pages positions [start, end) attend to, and frees those before them,
    which no later position sees. Held pages are always one run, so the dead ones sit just
    below it."""
    table, first, W = req.window_table, self._first_window_page(start), self._max_pages_per_seq
    table.extend([0] * ((end - 1) // self.page_size + 1 - len(table)))
    i = first - 1
    while i >= 0 and table[i]:
      self.window_pages.free([table[i]])
      table[i] = self._tables[req.slot, W + i] = 0
      i -= 1
    for i in range(first, len(table)):
      if not table[i]:
        page = self.window_pages.take()
        if page is None:  # The pool holds every slot's largest window: never reached.
          raise RuntimeError("the window page pool is exhausted")
        table[i] = self._tables[req.slot, W + i] = page

  def _admit(self, req: Request) -> None:
    reuse, max_hits = self._reuse(req)
    table, num_cached = self.pages.allocate(req.all_token_ids, reuse, max_hits)
    req.slot = heapq.heappop(self._free_slots)
    req.page_table = table
    req.num_prefill_tokens = len(req.all_token_ids)
    req.num_computed_tokens = num_cached
    req.num_cached_pages = num_cached // self.page_size
    if req.num_preemptions == 0:  # A re-admission's hits are its own recomputed tokens.
      req.num_cached_tokens = min(num_cached, req.num_prompt_tokens)
    req.status = RequestStatus.RUNNING
    if req.timings.admitted is None:
      req.timings.admitted = time.monotonic()
    self._tables[req.slot, :len(table)] = table
    if self.window:  # The cached pages' window part, from the window pool.
      n, W = req.num_cached_pages, self._max_pages_per_seq
      req.window_table = [0] * n
      for i in range(self._first_window_page(num_cached), n):
        page = self._window_page(table[i], req.all_token_ids, i)
        req.window_table[i] = self._tables[req.slot, W + i] = page
        self.window_pages.hold(page)
    bisect.insort(self.running, req, key=self._key)
    self.num_cached_tokens += num_cached

  def _add_chunks(self, req: Request, budget: int, chunks: list, reqs: list) -> int:
    """Appends `req`'s next prefill chunks within `budget`; returns the budget left."""
    while budget > 0 and req.is_prefilling:
      start = req.num_computed_tokens
      end = start + min(req.num_prefill_tokens - start, budget, self.max_prefill_len)
      is_last = end == req.num_prefill_tokens
      targets = tuple(req.all_token_ids[start + 1:end + 1]) if _wants_prompt_logprobs(req) else None
      if self.window:
        self._sync_window(req, start, end)
      chunks.append(PrefillChunk(
          req.request_id, req.slot, tuple(req.all_token_ids[start:end]), start,
          tuple(req.page_table), is_last, req.sampling, req.seed,
          prompt_token_ids=req.prompt_token_ids if is_last else (),
          output_token_ids=tuple(req.output_token_ids) if is_last else (),
          prompt_logprob_targets=targets, window_table=tuple(req.window_table)))
      reqs.append(req)
      budget -= end - start
      self.num_prefill_tokens += end - start
      req.num_computed_tokens = end
      req.num_pending_tokens += is_last
      if self.window:  # One chunk a step: a second one's window would free the first's pages.
        break
    self._cache_full_pages(req)
    return budget

  def _cache_full_pages(self, req: Request) -> None:
    """Registers every page whose tokens are known and whose KV write has been dispatched."""
    num_full = min(req.num_computed_tokens, len(req.all_token_ids)) // self.page_size
    if num_full > req.num_cached_pages:
      self.pages.cache_pages(req.page_table, req.all_token_ids, req.num_cached_pages, num_full)
      for i in range(req.num_cached_pages, min(num_full, len(req.window_table))):
        if req.window_table[i]:  # Still held: its local layers' KV is findable too.
          self.window_pages.register(req.window_table[i], self.pages.key_of(req.page_table[i]),
                                     self._page_tokens(req.all_token_ids, i))
      req.num_cached_pages = num_full

  def _release(self, req: Request) -> None:
    self.pages.free(req.page_table)
    req.page_table = []
    if self.window:
      self.window_pages.free([page for page in req.window_table if page])
      req.window_table = []
    self.running.remove(req)
    self._tables[req.slot] = 0
    heapq.heappush(self._free_slots, req.slot)
    self._released.append(req.slot)
    req.slot = None

  def _decode_page_tables(self, decodes: list[Request]) -> np.ndarray:
    """[num_slots, width]: the narrowest width the engine decodes at that holds every table
    (with window pages, [num_slots, 2 * width]: that many columns of both tables)."""
    longest = max(len(r.page_table) for r in decodes)
    width = next(w for w in self._decode_widths if w >= longest)
    S, G = self._tables.shape[0], self._groups
    return self._tables.reshape(S, G, -1)[:, :, :width].reshape(S, G * width)


def _wants_prompt_logprobs(req: Request) -> bool:
  """Asked for, and not delivered yet: once an output token is out, its prompt's logprobs went
  with it, so a preempted request recomputes (and may reuse the cache) like any other."""
  return req.sampling.prompt_logprobs is not None and not req.output_token_ids

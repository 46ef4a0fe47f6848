"""The prefill half of a scheduler step: one chunk for each request part-way through its prompt,
then admissions from the queue while a slot, the pages and the step's budget last. A part of
Scheduler (scheduler.py), kept apart for size, as runner_controls.py is of Runner. Where a chunk
ends and what it carries is chunks.py's. No jax.
"""

from __future__ import annotations

import bisect
import time

from jaxserve.batching.chunks import (
  chunk_end,
  prefill_kind,
  prompt_chunk,
  wants_prompt_logprobs,
)
from jaxserve.batching.host_pages import PrefixHit
from jaxserve.batching.images import page_extras
from jaxserve.batching.plan import PrefillChunk, StepKind
from jaxserve.batching.request import Request, RequestStatus


class Prefills:
  """Scheduler's prefill chunks and admissions; Scheduler gives `config`, `page_size`, `pools`,
  `waiting`, `running`, `slots`, `_budget`, `_max_prefill_seqs`, `_pooling`, `_key`, the
  counters `num_prefill_tokens` and `num_cached_tokens`, and `_cache_full_pages`."""

  def _schedule_prefills(self, admit: bool, kind: StepKind,
                         taken: tuple = ((), ())) -> tuple[list[PrefillChunk], list]:
    """One chunk for each prefilling request (of the plan's kind: chunks.prefill_kind) while the
    budget and the prompts-per-step limit last, then admissions in queue order. Static
    batching admits a whole group at once, and only when the last group has finished; the
    members the step has no room for prefill in the steps after. `taken`: the verified chunks
    (and their requests) already in the plan, which count against both."""
    chunks, reqs = [], []
    budget = self._budget - sum(len(ch.token_ids) for ch in taken[0])
    max_seqs = self._max_prefill_seqs - len(taken[1])
    for req in self.running:
      if (req.is_prefilling and prefill_kind(req) is kind and budget > 0
          and len(reqs) < max_seqs):
        budget = self._add_chunk(req, budget, chunks, reqs)
    static = self.config.static_batching
    admit = admit and not (static and self.running)
    while admit and self.waiting and prefill_kind(self.waiting.peek()) is kind:
      room = budget > 0 and len(reqs) < max_seqs
      hits = self._admission(self.waiting.peek()) if room or static else None
      if hits is None:
        break
      req = self.waiting.pop()
      self._admit(req, hits)
      if room:
        budget = self._add_chunk(req, budget, chunks, reqs)
    return chunks, reqs

  def _admission(self, req: Request) -> list[PrefixHit] | None:
    """The cached pages `req` would reuse if admitted now, or None when it cannot be: no free
    slot, or too few free pages for its whole prompt and the reserve. Prompt logprobs need every
    position computed: the cache keeps KV, not logits (as vLLM), so such a request reuses none."""
    if not self.slots.can_take(req):  # A full adapter table: it waits for one (lora_slots.py).
      return None
    lora = None if req.lora is None else req.lora.cache_key
    every = wants_prompt_logprobs(req) or (req.sampling.pooling
                                           and self._pooling.needs_every_position)
    extras = page_extras(req.images, self.page_size)
    hits = [] if every else self.pools.match(req.all_token_ids, req.cache_salt, lora, extras)
    # The reserve is headroom for other requests' decode; alone, a request may use every page.
    reserve = self.config.reserve_pages if self.running else 0
    return hits if self.pools.can_allocate(req.all_token_ids, hits, reserve) else None

  def _admit(self, req: Request, hits: list[PrefixHit]) -> None:
    self.slots.take(req)
    num_cached = self.pools.allocate(req, req.slot, hits)
    req.num_prefill_tokens = len(req.all_token_ids)
    req.num_computed_tokens = num_cached
    req.num_cached_pages = num_cached // self.page_size
    if req.num_preemptions == 0:  # A re-admission's hits are its own recomputed tokens.
      req.num_cached_tokens = min(num_cached, req.num_prompt_tokens)
    req.status = RequestStatus.RUNNING
    if req.timings.admitted is None:
      req.timings.admitted = time.monotonic()
    bisect.insort(self.running, req, key=self._key)
    self.num_cached_tokens += num_cached

  def _add_chunk(self, req: Request, budget: int, chunks: list, reqs: list) -> int:
    """Appends `req`'s next prefill chunk within `budget`; returns the budget left."""
    start = req.num_computed_tokens
    end = chunk_end(req, start, budget, self._budget)
    if end == start:  # It waits for a step with room for a whole image.
      return budget
    self.pools.hold_window(req, start, end)  # First: the chunk carries the window table.
    chunks.append(prompt_chunk(req, start, end))
    reqs.append(req)
    self.num_prefill_tokens += end - start
    req.num_computed_tokens = end
    req.num_pending_tokens += chunks[-1].is_last
    self._cache_full_pages(req)
    return budget - (end - start)

"""Continuous batching: each step, pack running requests into the engine's fixed decode slots.

`schedule()` returns the next step's plan from token counters alone (no sampled token value is
needed: decode reads its input token from the engine's device state), so the runner can plan and
dispatch step n+1 while step n is still on the device; `update()` takes the step's sampled tokens
back in one call. The plan is final: it fits one engine call, and the engine runs it as given.
One step:

  1. decode: every running request that has finished its prefill decodes one token. A request whose
     next position needs a new page gets one; when none is left, the running request with the
     lowest priority, newest first, is preempted: its pages are freed and it goes back to the head
     of the waiting queue, to recompute its prompt and output tokens later.
  2. prefill: requests part-way through their prefill continue, then waiting requests are admitted
     in queue order while a slot is free and the pool has pages for the whole prompt plus
     `reserve_pages`. Each request prefills at most one chunk a step; the chunks share a budget of
     `max_num_batched_tokens` tokens, capped at the engine's `max_prefill_len` (its largest
     prefill bucket), and at most `max_prefill_seqs` prompts. Admission reuses cached prefix pages
     and prefills the rest (prefills.py).

A request that asks for prompt logprobs is scored by a prefill-only variant of the step, and an
embedding's prompt pooled by another, so their chunks go in plans of their own kind
(chunks.own_turn), taking turns with the ordinary plans.

Pages come from `window_pages.PagePools`: one allocator over the KV pool and, for sliding-window
layers, the window pool. Imports no jax.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from jaxserve.batching import speculative
from jaxserve.batching.chunks import own_turn
from jaxserve.batching.plan import Engine, PrefillChunk, StepKind, StepPlan
from jaxserve.batching.prefills import Prefills
from jaxserve.batching.request import QueueFull, Request, RequestRejected, RequestStatus
from jaxserve.batching.request_queue import RequestQueue, order_key
from jaxserve.batching.slots import Slots
from jaxserve.batching.window_pages import PagePools
from jaxserve.config import SamplingParams, SchedulerConfig


@dataclasses.dataclass(frozen=True)
class ScheduledStep:
  plan: StepPlan
  prefill_requests: tuple[Request, ...]  # Parallel to plan.prefills.
  decode_requests: tuple[Request, ...]  # Parallel to plan.decode_slots.


class Scheduler(Prefills):  # Prefill chunks and admissions: prefills.py.

  def __init__(self, config: SchedulerConfig, engine: Engine):
    """Reads the engine's shape attributes only; never calls it."""
    self.config = config
    info = engine.info
    self.page_size = info.page_size
    self.max_model_len = info.max_model_len
    self.max_prefill_len = info.max_prefill_len
    self._max_prefill_seqs = info.max_prefill_seqs or info.num_slots  # Prompts one step may hold.
    self._budget = min(config.max_num_batched_tokens, info.max_prefill_len)
    self.pools = PagePools(info, config.enable_prefix_caching and info.can_share_pages)
    self.waiting = RequestQueue(config.policy)
    self.running: list[Request] = []  # Sorted by order_key: the last one is preempted first.
    self.slots = Slots(info.num_slots, info.max_loras)  # Decode slots and adapter slots.
    self._own_last: StepKind | None = None  # The last plan's kind, if a prefill-only one.
    # A pooling engine's (None: none); mean and CLS pooling read every position, cached or not.
    self._pooling = info.pooling
    self.num_steps = 0
    self.num_prefill_tokens = 0  # Prefill tokens computed (recomputation included).
    self.num_cached_tokens = 0  # Prefill tokens skipped thanks to the prefix cache.
    self.num_decode_tokens = 0
    self.num_preemptions = 0
    # Speculative decoding (None: off). Not with window pages: a verified run's rollback would
    # need window pages its last query already let go.
    self.speculative = info.speculative if info.window is None else None
    k = self.speculative.num_speculative_tokens if self.speculative else 0
    self.spec_stats = speculative.SpecStats(k)

  @property
  def loras(self):
    """The adapter slots (lora_slots.LoraSlots); None when the engine runs no adapters."""
    return self.slots.loras

  @property
  def pages(self):
    """The KV pool's allocator (the global layers' pool with window pages)."""
    return self.pools.full

  @property
  def window_pages(self):
    """The window pool's allocator; None without window pages."""
    return self.pools.window_pool

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
    if sampling.pooling and self._pooling is None:
      raise RequestRejected("this server generates: embeddings and scores need a pooling "
                            "model (serve --task embed or --task rerank)")
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
    if req.lora is not None and self.loras is None:
      raise RequestRejected(f"LoRA adapter {req.lora.lora_name!r}: this engine runs no adapters "
                            "(max_loras is 0)")
    if len(self.waiting) >= self.config.max_queue_len:
      raise QueueFull(f"{len(self.waiting)} requests are waiting already (max_queue_len)")
    self.waiting.push(req)

  def update(self, samples: Sequence[tuple[Request, int, bool]]) -> None:
    """A step's sampled tokens reached the host: (request, token, finished) for each live
    sample, in the step's order. Appends each token; a finished request leaves."""
    for req, token, finished in samples:
      self._take(req, (token,), finished)

  def update_verified(self, req: Request, tokens: Sequence[int], num_accepted: int,
                      finished: bool) -> None:
    """A verified chunk came back, the first `num_accepted` of its proposals the model's own
    (speculative.settle rolls back the rest). `tokens`: what the runner keeps of them and the
    model's next token (fewer when a stop cut the run)."""
    speculative.settle(req, num_accepted, self.num_steps, self.spec_stats,
                       self.speculative)
    self.num_decode_tokens += num_accepted
    self._take(req, tokens, finished)

  def _take(self, req: Request, tokens: Sequence[int], finished: bool) -> None:
    """The tokens of one sample (one, or a verified run's) reached the host."""
    req.all_token_ids.extend(tokens)
    req.num_pending_tokens -= 1
    self._cache_full_pages(req)
    if finished:
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

  def schedule(self, admit: bool = True) -> ScheduledStep:  # admit False: running ones only.
    self.num_steps += 1
    decodes, chunks, prefill_reqs = [], [], []
    kind = self._own_last = own_turn(self.running, self.waiting if admit else None,
                                     self._own_last)
    if kind is not None:
      chunks, prefill_reqs = self._schedule_prefills(admit=admit, kind=kind)
      self._own_last = kind if chunks else None
    if self._own_last is None:
      decodes, verifies, num_preempted = self._schedule_decodes()
      kind = StepKind.VERIFYING if verifies else StepKind.PLAIN
      chunks, prefill_reqs = [c for c, _ in verifies], [r for _, r in verifies]
      # A preemption means memory is short: admitting now would only preempt again.
      more, more_reqs = self._schedule_prefills(admit=admit and not num_preempted,
                                                kind=StepKind.PLAIN, taken=(chunks, prefill_reqs))
      chunks, prefill_reqs = chunks + more, prefill_reqs + more_reqs
    tables = self.pools.slot_tables() if decodes else None
    released, loads = self.slots.changes()
    decode_loras = tuple(r.lora_slot for r in decodes) if self.loras else ()
    plan = StepPlan(tuple(chunks), tuple(r.slot for r in decodes), tables, released,
                    decode_loras, loads, *self.pools.take_copies(), kind=kind)
    return ScheduledStep(plan, tuple(prefill_reqs), tuple(decodes))

  def _schedule_decodes(self) -> tuple[list[Request], list[tuple[PrefillChunk, Request]], int]:
    """(decodes, verified chunks with their requests, preemptions)."""
    decodes, verifies, num_preempted = [], [], 0
    prompts_wait = bool(self.waiting) or any(r.is_prefilling for r in self.running)
    spec, budget = speculative.step_speculation(
        self.speculative, len(self.running), prompts_wait, self._budget, self._max_prefill_seqs)
    queue = collections.deque(self.running)  # Best first, so victims come off the far end.
    while queue:
      req = queue.popleft()
      num_tokens = len(req.all_token_ids) + req.num_tokens_in_flight  # At most.
      # Still prefilling, or every token it may have is sampled already, or constrained and its
      # last token (which its next mask needs) is still in flight (constrained.py).
      if (req.num_computed_tokens < req.num_prefill_tokens or num_tokens >= req.max_num_tokens
          or (req.grammar is not None and req.num_pending_tokens)):
        continue
      run = speculative.proposal(req, spec, self.num_steps, num_tokens, budget)
      drafts = run.drafts if run else ()
      while not self.pools.grow(req, num_tokens + len(drafts)):
        victim = queue.pop() if queue else req
        self._preempt(victim)
        num_preempted += 1
        if victim is req:
          break
      else:
        # Decode writes the KV of its last token's position (num_tokens - 1 at most) and
        # samples the next token; a verified chunk also writes its proposals' and samples
        # after each.
        req.num_computed_tokens = num_tokens + len(drafts)
        req.num_pending_tokens += 1
        if run:
          verifies.append((speculative.verify_chunk(req, run, num_tokens), req))
          budget[0] -= len(drafts) + 1
          budget[1] -= 1
        else:
          decodes.append(req)
    self.num_decode_tokens += len(decodes) + len(verifies)
    return decodes, verifies, num_preempted

  def _preempt(self, req: Request) -> None:
    self._cache_full_pages(req)  # Its own prefix may still be cached when it comes back.
    self._release(req)
    req.preempted()
    self.num_preemptions += 1
    self.waiting.push(req)

  def _cache_full_pages(self, req: Request) -> None:
    """Registers every page whose tokens are known and whose KV write has been dispatched."""
    num_full = min(req.num_computed_tokens, len(req.all_token_ids)) // self.page_size
    if num_full > req.num_cached_pages:
      self.pools.cache_full_pages(req, num_full)
      req.num_cached_pages = num_full

  def _release(self, req: Request) -> None:
    self.pools.release(req)
    self.running.remove(req)
    self.slots.give_back(req)


"""A prompt's prefill chunks, as the scheduler cuts them: the chunk of a request's positions
[start, end), and whether it scores them (prompt logprobs) or pools them (an embedding). A
verified chunk of proposals is speculative.py's `verify_chunk`. No jax.
"""

from __future__ import annotations

from jaxserve.batching.plan import PrefillChunk, StepKind
from jaxserve.batching.request import Request


def prompt_chunk(req: Request, start: int, end: int) -> PrefillChunk:
  """The chunk of `req`'s positions [start, end), its page tables as they stand: the last one
  of its prompt carries what sampling its first token needs."""
  is_last = end == req.num_prefill_tokens
  targets = tuple(req.all_token_ids[start + 1:end + 1]) if wants_prompt_logprobs(req) else None
  return PrefillChunk(
      req.request_id, req.slot, tuple(req.all_token_ids[start:end]), start,
      tuple(req.page_table), is_last, req.sampling, req.seed,
      prompt_token_ids=req.prompt_token_ids if is_last else (),
      output_token_ids=tuple(req.output_token_ids) if is_last else (),
      prompt_logprob_targets=targets, window_table=tuple(req.window_table),
      lora_slot=req.lora_slot, pool_len=req.num_prompt_tokens if req.sampling.pooling else 0,
      images=tuple(s for s in req.images if s.offset < end))


def chunk_end(req: Request, start: int, budget: int, max_budget: int) -> int:
  """Where `req`'s chunk from `start` ends within `budget`: never inside an image when it can
  be helped, as Gemma 3's image tokens attend to each other both ways (transformers' mask over
  token_type_ids), so a token computed before the rest of its image would see too little.
  The chunk stops before an image it would cut; one that starts at (or inside) such an image
  is put off (`start`: no chunk) to a step with the whole budget. Only an image longer than a
  whole step's budget (`max_budget`) is cut."""
  end = start + min(req.num_prefill_tokens - start, budget)
  for span in req.images:
    if span.offset < end < span.end:
      if span.offset > start:
        return span.offset
      if budget < max_budget and span.end - start <= max_budget:
        return start
  return end


def prefill_kind(req: Request) -> StepKind:
  """The kind of step `req`'s prefill chunks go in: SCORING and POOLING chunks go in plans of
  their own kind (prefill-only, each its own program), every other in a PLAIN one."""
  if wants_prompt_logprobs(req):
    return StepKind.SCORING
  return StepKind.POOLING if req.sampling.pooling else StepKind.PLAIN


def wants_prompt_logprobs(req: Request) -> bool:
  """Asked for, and not delivered yet: once an output token is out, its prompt's logprobs went
  with it, so a preempted request recomputes (and may reuse the cache) like any other."""
  return req.sampling.prompt_logprobs is not None and not req.output_token_ids


def own_turn(running, waiting, last: StepKind | None) -> StepKind | None:
  """The kind of prefill-only plan (SCORING, POOLING) the next step is, or None for a PLAIN one:
  the kind of the first prompt that waits for one (running, then the queue's head), taking turns
  with plain plans (`last`: the kind of the last plan, None when it was plain) while any other
  request has work."""
  head = waiting.peek() if waiting else None
  kinds = [prefill_kind(r) for r in running if r.is_prefilling]
  if head is not None:
    kinds.append(prefill_kind(head))
  own = next((k for k in kinds if k is not StepKind.PLAIN), None)
  others = StepKind.PLAIN in kinds or any(not r.is_prefilling for r in running)
  return None if last is not None and others else own

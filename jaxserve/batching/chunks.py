"""A prompt's prefill chunks, as the scheduler cuts them: the chunk of a request's positions
[start, end), and whether it scores them (prompt logprobs). A verified chunk of proposals is
speculative.py's `verify_chunk`. No jax.
"""

from __future__ import annotations

from jaxserve.batching.plan import PrefillChunk
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
      lora_slot=req.lora_slot)


def wants_prompt_logprobs(req: Request) -> bool:
  """Asked for, and not delivered yet: once an output token is out, its prompt's logprobs went
  with it, so a preempted request recomputes (and may reuse the cache) like any other."""
  return req.sampling.prompt_logprobs is not None and not req.output_token_ids

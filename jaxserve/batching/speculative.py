"""Speculative decoding on the host: n-gram proposals (prompt lookup), when a request may
speculate, and the counts of what was proposed and accepted. With a draft model (method
"draft") the proposals are made on the device, in the step that verifies them
(engine/draft.py): the host sends placeholders, and sizes the run as for n-gram ones.

A request speculates only with all its tokens on the host (the proposal continues its last
one), so it sits out the step after each verification while the tokens come back; a request
whose proposals keep failing stops proposing for a while (request.Backoff) and decodes every
step, as without speculation. Verification (engine/verify.py) keeps each request's tokens
exactly those of decoding one at a time, sampled ones included; a constrained request never
speculates.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxserve.batching.plan import PrefillChunk
from jaxserve.batching.request import Request
from jaxserve.config import SamplingParams, SpeculativeConfig

# What a verified chunk holds in place of the draft model's proposals, which the step writes
# over it: any token id (>= 0, which engine/draft.py counts as a proposal).
DRAFT_PLACEHOLDER = 0


def can_speculate(sampling: SamplingParams) -> bool:
  """Whether this request speculates: asked to (the default), and free text: a grammar's mask
  would have to be checked at each proposed token, so a constrained request never speculates.
  Verification gives any other request exactly the tokens of decoding one at a time
  (engine/verify.py)."""
  return sampling.speculative and sampling.constraint is None


def propose_ngram(tokens: Sequence[int], config: SpeculativeConfig, limit: int) -> list[int]:
  """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
  last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs; at
  most min(k, limit) of them, [] when no n-gram recurs."""
  limit = min(limit, config.num_speculative_tokens)
  L = len(tokens)
  if limit <= 0 or L <= config.prompt_lookup_min:
    return []
  seq = np.asarray(tokens, np.int64)
  for n in range(min(config.prompt_lookup_max, L - 1), config.prompt_lookup_min - 1, -1):
    # [L - n, n]: every earlier window of n tokens (ending before the last token).
    windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
    hits = np.flatnonzero((windows == seq[L - n:]).all(axis=1))
    if hits.size:
      start = int(hits[-1]) + n  # What followed the latest match.
      return seq[start:start + limit].tolist()
  return []


def proposal(req: Request, spec: SpeculativeConfig | None, step: int, num_tokens: int,
             budget: list[int]) -> list[int] | None:
  """The proposals to verify for `req` in scheduler step `step` ([]: decode one token as
  usual), or None: sit this step out, so that its tokens in flight reach the host to propose
  from. budget: [prefill tokens, prefill sequences] left in the step."""
  if req.num_drafts_in_flight:  # Its length after the run is known only when it lands.
    return None
  if spec is None or not can_speculate(req.sampling) or not req.backoff.may_propose(step):
    return []
  if req.num_pending_tokens:
    return None
  # Each accepted proposal and the model's next token are outputs: never past max_tokens (nor
  # the context window, which holds every request's max_tokens).
  limit = min(req.max_num_tokens - num_tokens - 1, budget[0] - 1)
  if budget[1] <= 0 or limit <= 0:  # No room this step: no failure of the proposer's.
    return []
  if spec.method == "draft":
    return [DRAFT_PLACEHOLDER] * min(limit, spec.num_speculative_tokens)
  drafts = propose_ngram(req.all_token_ids, spec, limit)
  if not drafts:
    req.backoff.record(step, 0)
  return drafts


def verify_chunk(req: Request, drafts: list[int]) -> PrefillChunk:
  """The chunk that verifies `drafts`: the last known token, then the proposals, with the
  whole sequence for the sampling settings (plan.PrefillChunk)."""
  req.num_drafts_in_flight = len(drafts)
  return PrefillChunk(
      req.request_id, req.slot, (req.all_token_ids[-1], *drafts), len(req.all_token_ids) - 1,
      tuple(req.page_table), True, req.sampling, req.seed,
      prompt_token_ids=req.prompt_token_ids, output_token_ids=tuple(req.output_token_ids),
      window_table=tuple(req.window_table), num_drafts=len(drafts))


@dataclasses.dataclass
class SpecStats:
  """What speculation proposed and the model accepted, over an engine's life (vLLM's
  spec_decode counters)."""

  num_speculative_tokens: int
  num_drafts: int = 0  # Verified runs.
  num_draft_tokens: int = 0
  num_accepted_tokens: int = 0
  # [k]: how often proposal i (0-based) of a run was accepted.
  accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    self.accepted_per_pos = [0] * self.num_speculative_tokens

  def record(self, num_drafts: int, num_accepted: int) -> None:
    self.num_drafts += 1
    self.num_draft_tokens += num_drafts
    self.num_accepted_tokens += num_accepted
    for i in range(num_accepted):
      self.accepted_per_pos[i] += 1

  @property
  def acceptance_rate(self) -> float:
    return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

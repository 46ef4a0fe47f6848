"""Speculative decoding on the host: n-gram proposals (prompt lookup), when a request may
speculate, and the counts of what was proposed and accepted. With a draft model (method
"draft") the proposals are made on the device, in the step that verifies them
(engine/draft.py): the host sends placeholders, and sizes the run as for n-gram ones.

A request may verify in every step. The step reads a verified chunk's first token and position
from the slot's decode state (engine/step.py), so the host plans it while the request's last
sample (a decode or a verified run) is still in flight, reserving pages and max_tokens room as
if every proposal in flight were accepted. An n-gram proposal then continues a guess of that
sample: its proposals, if they were made for the tokens that did come, and one more token
looked up like the proposals. A wrong guess costs only the proposals: verification keeps the
model's own tokens at the positions that are really there (engine/verify.py). A request whose
measured acceptance says its verified runs cost more than they save pauses its proposals for
a while (acceptance.py) and decodes every step, as without speculation; proposals made on a
wrong guess do not count, nor a lookup that finds nothing (it costs the device nothing, and
is tried again the next step).
Verification keeps each request's tokens exactly those of decoding one at a time, sampled ones
included; a constrained request never speculates.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxserve.batching.plan import PrefillChunk
from jaxserve.batching.request import InFlightRun, Request
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


def propose_ngram(tokens: Sequence[int], config: SpeculativeConfig, limit: int,
                  ahead: int = 0) -> list[int]:
  """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
  last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs; at
  most min(k, limit) + ahead of them, [] when no n-gram recurs.

  A continuation that reaches the sequence's end goes on as a copy of itself (as LZ77 copies
  overlap): a match p tokens back proposes a period of p repeated, so text that repeats a short
  span (a loop, a list's pattern) gets full-length proposals, not the p tokens left before the
  end."""
  limit = min(limit, config.num_speculative_tokens) + ahead
  L = len(tokens)
  if limit <= 0 or L <= config.prompt_lookup_min:
    return []
  seq = np.asarray(tokens, np.int64)
  for n in range(min(config.prompt_lookup_max, L - 1), config.prompt_lookup_min - 1, -1):
    # [L - n, n]: every earlier window of n tokens (ending before the last token).
    windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
    hits = np.flatnonzero((windows == seq[L - n:]).all(axis=1))
    if hits.size:
      start = int(hits[-1]) + n  # What followed the latest match, L - start tokens of it.
      return seq[start + np.arange(limit) % (L - start)].tolist()
  return []


def proposal(req: Request, spec: SpeculativeConfig | None, step: int, num_tokens: int,
             budget: list[int]) -> InFlightRun | None:
  """The run to verify for `req` in scheduler step `step`, or None: decode one token as usual.
  num_tokens: the most tokens it may have once its samples in flight land; budget: [prefill
  tokens, prefill sequences] left in the step."""
  if spec is None or not can_speculate(req.sampling) or not req.acceptance.may_propose(step):
    return None
  # Each accepted proposal and the model's next token are outputs: never past max_tokens (nor
  # the context window, which holds every request's max_tokens).
  limit = min(req.max_num_tokens - num_tokens - 1, budget[0] - 1)
  if budget[1] <= 0 or limit <= 0 or req.num_pending_tokens > 1:  # No room: not a failure.
    return None
  if spec.method == "draft":
    drafts = (DRAFT_PLACEHOLDER,) * min(limit, spec.num_speculative_tokens)
    return InFlightRun(drafts, len(req.all_token_ids), None)
  context, assumed = req.all_token_ids, ()
  if req.num_pending_tokens:  # Guess its sample in flight: one token, after its proposals
    # if those were made for the tokens that did come (then most are accepted).
    if req.runs_in_flight and holds(req, req.runs_in_flight[-1]):
      assumed = req.runs_in_flight[-1].drafts
    context = context + list(assumed)
  ahead = 1 if req.num_pending_tokens else 0
  drafts = propose_ngram(context, spec, limit, ahead)
  if len(drafts) <= ahead:  # No device work lost: the lookup is tried again next step.
    return None
  return InFlightRun(tuple(drafts[ahead:]), len(req.all_token_ids),
                     (*assumed, *drafts[:ahead]))


def holds(req: Request, run: InFlightRun) -> bool:
  """Whether the tokens `run`'s proposals assumed are those that came; asked once every sample
  before the run has landed."""
  return run.guess is None or req.all_token_ids[run.num_known:] == list(run.guess)


def verify_chunk(req: Request, run: InFlightRun, num_tokens: int) -> PrefillChunk:
  """The chunk that verifies `run`'s proposals after the request's last token. The step reads
  that token and its position from the slot's decode state (engine/step.py): the host may not
  have them yet, so the chunk's first token and start are the host's latest and worst case."""
  req.runs_in_flight.append(run)
  return PrefillChunk(
      req.request_id, req.slot, (req.all_token_ids[-1], *run.drafts), num_tokens - 1,
      tuple(req.page_table), True, req.sampling, req.seed,
      window_table=tuple(req.window_table), num_drafts=len(run.drafts), lora_slot=req.lora_slot)



def step_speculation(spec: SpeculativeConfig | None, num_running: int, prompts_wait: bool,
                     budget: int, max_prefill_seqs: int):
  """(the step's SpeculativeConfig, None for none; [prefill tokens, prefill sequences] its
  verified chunks may take). They share the prefill's budget, less one prompt's room while
  prompts wait: a request may verify in every step, so they would take it all, every step."""
  if spec is not None and num_running > (spec.max_batch_size or num_running):
    spec = None  # A large batch: every request decodes (SpeculativeConfig).
  return spec, [budget, max_prefill_seqs - prompts_wait]

def settle(req: Request, num_accepted: int, step: int, stats: SpecStats,
           spec: SpeculativeConfig) -> None:
  """`req`'s oldest verified run came back, `num_accepted` of its proposals the model's own:
  the positions past those roll back (their KV is never read, and rewritten by the tokens that
  do come there), and the counts take the run."""
  run = req.runs_in_flight.pop(0)
  num_drafts = len(run.drafts)
  req.num_computed_tokens -= num_drafts - num_accepted
  if holds(req, run):  # Proposals made on a wrong guess say nothing of the proposer.
    req.acceptance.record(step, num_drafts, num_accepted, spec.num_speculative_tokens,
                          spec.cost)
  stats.record(num_drafts, num_accepted)
  req.num_draft_tokens += num_drafts
  req.num_accepted_tokens += num_accepted

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

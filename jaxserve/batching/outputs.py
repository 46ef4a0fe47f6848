"""A request's sampled tokens turned into its outputs: text, finish reason, logprobs.

`Outputs` holds what each live request has produced so far (its incremental text and stop
checks, its prompt logprobs as the scoring chunks bring them) and makes one `RequestOutput` a
token, the last one naming why the request finished. It never tells the scheduler: the runner
hands the step's tokens to `Scheduler.update` in one call, after making their outputs here.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from jaxserve.batching.constrained import Constraints
from jaxserve.batching.plan import StepFuture
from jaxserve.batching.request import FinishReason, Request, RequestOutput, TokenLogprobs
from jaxserve.batching.stop import Detokenizer, OutputText


class Outputs:

  def __init__(self, tokenizer: Any, detokenizer: Callable[[Any, Sequence[int]], Detokenizer],
               constraints: Constraints):
    """`tokenizer` has `.stop_ids`; `detokenizer(tokenizer, prompt_ids)` makes a request's
    incremental detokenizer; `constraints` follow each constrained request's tokens."""
    self._tokenizer, self._detokenizer, self._constraints = tokenizer, detokenizer, constraints
    self._texts: dict[str, OutputText] = {}
    # Requests that asked for prompt logprobs: one entry per prompt position, filled as their
    # prefill chunks come back, handed out with the first output.
    self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
    # Pooling requests' vectors, their chunks' shares summed as they come back (a chunk from
    # position 0 starts it afresh: a preempted request computes its prompt again).
    self._pooled: dict[str, np.ndarray] = {}

  def start(self, req: Request) -> None:
    detokenizer = self._detokenizer(self._tokenizer, req.prompt_token_ids)
    self._texts[req.request_id] = OutputText(detokenizer, req.sampling, self._tokenizer.stop_ids)
    if req.sampling.prompt_logprobs is not None:
      self._prompt_logprobs[req.request_id] = [None] * req.num_prompt_tokens

  def end(self, req: Request) -> None:
    del self._texts[req.request_id]
    self._prompt_logprobs.pop(req.request_id, None)
    self._pooled.pop(req.request_id, None)

  def token(self, req: Request, token: int, now: float,
            logprobs: tuple[TokenLogprobs, ...] | None, ahead: int = 0) -> RequestOutput:
    """The output of `req`'s next token, the scheduler not told yet; `ahead`: tokens of the
    same verified run before it, not told the scheduler either."""
    timings = req.timings
    timings.token_times.append(now)
    if timings.first_token is None:
      timings.first_token = now
    out = self._texts[req.request_id]
    if token in out.stop_token_ids:  # Its text is never shown.
      req.stop_reason = token
      if req.grammar is not None:  # An end the grammar engine forced is not an answer's end.
        req.constraint_error = self._constraints.error(req)
      return self.last(req, FinishReason.STOP, out.finish(), now, (token,), logprobs, ahead)
    if req.grammar is not None:
      self._constraints.accept(req, token)
    text = out.add((token,))
    if out.stop_string is not None:
      req.stop_reason = out.stop_string
      return self.last(req, FinishReason.STOP, text, now, (token,), logprobs, ahead)
    if len(req.all_token_ids) + ahead + 1 >= req.max_num_tokens:  # max_tokens, or the window.
      return self.last(req, FinishReason.LENGTH, text + out.finish(), now, (token,), logprobs,
                       ahead)
    return RequestOutput(req.request_id, (token,), text, None, timings, logprobs,
                         self._first_prompt_logprobs(req, ahead))

  def last(self, req: Request, reason: FinishReason, text: str, now: float,
           token_ids: tuple[int, ...] = (),
           logprobs: tuple[TokenLogprobs, ...] | None = None, ahead: int = 0) -> RequestOutput:
    """A request's last output; the runner retires it once the scheduler has let it go."""
    req.finish_reason = reason
    req.timings.finish = now
    return RequestOutput(req.request_id, token_ids, text, reason, req.timings, logprobs,
                         self._first_prompt_logprobs(req, ahead),
                         self._pooled.pop(req.request_id, None))

  def verified(self, req: Request, verified, now: float) -> RequestOutput:
    """One output for a verified run's tokens (StepFuture.verified), cut at the first that
    finishes the request."""
    accepted, tokens, chosen, top_ids, top_logprobs = verified
    num_top, outs = req.sampling.logprobs, []
    for i, token in enumerate(tokens[:accepted + 1].tolist()):
      logprobs = None
      if num_top:
        logprobs = (TokenLogprobs(float(chosen[i]), tuple(top_ids[i, :num_top].tolist()),
                                  tuple(top_logprobs[i, :num_top].tolist())),)
      outs.append(self.token(req, token, now, logprobs, ahead=i))
      if outs[-1].finished:
        break
    return _joined(outs)

  def store_prompt(self, req: Request, future: StepFuture, chunk: int, start: int,
                   length: int) -> None:
    """What plan chunk `chunk` (`req`'s positions [start, start + length)) computed of its
    prompt: its share of a pooling request's vector, or its prompt logprobs."""
    if not req.sampling.pooling:
      self.store_prompt_logprobs(req, future.prompt_logprobs(chunk), start, length)
      return
    share, pooled = future.pooled(chunk), self._pooled.get(req.request_id)
    self._pooled[req.request_id] = share if start == 0 or pooled is None else pooled + share

  def store_prompt_logprobs(self, req: Request, arrays, start: int, length: int) -> None:
    """Position start + 1 + i is scored by chunk row i; the last chunk's last row scores the
    sampled token, whose logprobs come with it."""
    chosen, ranks, top_ids, top_logprobs = arrays
    num_top, entries = req.sampling.prompt_logprobs, self._prompt_logprobs[req.request_id]
    for i in range(min(length, req.num_prompt_tokens - 1 - start)):
      entries[start + 1 + i] = TokenLogprobs(
          float(chosen[i]), tuple(top_ids[i, :num_top].tolist()),
          tuple(top_logprobs[i, :num_top].tolist()), int(ranks[i]))

  def _first_prompt_logprobs(self, req: Request, ahead: int = 0):
    """The prompt's logprobs, on the request's first output (None on later ones)."""
    if req.num_output_tokens + ahead == 0:  # The scheduler appends this output's token after.
      return self._prompt_logprobs.pop(req.request_id, None)
    return None


def token_logprobs(arrays, row: int, num_top: int) -> tuple[TokenLogprobs, ...] | None:
  """Row `row` of StepFuture.logprobs() arrays, cut to the request's top `num_top`; None when
  the request asked for none."""
  if not num_top:
    return None
  chosen, top_ids, top_logprobs = arrays
  return (TokenLogprobs(float(chosen[row]), tuple(top_ids[row, :num_top].tolist()),
                        tuple(top_logprobs[row, :num_top].tolist())),)


def _joined(outs: Sequence[RequestOutput]) -> RequestOutput:
  """The outputs of one verified run's tokens as one (several tokens in one stream event)."""
  if len(outs) == 1:
    return outs[0]
  first, last = outs[0], outs[-1]
  logprobs = None if first.logprobs is None else tuple(lp for o in outs for lp in o.logprobs)
  return RequestOutput(first.request_id, tuple(t for o in outs for t in o.token_ids),
                       "".join(o.text for o in outs), last.finish_reason, last.timings, logprobs,
                       first.prompt_logprobs)

"""/v1/completions responses ("text_completion" objects and stream events), on
openai_format.ResponseFormat: a choice's text and logprobs, with `echo` its prompt's before them,
with vLLM's prompt_logprobs the prompt's top tokens by id.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from jaxserve.api.openai_format import ResponseFormat, json_logprob
from jaxserve.api.openai_request import Request
from jaxserve.serving.requests import Chunk, TokenLogprobs
from jaxserve.serving.service import Service


class CompletionFormat(ResponseFormat):
  """With `echo`, each choice's text and logprobs start with its prompt's (the prompt's first
  token has no logprob: null); with vLLM's prompt_logprobs, a choice also carries them by id."""

  object_name = chunk_object_name = "text_completion"
  id_prefix = "cmpl"

  def __init__(self, service: Service, request: Request | None = None):
    super().__init__(service, request)
    self._offsets: dict[int, int] = {}  # Per choice: the text_offset of its next token.
    # Per prompt: its echo (text, logprobs) and the text_offset after it, built once for its n
    # choices (their prompt logprobs are the same prompt's).
    self._echoes: dict[int, tuple[str, Any, int]] = {}

  def whole_choice(self, index, chunks):
    head = self._echo(index, chunks[0])  # First: the prompt's tokens come first in text_offset.
    return self._join(super().whole_choice(index, self._shown(chunks)), head, chunks[0])

  def delta(self, chunk, index=0):
    first = index not in self._offsets
    head = self._echo(index, chunk) if first else None
    self._offsets.setdefault(index, 0)
    event = super().delta(self._shown([chunk])[0], index)
    event["choices"][0] = self._join(event["choices"][0], head, chunk if first else None)
    return event

  def _shown(self, chunks: Sequence[Chunk]) -> list[Chunk]:
    """echo with max_tokens 0: the one token generated to get the prompt's logprobs is hidden."""
    if not self._request.hide_generated:
      return list(chunks)
    return [Chunk(c.request_id, "", (), None if c.logprobs is None else (), c.finish_reason,
                  c.record, c.prompt_token_ids, c.prompt_logprobs) for c in chunks]

  def _echo(self, index: int, first: Chunk) -> tuple[str, Any] | None:
    """The prompt's text and logprobs that come before choice `index`'s own (echo)."""
    req = self._request
    if not req.echo:
      return None
    if index // req.n in self._echoes:
      text, logprobs, self._offsets[index] = self._echoes[index // req.n]
      return text, logprobs
    prompt = req.every_input[index // req.n].prompt
    text = prompt.text
    if text is None:
      text = self._service.tokenizer.detokenize(first.prompt_token_ids, skip_special_tokens=False)
    logprobs = None
    if req.want_logprobs and first.prompt_logprobs is not None:
      num_top = req.input.logprobs
      logprobs = self._logprobs(index, first.prompt_token_ids, [
          lp and TokenLogprobs(lp.logprob, lp.top_ids[:num_top], lp.top_logprobs[:num_top], lp.rank)
          for lp in first.prompt_logprobs])
    self._echoes[index // req.n] = text, logprobs, self._offsets.get(index, 0)
    return text, logprobs

  def _join(self, choice: dict, head: tuple[str, Any] | None, first: Chunk | None) -> dict:
    if head is not None:
      text, logprobs = head
      choice["text"] = text + choice["text"]
      if logprobs is not None:
        own = choice["logprobs"] or {k: [] for k in logprobs}
        choice["logprobs"] = {k: logprobs[k] + own[k] for k in logprobs}
    num_top = self._request.prompt_logprobs
    if first is not None and num_top is not None and first.prompt_logprobs is not None:
      choice["prompt_logprobs"] = [lp and self._by_id(t, lp, num_top) for t, lp in
                                   zip(first.prompt_token_ids, first.prompt_logprobs)]
    return choice

  def _by_id(self, token_id: int, lp: TokenLogprobs, num_top: int) -> dict[str, Any]:
    """vLLM's shape: the prompt token and the top `num_top`, by id, with their ranks."""
    entry = lambda p, rank, i: {"logprob": p, "rank": rank, "decoded_token": self._token(i)}
    out = {i: entry(p, r, i) for r, (i, p) in enumerate(zip(lp.top_ids[:num_top],
                                                             lp.top_logprobs[:num_top]), 1)}
    out[token_id] = entry(lp.logprob, lp.rank, token_id)
    return out

  def _choice(self, index, text, logprobs, finish_reason, whole):
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

  def _logprobs(self, index, token_ids, logprobs):
    tokens = [self._token(t) for t in token_ids]
    start = self._offsets.get(index, 0)
    offsets = list(itertools.accumulate((len(t) for t in tokens), initial=start))
    self._offsets[index] = offsets[-1]
    chosen = [lp and json_logprob(lp.logprob) for lp in logprobs]
    return {"tokens": tokens, "token_logprobs": chosen,
            "top_logprobs": [lp and self._top(t, lp) for t, lp in zip(tokens, logprobs)],
            "text_offset": offsets[:-1]}

  def _top(self, token: str, lp: TokenLogprobs) -> dict[str, float]:
    top = {self._token(i): json_logprob(p) for i, p in zip(lp.top_ids, lp.top_logprobs)}
    if lp.rank is not None:  # A prompt token is shown beside the likeliest ones, as in vLLM.
      top.setdefault(token, json_logprob(lp.logprob))
    return top

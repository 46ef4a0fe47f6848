"""Service chunks in the OpenAI API's JSON shapes: whole responses, and stream events.

`CompletionFormat` writes /v1/completions objects ("text_completion"), `ChatFormat` writes
/v1/chat/completions ones ("chat.completion" and "chat.completion.chunk").
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Sequence

from jaxserve.serving.metrics import RequestRecord
from jaxserve.text.constraint_vocab import spelling_bytes
from jaxserve.batching.request import FinishReason, TokenLogprobs
from jaxserve.serving.service import Chunk, Service

FINISH_REASONS = {None: None, FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "abort"}


def usage(record: RequestRecord) -> dict[str, Any]:
  return {"prompt_tokens": record.num_prompt_tokens,
          "completion_tokens": record.num_output_tokens,
          "total_tokens": record.num_prompt_tokens + record.num_output_tokens,
          "prompt_tokens_details": {"cached_tokens": record.num_cached_tokens}}


class _Format:
  """What both endpoints share: the id, the time stamp and the model of one response."""

  object_name: str
  chunk_object_name: str
  id_prefix: str

  def __init__(self, service: Service):
    self._service = service
    self.id = f"{self.id_prefix}-{secrets.token_hex(12)}"
    self.created = int(time.time())

  def _token(self, token_id: int) -> str:
    return self._service.tokenizer.detokenize([token_id], skip_special_tokens=False)

  def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": self.id, "object": object_name, "created": self.created,
            "model": self._service.model_name, "choices": choices}

  def usage_event(self, last: Chunk) -> dict[str, Any]:
    return {**self._envelope(self.chunk_object_name, []), "usage": usage(last.record)}

  def whole(self, chunks: Sequence[Chunk]) -> dict[str, Any]:
    last = chunks[-1]
    text = "".join(c.text for c in chunks)
    logprobs = None
    if any(c.logprobs is not None for c in chunks):
      logprobs = self._logprobs([t for c in chunks for t in c.token_ids],
                                [lp for c in chunks for lp in c.logprobs or ()])
    choice = self._choice(text, logprobs, FINISH_REASONS[last.finish_reason], whole=True)
    return {**self._envelope(self.object_name, [choice]), "usage": usage(last.record)}

  def delta(self, chunk: Chunk) -> dict[str, Any]:
    logprobs = None
    if chunk.logprobs is not None:
      logprobs = self._logprobs(chunk.token_ids, chunk.logprobs)
    choice = self._choice(chunk.text, logprobs, FINISH_REASONS[chunk.finish_reason], whole=False)
    return self._envelope(self.chunk_object_name, [choice])

  def start(self) -> list[dict[str, Any]]:
    return []

  def _choice(self, text: str, logprobs: Any, finish_reason: str | None, whole: bool) -> dict:
    raise NotImplementedError

  def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> Any:
    raise NotImplementedError


class CompletionFormat(_Format):
  object_name = chunk_object_name = "text_completion"
  id_prefix = "cmpl"

  def _choice(self, text, logprobs, finish_reason, whole):
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

  def __init__(self, service: Service):
    super().__init__(service)
    self._text_offset = 0  # Characters of the token texts so far: the next token's text_offset.

  def _logprobs(self, token_ids, logprobs):
    tokens = [self._token(t) for t in token_ids]
    offsets = []
    for token in tokens:
      offsets.append(self._text_offset)
      self._text_offset += len(token)
    return {"tokens": tokens, "text_offset": offsets,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._token(i): p for i, p in zip(lp.top_ids, lp.top_logprobs)}
                             for lp in logprobs]}


class ChatFormat(_Format):
  object_name = "chat.completion"
  chunk_object_name = "chat.completion.chunk"
  id_prefix = "chatcmpl"

  def start(self):
    # OpenAI's first event names the role, with empty content.
    return [self._envelope(self.chunk_object_name, [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}])]

  def _choice(self, text, logprobs, finish_reason, whole):
    if whole:
      return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
              "finish_reason": finish_reason}
    delta = {"content": text} if text or finish_reason is None else {}
    return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

  def _logprobs(self, token_ids, logprobs):
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
      token = self._token(token_id)
      return {"token": token, "logprob": logprob, "bytes": list(self._bytes(token_id, token))}

    return {"content": [
        {**entry(t, lp.logprob),
         "top_logprobs": [entry(i, p) for i, p in zip(lp.top_ids, lp.top_logprobs)]}
        for t, lp in zip(token_ids, logprobs)]}

  def _bytes(self, token_id: int, token: str) -> bytes:
    if "\ufffd" not in token:
      return token.encode()
    # Part of a multi-byte character: its text is U+FFFD, its own bytes are in its spelling.
    return spelling_bytes(self._service.tokenizer.id_to_token(token_id))

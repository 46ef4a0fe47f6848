"""Service chunks in the OpenAI API's JSON shapes: whole responses, and stream events.

`ChatFormat` writes /v1/chat/completions objects ("chat.completion" and
"chat.completion.chunk"), openai_completion_format.CompletionFormat /v1/completions ones
("text_completion"), both on `ResponseFormat`. A response holds one
choice per (prompt, n) pair, each from its own stream of chunks; `index` tells them apart.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any, Sequence

from jaxserve.api.openai_request import Request
from jaxserve.serving.metrics import RequestRecord
from jaxserve.serving.requests import Chunk, FinishReason, TokenLogprobs
from jaxserve.serving.service import Service
from jaxserve.text import tool_calls
from jaxserve.text.constraint_vocab import spelling_bytes

FINISH_REASONS = {None: None, FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "abort"}


def json_logprob(value: float) -> float:
  """A logprob as the JSON reply carries it: at least -9999.0 (vLLM's floor). A token the
  processed logprobs mode reports as removed (config.LogprobsMode) is -inf, which JSON has no
  word for: json.dumps would write -Infinity, which strict parsers refuse."""
  return max(value, -9999.0)


def usage(records: Sequence[RequestRecord], per_prompt: int = 1,
          hide_generated: bool = False) -> dict[str, Any]:
  """`records` in choice order, `per_prompt` runs of each prompt: a prompt counts once."""
  firsts = records[::per_prompt]
  prompt = sum(r.num_prompt_tokens for r in firsts)
  completion = 0 if hide_generated else sum(r.num_output_tokens for r in records)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion,
          "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens for r in firsts)}}


class ResponseFormat:
  """What both endpoints share: the id, the time stamp and the model of one response."""

  object_name: str
  chunk_object_name: str
  id_prefix: str

  def __init__(self, service: Service, request: Request | None = None):
    self._service = service
    self._request = request or Request(None)
    self.id = f"{self.id_prefix}-{secrets.token_hex(12)}"
    self.created = int(time.time())
    self._spellings: dict[int, str] = {}  # Logprobs name the same top tokens again and again.
    named = self._request.input.model if self._request.input is not None else ""
    self._model = named or service.model_name  # The adapter's name, for a LoRA request.

  def _token(self, token_id: int) -> str:
    text = self._spellings.get(token_id)
    if text is None:
      text = self._spellings[token_id] = self._service.tokenizer.detokenize(
          [token_id], skip_special_tokens=False)
    return text

  def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": self.id, "object": object_name, "created": self.created,
            "model": self._model, "choices": choices}

  def usage(self, records: Sequence[RequestRecord]) -> dict[str, Any]:
    return usage(records, self._request.num_runs, self._request.hide_generated)

  def usage_event(self, records: Sequence[RequestRecord]) -> dict[str, Any]:
    return {**self._envelope(self.chunk_object_name, []), "usage": self.usage(records)}

  def whole(self, runs: Sequence[tuple[int, Sequence[Chunk]]],
            records: Sequence[RequestRecord]) -> dict[str, Any]:
    """runs: (index, chunks) of each returned choice; records: of every run, in choice order."""
    choices = [self.whole_choice(index, chunks) for index, chunks in runs]
    return {**self._envelope(self.object_name, choices), "usage": self.usage(records)}

  def whole_choice(self, index: int, chunks: Sequence[Chunk]) -> dict[str, Any]:
    text = "".join(c.text for c in chunks)
    logprobs = None
    if any(c.logprobs is not None for c in chunks):
      logprobs = self._logprobs(index, [t for c in chunks for t in c.token_ids],
                                [lp for c in chunks for lp in c.logprobs or ()])
    return self._choice(index, text, logprobs, FINISH_REASONS[chunks[-1].finish_reason], whole=True)

  def delta(self, chunk: Chunk, index: int = 0) -> dict[str, Any]:
    logprobs = None
    if chunk.logprobs is not None:
      logprobs = self._logprobs(index, chunk.token_ids, chunk.logprobs)
    choice = self._choice(index, chunk.text, logprobs, FINISH_REASONS[chunk.finish_reason],
                          whole=False)
    return self._envelope(self.chunk_object_name, [choice])

  def start(self, indices: Sequence[int] = (0,)) -> list[dict[str, Any]]:
    return []

  def _choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None,
              whole: bool) -> dict:
    raise NotImplementedError

  def _logprobs(self, index: int, token_ids: Sequence[int],
                logprobs: Sequence[TokenLogprobs | None]) -> Any:
    raise NotImplementedError


class ChatFormat(ResponseFormat):
  """With tools (tool_choice other than "none"), a choice's text is read as tool calls: a whole
  message gets `tool_calls` (content null), and a stream ends with one delta carrying every call,
  whole, as OpenAI's clients accumulate them. With tool_choice "auto" the content streams as it
  is generated, only text that may begin a call held back (tool_calls.CallStream); a forced
  call's JSON is held back whole."""

  object_name = "chat.completion"
  chunk_object_name = "chat.completion.chunk"
  id_prefix = "chatcmpl"

  def __init__(self, service: Service, request: Request | None = None):
    super().__init__(service, request)
    self._held: dict[int, str] = {}  # Per choice: the text a tool call may be in.
    self._streams: dict[int, tool_calls.CallStream] = {}  # Per choice, with tool_choice "auto".

  def whole_choice(self, index, chunks):
    choice = super().whole_choice(index, chunks)
    calls = self._tool_calls(choice["message"]["content"], chunks[-1].finish_reason)
    if calls is not None:
      content, calls = calls
      choice["message"] = {"role": "assistant", "content": content,
                           "tool_calls": [_strip_index(c) for c in calls]}
      choice["finish_reason"] = self._calls_finish
    return choice

  def delta(self, chunk, index=0):
    if self._request.tool_choice == "none":
      return super().delta(chunk, index)
    if self._request.tool_choice == "auto":
      return self._auto_delta(chunk, index)
    text = self._held[index] = self._held.get(index, "") + chunk.text
    event = super().delta(dataclasses.replace(chunk, text=""), index)
    choice = event["choices"][0]
    if chunk.finish_reason is not None:
      calls = self._tool_calls(text, chunk.finish_reason)
      if calls is None:
        choice["delta"] = {"content": text} if text else {}
      else:
        content, calls = calls
        choice["delta"] = ({"content": content, "tool_calls": calls} if content
                           else {"tool_calls": calls})
        choice["finish_reason"] = self._calls_finish
    return event

  def _auto_delta(self, chunk: Chunk, index: int) -> dict[str, Any]:
    stream = self._streams.setdefault(index, tool_calls.CallStream(self._request.tool_names))
    text = stream.add(chunk.text)
    event = super().delta(dataclasses.replace(chunk, text=text), index)
    if chunk.finish_reason is not None:
      held, calls = stream.finish()
      content, choice = text + held, event["choices"][0]
      choice["delta"] = {"content": content} if content else {}
      if calls:
        choice["delta"]["tool_calls"] = self._openai_calls(calls)
        choice["finish_reason"] = self._calls_finish
    return event

  @property
  def _calls_finish(self) -> str:
    return "stop" if self._request.tool_choice == "named" else "tool_calls"  # As OpenAI.

  def _tool_calls(self, text: str, finish: FinishReason | None):
    """(content, OpenAI's tool_calls) of a choice's text; None when it holds no call."""
    mode = self._request.tool_choice
    if mode == "none":
      return None
    if mode == "auto":
      content, calls = tool_calls.parse_tagged(text, self._request.tool_names)
    else:  # Forced: the output is the calls' JSON, unless max_tokens or a stop string cut it.
      content, calls = None, tool_calls.parse_forced(text) if finish is FinishReason.STOP else None
    if not calls:
      return None
    return content or None, self._openai_calls(calls)

  def _openai_calls(self, calls: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    return [{"index": i, "id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": name, "arguments": args}} for i, (name, args) in enumerate(calls)]

  def start(self, indices=(0,)):
    # OpenAI's first event names the role, with empty content.
    return [self._envelope(self.chunk_object_name, [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}]) for i in indices]

  def _choice(self, index, text, logprobs, finish_reason, whole):
    if whole:
      return {"index": index, "message": {"role": "assistant", "content": text},
              "logprobs": logprobs, "finish_reason": finish_reason}
    delta = {"content": text} if text or finish_reason is None else {}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

  def _logprobs(self, index, token_ids, logprobs):
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
      token = self._token(token_id)
      return {"token": token, "logprob": json_logprob(logprob),
              "bytes": list(self._bytes(token_id, token))}

    return {"content": [
        {**entry(t, lp.logprob),
         "top_logprobs": [entry(i, p) for i, p in zip(lp.top_ids, lp.top_logprobs)]}
        for t, lp in zip(token_ids, logprobs)]}

  def _bytes(self, token_id: int, token: str) -> bytes:
    if "\ufffd" not in token:
      return token.encode()
    # Part of a multi-byte character: its text is U+FFFD, its own bytes are in its spelling.
    return spelling_bytes(self._service.tokenizer.id_to_token(token_id))


def _strip_index(call: dict[str, Any]) -> dict[str, Any]:
  """A whole message's tool call has no index (only stream deltas do)."""
  return {k: v for k, v in call.items() if k != "index"}

"""The serving core both front ends call (gRPC in api/grpc_api.py, HTTP in api/http_api.py).

One request, in the order it happens:

  Service.generate: tokenize -> check fields (gateway) -> admit (the key's rate limits)
    -> AsyncRunner.submit (the engine thread takes it before its next step)
    -> outputs, grouped into chunks of `chunk_tokens` tokens -> a RequestRecord at the end
       (metrics, the log line, usage and timings for the client, the key's token count)

A front end authenticates the caller first and maps `ApiError.status` to its own codes. Every
error is raised before the first chunk, except an engine failure. When the consumer stops early
(a client cancels or disconnects), the generator's cleanup aborts the request: the engine thread
drops it before its next step, and its slot and pages are free again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator, Mapping, NamedTuple, Sequence

from absl import logging

# FinishReason and TokenLogprobs are fields of a Chunk: the front ends take them from here.
from jaxserve.batching.request import (
  FinishReason,
  QueueFull,
  Request,
  RequestOutput,
  RequestRejected,
  TokenLogprobs,
)
from jaxserve.batching.stream import AsyncRunner, EngineDead, RequestStream
from jaxserve.config import SamplingParams
from jaxserve.serving import gateway
from jaxserve.serving.constraint_gate import ConstraintGate
from jaxserve.serving.gateway import ApiError, ApiKey, Status
from jaxserve.serving.metrics import Metrics, RequestRecord
from jaxserve.text import tool_calls


@dataclasses.dataclass(frozen=True)
class Prompt:
  """Exactly one of: text (encoded as is), token ids, or chat messages."""

  text: str | None = None
  token_ids: Sequence[int] | None = None
  messages: Sequence[Mapping[str, Any]] | None = None
  # With messages: the functions offered to the model (OpenAI's definitions), through the chat
  # template when it takes them, else in a system message (text/tool_calls.py).
  tools: Sequence[Mapping[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class GenerateInput:
  prompt: Prompt
  sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # SamplingParams fields.
  max_tokens: int | None = None  # None: what the context window leaves, or default_max_tokens.
  # At most this many when max_tokens is None (OpenAI's completions: 16); None: no such cap.
  default_max_tokens: int | None = None
  logprobs: int | None = None  # None: none; n: the chosen token's and the top n.
  chunk_tokens: int = 1
  request_id: str | None = None
  priority: int = 0
  model: str = ""  # Empty, or the served model's name.
  truncate_prompt: bool = False
  cache_salt: str | None = None  # vLLM's: only requests of one salt share cached pages.


@dataclasses.dataclass(frozen=True)
class Chunk:
  request_id: str
  text: str
  token_ids: Sequence[int]
  logprobs: Sequence[TokenLogprobs] | None  # Cut to the top n the client asked for.
  finish_reason: FinishReason | None
  record: RequestRecord | None  # On the last chunk: usage and timings.
  prompt_token_ids: Sequence[int] = ()  # The ids the request ran (for echo).
  # On the first chunk, when the sampling asked for prompt_logprobs: one per prompt token
  # (None for the first), cut to that many top entries.
  prompt_logprobs: Sequence[TokenLogprobs | None] | None = None


class Prepared(NamedTuple):
  """A checked request, ready to queue."""

  prompt_ids: Sequence[int]
  sampling: SamplingParams
  tokenize_s: float  # Seconds spent tokenizing.
  chunk_tokens: int


class Service:

  def __init__(self, runner: AsyncRunner, tokenizer: Any, model_name: str,
               gateway_: gateway.Gateway, metrics: Metrics, log_prompts: bool = False):
    self.runner = runner
    self.tokenizer = tokenizer
    self.model_name = model_name
    self.gateway = gateway_
    self.metrics = metrics
    self.log_prompts = log_prompts
    self.refusing: str | None = None  # Why new requests get UNAVAILABLE (draining, a dead engine).
    self._active: set[RequestStream] = set()
    self._cut: set[str] = set()  # Requests abort_all ended: their clients get UNAVAILABLE.
    self._idle = asyncio.Event()
    self._idle.set()
    self.engine_info = info = runner.engine_info
    self.vocab_size = info.vocab_size
    self.max_model_len = info.max_model_len
    # Longer text cannot fit the context whatever its tokens: it is refused (or cut) before the
    # tokenizer spends seconds on it, on the event loop every other request shares.
    self.max_prompt_chars = self.max_model_len * tokenizer.max_token_chars
    self.constraint_gate = ConstraintGate(runner.runner.constraints)

  def model_info(self) -> dict[str, Any]:
    """The fields of the proto's ModelInfo."""
    info = self.engine_info
    return dict(name=self.model_name, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                num_slots=info.num_slots, prefill_buckets=list(info.prefill_buckets),
                page_size=info.page_size, num_pages=info.num_pages, dtype=info.dtype,
                has_chat_template=self.tokenizer.chat_template is not None,
                stop_token_ids=sorted(self.tokenizer.stop_ids))

  def check_model(self, model: str) -> None:
    if model and model != self.model_name:
      raise ApiError(Status.NOT_FOUND,
                     f"model {model!r} is not served here; this server runs {self.model_name!r}")

  def encode(self, prompt: Prompt, truncate: bool = False, add_special_tokens: bool | None = None,
             add_generation_prompt: bool = True) -> list[int]:
    """The prompt's ids; `truncate`: text too long for the context is cut to its tail first.
    `add_special_tokens`: the BOS of text (None: the tokenizer's default; chat never: the
    template writes its own); `add_generation_prompt`: chat ends with the assistant's turn."""
    given = [x for x in (prompt.text, prompt.token_ids, prompt.messages) if x is not None]
    if len(given) != 1:
      raise gateway.invalid("prompt: give exactly one of text, token ids or chat messages")
    if prompt.token_ids is not None:
      return self._checked_ids(prompt.token_ids, truncate)
    if prompt.text is not None:
      ids = self.tokenizer.encode(self._within_reach(prompt.text, truncate), add_special_tokens)
      if prompt.text and not ids:  # "\x16": characters the vocabulary has no token for.
        raise gateway.invalid("prompt is empty once tokenized: the tokenizer drops every "
                              "character of it")
      return ids
    # OpenAI's new name for the system role, from either front end.
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in prompt.messages]
    if prompt.tools and not self.tokenizer.takes_tools:
      offer = tool_calls.system_prompt(prompt.tools)
      if messages[0]["role"] == "system":
        messages = [{**messages[0], "content": offer + "\n\n" + messages[0]["content"]},
                    *messages[1:]]
      else:
        messages = [{"role": "system", "content": offer}, *messages]
    try:
      text = self.tokenizer.apply_chat_template(
          messages, add_generation_prompt,
          tools=prompt.tools if prompt.tools and self.tokenizer.takes_tools else None)
    except ValueError as e:  # It names the message and field that are wrong.
      raise gateway.invalid(str(e)) from e
    return self.tokenizer.encode(self._within_reach(text, truncate), add_bos=False)

  def _checked_ids(self, ids: Sequence[int], truncate: bool) -> list[int]:
    # The length first: checking 2M ids one by one holds the event loop for 0.2 s, and ids that
    # cannot fit are refused (or cut) whatever they are.
    room = self.max_model_len - 1  # At least one output token.
    if len(ids) > room:
      if not truncate:
        raise gateway.invalid(
            f"prompt: {len(ids):,} token ids cannot fit in the context window of "
            f"{self.max_model_len} tokens; shorten it, or set truncate_prompt to keep its end")
      ids = ids[len(ids) - room:]
    ids = list(ids)
    gateway.check_token_ids(ids, self.vocab_size, "prompt token_ids")
    return ids

  def _within_reach(self, text: str, truncate: bool) -> str:
    if len(text) <= self.max_prompt_chars:
      return text
    if truncate:  # The tail holds at least max_model_len tokens: all that truncation keeps.
      return text[-self.max_prompt_chars:]
    raise gateway.invalid(
        f"prompt: {len(text):,} characters cannot fit in the context window of "
        f"{self.max_model_len} tokens (at most {self.max_prompt_chars:,} characters with this "
        "tokenizer); shorten it, or set truncate_prompt to keep its end")

  def prepare(self, inp: GenerateInput) -> Prepared:
    """Every check of one request, whichever front end parsed it: the one entry point. Raises an
    ApiError naming the bad field (the scheduler still refuses what the KV pool cannot hold)."""
    self._check_accepting()
    self.check_model(inp.model)
    gateway.check_request_id(inp.request_id or "")
    chunk_tokens = gateway.check_chunk_tokens(inp.chunk_tokens)
    gateway.check_stop_token_ids(inp.sampling.get("stop_token_ids"), self.vocab_size)
    start = time.monotonic()
    ids = self.encode(inp.prompt, inp.truncate_prompt)
    tokenize = time.monotonic() - start
    ids, max_tokens = gateway.fit_to_context(ids, inp.max_tokens, self.max_model_len,
                                             inp.truncate_prompt, inp.default_max_tokens)
    sampling = gateway.sampling_params(inp.sampling, max_tokens, inp.logprobs)
    gateway.check_bias_ids(sampling, self.vocab_size)
    return Prepared(ids, sampling, tokenize, chunk_tokens)

  async def compile_constraint(self, key: ApiKey, sampling: SamplingParams):
    """The last check of a constrained request, off the event loop: its grammar is compiled (or
    found in the cache) within the key's compile budget (serving/constraint_gate.py), and a
    schema, regex or grammar the engine refuses is INVALID_ARGUMENT naming the problem, before
    anything is queued. Returns the grammar (None without a constraint)."""
    return await self.constraint_gate.compile_async(key.name, sampling)

  async def generate(self, key: ApiKey, inp: GenerateInput,
                     prepared: Prepared | None = None) -> AsyncIterator[Chunk]:
    """`prepared`: `prepare(inp)`'s result when the caller has it already (the n runs of one
    prompt share one: its tokenization, template and checks are done once)."""
    received = time.monotonic()
    ids, sampling, tokenize, chunk_tokens = prepared or self.prepare(inp)
    stream, lease = await self._submit(key, inp, ids, sampling)
    self._active.add(stream)
    self._idle.clear()
    num_out, reason, failed = 0, None, False
    try:
      async for outputs in self._chunks(stream, chunk_tokens, lease):
        num_out += sum(len(o.token_ids) for o in outputs)
        reason = outputs[-1].finish_reason
        record = None
        if reason is not None:
          record = self._record(stream, key, reason, received, tokenize, num_out, lease)
        if reason is FinishReason.ABORT and stream.request_id in self._cut:
          raise ApiError(Status.UNAVAILABLE, "the server shut down before this request finished "
                         f"({num_out} tokens generated); retry on another replica")
        yield _chunk(stream.request, outputs, inp.logprobs, record)
    except ApiError:
      failed = True
      raise
    finally:
      self._release(stream)
      if reason is None:  # The consumer left before the end (a cancel, a disconnect).
        stream.abort()
        if not failed:
          self._record(stream, key, FinishReason.ABORT, received, tokenize, num_out, lease)

  async def _submit(self, key: ApiKey, inp: GenerateInput, ids: Sequence[int],
                    sampling: SamplingParams) -> tuple[RequestStream, gateway.Lease]:
    """Admits the request under the key's limits, then hands it to the engine thread; a request
    the engine refuses gives the key its tokens back."""
    grammar = await self.compile_constraint(key, sampling)
    lease = self.gateway.admit(key, len(ids), sampling.max_tokens,
                               can_shorten=inp.max_tokens is None)
    if lease.max_tokens < sampling.max_tokens:  # Cut to the key's tokens left this minute.
      sampling = dataclasses.replace(sampling, max_tokens=lease.max_tokens)
    try:
      stream = self.runner.submit(ids, sampling, inp.request_id or None, inp.priority,
                                  self.gateway.cache_salt(key, inp.cache_salt), grammar)
    except (RequestRejected, ValueError) as e:  # Too big for the KV pool; a request id in use.
      lease.refund()
      raise gateway.invalid(str(e)) from e
    except EngineDead as e:  # It died a moment ago; `refusing` is about to say so.
      lease.refund()
      raise ApiError(Status.UNAVAILABLE, "the engine failed; the server is restarting") from e
    return stream, lease

  def _release(self, stream: RequestStream) -> None:
    """Forgets an ended (or abandoned) stream; the last one out wakes `wait_idle`."""
    self._active.discard(stream)
    self._cut.discard(stream.request_id)
    if not self._active:
      self._idle.set()

  async def _chunks(self, stream: RequestStream, chunk_tokens: int,
                    lease: gateway.Lease) -> AsyncIterator[list[RequestOutput]]:
    """The stream's outputs in groups of `chunk_tokens` tokens (the last group may be short)."""
    group, num_tokens, first = [], 0, True
    try:
      async for out in stream:
        if first:
          self.metrics.prompt_tokens.inc(stream.request.num_prompt_tokens)
          first = False
        group.append(out)
        num_tokens += len(out.token_ids)
        self.metrics.generation_tokens.inc(len(out.token_ids))
        if out.finished or num_tokens >= chunk_tokens:
          yield group
          group, num_tokens = [], 0
    except QueueFull as e:
      lease.refund()
      raise ApiError(Status.RESOURCE_EXHAUSTED, f"the queue is full: {e}") from e
    except RuntimeError as e:
      logging.exception("request %s failed in the engine", stream.request_id)
      raise ApiError(Status.INTERNAL, "the engine failed; see the server log") from e

  def _record(self, stream: RequestStream, key: ApiKey, reason: FinishReason, received: float,
              tokenize: float, num_out: int, lease: gateway.Lease) -> RequestRecord:
    record = RequestRecord.of(stream.request, key.name, reason, received, tokenize,
                              time.monotonic())
    lease.settle(num_out)
    self.metrics.observe(record)
    if self.log_prompts:
      logging.info("request %s prompt: %r", stream.request_id,
                   self.tokenizer.detokenize(stream.request.prompt_token_ids))
    return record

  def _check_accepting(self) -> None:
    if self.refusing is not None:
      raise ApiError(Status.UNAVAILABLE, self.refusing)

  # Draining.

  @property
  def num_active(self) -> int:
    return len(self._active)

  async def wait_idle(self, timeout: float) -> bool:
    """Waits for every open request to end; False if some are still open after `timeout`."""
    try:
      await asyncio.wait_for(self._idle.wait(), timeout)
      return True
    except asyncio.TimeoutError:
      return False

  def abort_all(self) -> None:
    """Ends every open request, running or waiting: each client gets UNAVAILABLE."""
    for stream in list(self._active):
      self._cut.add(stream.request_id)
      stream.abort()


def _chunk(request: Request, outputs: Sequence[RequestOutput], num_top: int | None,
           record: RequestRecord | None) -> Chunk:
  logprobs = None
  if num_top is not None:
    logprobs = [dataclasses.replace(lp, top_ids=lp.top_ids[:num_top],
                                    top_logprobs=lp.top_logprobs[:num_top])
                for o in outputs for lp in (o.logprobs or ())]
  prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None),
                         None)
  return Chunk(request.request_id, "".join(o.text for o in outputs),
               [t for o in outputs for t in o.token_ids], logprobs, outputs[-1].finish_reason,
               record, request.prompt_token_ids, prompt_logprobs)

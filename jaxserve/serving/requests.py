"""What the serving core takes and gives: a request's input (Prompt, GenerateInput), its
preparation (Prepared, Run), its chunks of output (Chunk), and the request while the service
holds it (Accepted: the drain waits for it, and can cut it); and the port a decode server's
prompts get their KV through (PrefillPeer)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Awaitable, Callable, Mapping, NamedTuple, Protocol, Sequence

# FinishReason and TokenLogprobs are fields of a Chunk: the front ends take them from here.
from jaxserve.batching.images import Image, ImageSpan
from jaxserve.batching.request import FinishReason, Request, TokenLogprobs
from jaxserve.batching.stream import AsyncRunner, RequestStream
from jaxserve.config import SamplingParams
from jaxserve.serving.gateway import ApiError, ApiKey, Lease, Status
from jaxserve.serving.media import ImageSource
from jaxserve.serving.metrics import RequestRecord
from jaxserve.serving.work_pool import WorkPool


class PrefillPeer(Protocol):
  """P/D's port on the serving side: a decode server's prefill server, which brings a request's
  prompt KV into this engine's pages before it is queued (api/kv_transfer.KVPeer supplies it over
  gRPC)."""

  async def fetch(self, runner: AsyncRunner, req: Request) -> int:
    """The pages imported (0: none; the prompt is then prefilled here)."""


@dataclasses.dataclass(frozen=True)
class Prompt:
  """Exactly one of: text (encoded as is), token ids, or chat messages."""

  text: str | None = None
  token_ids: Sequence[int] | None = None
  messages: Sequence[Mapping[str, Any]] | None = None
  # With messages: the functions offered to the model (OpenAI's definitions), through the chat
  # template when it takes them, else in a system message (text/tool_calls.py).
  tools: Sequence[Mapping[str, Any]] | None = None
  # The images of the messages' {"type": "image"} parts, in order, as the client sent them:
  # decoded by Service.prepare (serving/media.py) into Prepared.images.
  images: Sequence[ImageSource] = ()


@dataclasses.dataclass(frozen=True)
class GenerateInput:
  """The one request shape from the front ends in: each builds it once per prompt, from its
  wire format (api/openai_request.py, api/grpc_api.generate_input); Service.prepare checks it
  and decides its max_tokens (client_fields.fit_to_context)."""

  prompt: Prompt
  sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # SamplingParams fields.
  max_tokens: int | None = None  # None: what the context window leaves, or default_max_tokens.
  # At most this many when max_tokens is None (OpenAI's completions: 16); None: no such cap.
  default_max_tokens: int | None = None
  logprobs: int | None = None  # None: none; n: the chosen token's and the top n.
  chunk_tokens: int = 1
  request_id: str | None = None
  priority: int = 0
  model: str = ""  # Empty, the served model's name, or a LoRA adapter's (serving/adapters.py).
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
  pooled: Any = None  # On a pooling request's last chunk: RequestOutput.pooled.


class Prepared(NamedTuple):
  """A checked prompt, ready to run."""

  prompt_ids: Sequence[int]
  sampling: SamplingParams
  tokenize_s: float  # Seconds spent tokenizing.
  chunk_tokens: int
  lora: Any = None  # The LoRARequest the prompt runs under (its `model`); None: the base model.
  images: tuple[Image, ...] = ()  # The prompt's images, decoded, in order.
  # The images placed in prompt_ids and preprocessed (a vision model's; else ()).
  image_spans: tuple[ImageSpan, ...] = ()


class Run(NamedTuple):
  """One engine request of a prepared request (one of its n choices), ready to queue."""

  input: GenerateInput
  request: Request
  tokenize_s: float
  chunk_tokens: int


class Accepted:
  """One request from the moment the service takes it to the end of its handler, whatever it
  is doing meanwhile (reading its body, being prepared on a worker, running): the drain waits
  for it, and at its timeout cuts it (UNAVAILABLE at once, whatever it was waiting for)."""

  def __init__(self, pool: WorkPool, key: ApiKey, lease: Lease):
    self.key = key
    self.lease = lease
    self.received = time.monotonic()
    self.submitted = False  # A run reached the engine.
    self.answered = False  # The client got the start of its answer (the front end says when).
    self.streams: set[RequestStream] = set()  # Its runs in the engine: the cut aborts them.
    self._pool = pool
    self._cut = asyncio.get_running_loop().create_future()

  @property
  def is_cut(self) -> bool:
    return self._cut.done()

  async def work(self, fn: Callable[..., Any], *args: Any, owed: bool = False) -> Any:
    """fn(*args) on the work pool (see WorkPool.run for `owed`)."""
    return await self.during(self._pool.run(fn, *args, owed=owed))

  async def during(self, awaitable: Awaitable[Any]) -> Any:
    """What `awaitable` gives, unless the drain cuts the request first (UNAVAILABLE)."""
    task = asyncio.ensure_future(awaitable)
    try:
      await asyncio.wait((task, self._cut), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # The handler was cancelled: its client went away.
      task.cancel()
      raise
    if not task.done():
      task.cancel()
      raise ApiError(Status.UNAVAILABLE, "the server shut down before this request was "
                     "answered; retry on another replica")
    return task.result()

  def cut(self) -> None:
    if not self._cut.done():
      self._cut.set_result(None)
    for stream in self.streams:
      stream.abort()

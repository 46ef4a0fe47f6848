"""The gRPC front end: jaxserve.v1.Jaxserve messages <-> service.Service.

Each RPC authenticates from the `authorization: Bearer <key>` metadata, converts the message, and
turns a gateway `ApiError` into the status code of the same name. A client that cancels, or whose
connection drops, cancels the handler; the service's cleanup then aborts the request. A pooling
model's Embed and Score are grpc_pooling.py's, registered here; the wire helpers are grpc_wire.py's.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Protocol

import grpc
from absl import logging

from jaxserve.api import grpc_pooling, kv_transfer
from jaxserve.api.grpc_wire import bearer_token
from jaxserve.api.grpc_wire import decoded as _decoded
from jaxserve.api.grpc_wire import decoder as _decoder
from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.api.proto import jaxserve_pb2_grpc
from jaxserve.batching.request import RequestRejected
from jaxserve.config import Constraint, SamplingParams
from jaxserve.serving import gateway
from jaxserve.serving.gateway import ApiError, ApiKey, Lease, Status
from jaxserve.serving.media import ImageSource
from jaxserve.serving.metrics import RequestRecord
from jaxserve.serving.requests import Chunk, FinishReason, GenerateInput, Prompt, Run
from jaxserve.serving.service import Service

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Jaxserve"].full_name

STATUS_CODES = {
    Status.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Status.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Status.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Status.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Status.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Status.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Status.INTERNAL: grpc.StatusCode.INTERNAL,
    Status.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
}
FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
_SAMPLING_FIELDS = (*SamplingParams.SAMPLER_FIELDS, "seed")  # Fields with presence in the proto.


class ServiceHost(Protocol):
  """server.Server, as the front ends see it."""

  kv_gate: Any  # api/kv_link.PeerGate on a prefill server (PrefillKV's check); else None.

  def current_service(self) -> Service: ...


class Servicer(jaxserve_pb2_grpc.JaxserveServicer):

  def __init__(self, host: ServiceHost):
    self._host = host

  def add_to(self, server: grpc.aio.Server) -> None:
    """What jaxserve_pb2_grpc.add_JaxserveServicer_to_server does, with deserializers that
    hand bytes that are no valid message to the method (INVALID_ARGUMENT), not to gRPC (UNKNOWN)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            self.Generate, _decoder(pb.GenerateRequest), pb.GenerateResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            self.Tokenize, _decoder(pb.TokenizeRequest), pb.TokenizeResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            self.GetModelInfo, _decoder(pb.GetModelInfoRequest), pb.ModelInfo.SerializeToString),
        "PrefillKV": grpc.unary_stream_rpc_method_handler(
            self.PrefillKV, _decoder(pb.PrefillKVRequest), pb.KVPage.SerializeToString),
        **grpc_pooling.Pooling(self._host, self._abort).handlers(),  # Embed, Score.
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)

  async def Generate(self, request: pb.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
    try:
      service = self._host.current_service()
      async with service.accept(bearer_token(context.invocation_metadata())) as acc:
        run, = await acc.work(_prepare, service, acc.lease, request)
        # Closing the stream at once, however the handler ends, aborts an unfinished request.
        async with contextlib.aclosing(service.generate(acc, run)) as chunks:
          async for chunk in chunks:
            acc.answered = True
            # Prompt logprobs (up to the context's length, each with its top ids) are built on
            # a worker; the rest is a few tokens.
            yield (await acc.work(response, chunk, owed=True) if chunk.prompt_logprobs
                   else response(chunk))
    except ApiError as e:
      await self._abort(context, e)
    except Exception:  # pylint: disable=broad-except  (a bug: report it, keep serving)
      logging.exception("Generate failed")
      await self._abort(context, ApiError(Status.INTERNAL, "internal error; see the server log"))

  async def PrefillKV(self, request: pb.PrefillKVRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KVPage]:
    """P/D's prefill side (api/kv_transfer.py): the prompt's KV pages, after its prefill. Only
    a prefill server answers, only to the peer credential (api/kv_link.PeerGate); the decode
    server's salt is scoped under the peer's identity, as a key's requests are."""
    gate = self._host.kv_gate
    if gate is None:
      await context.abort(grpc.StatusCode.UNIMPLEMENTED, "PrefillKV is served only by a "
                          "prefill server (--kv-role prefill)")
    try:
      service = self._host.current_service()
      peer = gate.check(bearer_token(context.invocation_metadata()))
      async with service.accept(None, as_key=peer) as acc:
        async with contextlib.aclosing(self._pages(service, acc, _decoded(request),
                                                   gate.identity)) as pages:
          async for page in pages:
            acc.answered = True
            yield page
    except ApiError as e:
      await self._abort(context, e)
    except Exception:  # pylint: disable=broad-except  (a bug: report it, keep serving)
      logging.exception("PrefillKV failed")
      await self._abort(context, ApiError(Status.INTERNAL, "internal error; see the server log"))

  async def _pages(self, service: Service, acc: Any, request: pb.PrefillKVRequest,
                   identity: Any) -> AsyncIterator[pb.KVPage]:
    """PrefillKV's answer; no prompt: the header alone (a decode server's check at start)."""
    lora = service.check_model(request.model)
    salt = service.gateway.cache_salt(acc.lease.key, request.cache_salt or None)
    model = await acc.work(identity.of, lora)  # An adapter's files are read once.
    ids = await acc.work(service.prompts.encode, Prompt(token_ids=list(request.token_ids))) \
        if request.token_ids else []
    try:
      pages = kv_transfer.prefill(service.runner, ids, salt, lora, request.request_id or None,
                                  request.cached_pages, model)
      async with contextlib.aclosing(pages) as stream:
        async for page in stream:
          yield page
    except (RequestRejected, ValueError) as e:
      raise gateway.invalid(str(e)) from e

  async def Tokenize(self, request: pb.TokenizeRequest,
                     context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
    try:
      service = self._host.current_service()
      async with service.accept(bearer_token(context.invocation_metadata()),
                                limited=False) as acc:
        return await acc.work(_tokenize, service, request)
    except ApiError as e:
      await self._abort(context, e)
    except Exception:  # pylint: disable=broad-except  (a bug: report it, keep serving)
      logging.exception("Tokenize failed")
      await self._abort(context, ApiError(Status.INTERNAL, "internal error; see the server log"))

  async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                         context: grpc.aio.ServicerContext) -> pb.ModelInfo:
    try:
      service, _ = self._enter(context)
      _decoded(request)
      return pb.ModelInfo(**service.model_info())
    except ApiError as e:
      await self._abort(context, e)

  def _enter(self, context: grpc.aio.ServicerContext) -> tuple[Service, ApiKey]:
    service = self._host.current_service()
    return service, service.gateway.authenticate(bearer_token(context.invocation_metadata()))

  async def _abort(self, context: grpc.aio.ServicerContext, error: ApiError) -> None:
    try:
      self._host.current_service().metrics.rejected.labels(error.status.value).inc()
    except ApiError:
      pass  # Still warming up: no metrics to count in yet.
    await context.abort(STATUS_CODES[error.status], error.message)


def _prepare(service: Service, lease: Lease, request: Any) -> list[Run]:
  """A Generate request's work, on a worker thread."""
  return service.prepare_runs(lease, [generate_input(_decoded(request))])


def _tokenize(service: Service, request: Any) -> pb.TokenizeResponse:
  request = _decoded(request)
  service.check_model(request.model)
  return pb.TokenizeResponse(token_ids=service.prompts.encode(_prompt(request)),
                             max_model_len=service.max_model_len)


def _prompt(request: pb.GenerateRequest | pb.TokenizeRequest) -> Prompt:
  kind = request.WhichOneof("prompt")
  if kind == "text":
    return Prompt(text=request.text)
  if kind == "token_ids":
    return Prompt(token_ids=request.token_ids.ids)  # Not copied: its length is checked first.
  if kind == "chat":
    return _chat_prompt(request.chat.messages)
  return Prompt()


def _chat_prompt(messages: Any) -> Prompt:
  """A message's images come before its text, as content parts (decoded by Service.prepare)."""
  images, out = [], []
  for n, m in enumerate(messages):
    content = m.content
    if m.images:
      images += [ImageSource(data, f"chat.messages[{n}].images[{k}]")
                 for k, data in enumerate(m.images)]
      content = [*({"type": "image"} for _ in m.images),
                 *([{"type": "text", "text": m.content}] if m.content else [])]
    out.append({"role": m.role, "content": content})
  return Prompt(messages=out, images=tuple(images))


def _constraint(request: pb.GenerateRequest) -> Constraint | None:
  kind = request.WhichOneof("constraint")
  if kind is None or (kind == "json_object" and not request.json_object):
    return None
  try:
    if kind == "choice":
      return Constraint.choice(list(request.choice.options))
    if kind == "json_object":
      return Constraint.json_object()
    return Constraint(kind, getattr(request, kind))  # json_schema, regex, grammar: their text.
  except ValueError as e:
    raise gateway.invalid(str(e)) from e


def generate_input(request: pb.GenerateRequest) -> GenerateInput:
  sampling = {f: getattr(request, f) for f in _SAMPLING_FIELDS if request.HasField(f)}
  if request.stop:
    sampling["stop"] = list(request.stop)
  if request.stop_token_ids:
    sampling["stop_token_ids"] = list(request.stop_token_ids)
  if request.ignore_eos:
    sampling["ignore_eos"] = True
  if request.HasField("prompt_logprobs"):
    sampling["prompt_logprobs"] = request.prompt_logprobs
  if request.logit_bias:
    sampling["logit_bias"] = dict(request.logit_bias)
  if request.allowed_token_ids:
    sampling["allowed_token_ids"] = list(request.allowed_token_ids)
  constraint = _constraint(request)
  if constraint is not None:
    sampling["constraint"] = constraint
  return GenerateInput(
      _prompt(request), sampling,
      max_tokens=request.max_tokens if request.HasField("max_tokens") else None,
      logprobs=request.logprobs if request.HasField("logprobs") else None,
      chunk_tokens=request.chunk_tokens, request_id=request.request_id or None,
      priority=request.priority, model=request.model, truncate_prompt=request.truncate_prompt,
      cache_salt=_cache_salt(request))


def _cache_salt(request: pb.GenerateRequest) -> str | None:
  if not request.HasField("cache_salt"):
    return None
  if not request.cache_salt:
    raise gateway.invalid("cache_salt must be a non-empty string when set")
  return request.cache_salt


def response(chunk: Chunk) -> pb.GenerateResponse:
  msg = pb.GenerateResponse(request_id=chunk.request_id, text=chunk.text, token_ids=chunk.token_ids,
                            finish_reason=FINISH_REASONS[chunk.finish_reason])
  for token, lp in zip(chunk.token_ids, chunk.logprobs or ()):
    msg.logprobs.append(pb.TokenLogprob(
        token_id=token, logprob=lp.logprob,
        top=[pb.TopLogprob(token_id=i, logprob=p) for i, p in zip(lp.top_ids, lp.top_logprobs)]))
  for token, lp in zip(chunk.prompt_token_ids, chunk.prompt_logprobs or ()):
    entry = msg.prompt_logprobs.add(token_id=token)
    if lp is not None:
      entry.logprob, entry.rank = lp.logprob, lp.rank
      entry.top.extend(pb.TopLogprob(token_id=i, logprob=p)
                       for i, p in zip(lp.top_ids, lp.top_logprobs))
  if chunk.record is not None:
    _fill_record(msg, chunk.record)
  return msg


def _fill_record(msg: pb.GenerateResponse, r: RequestRecord) -> None:
  msg.usage.prompt_tokens = r.num_prompt_tokens
  msg.usage.completion_tokens = r.num_output_tokens
  msg.usage.cached_prompt_tokens = r.num_cached_tokens
  t = msg.timings
  t.tokenize, t.queue, t.prefill = r.tokenize, r.queue or 0.0, r.prefill or 0.0
  t.time_to_first_token, t.total = r.time_to_first_token or 0.0, r.total

"""The OpenAI-compatible HTTP front end (aiohttp): /v1/completions, /v1/chat/completions (both
with `stream` true, as server-sent events, or false), /v1/models, and /metrics.

Requests go through the same service and gateway as gRPC: `Authorization: Bearer <key>`, the
same checks and limits, and errors in OpenAI's shape ({"error": {"message", "type", "code"}})
with 400 / 401 / 429 / 503 / 500 for INVALID_ARGUMENT / UNAUTHENTICATED / RESOURCE_EXHAUSTED /
UNAVAILABLE / INTERNAL. Besides OpenAI's fields, vLLM's extras are read: top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, priority, truncate_prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import ssl
from typing import Any, AsyncIterator, Callable

from absl import logging
from aiohttp import web

from jaxserve.gateway import ApiError, Status, invalid
from jaxserve.grpc_api import ServiceHost
from jaxserve.metrics import CONTENT_TYPE, Metrics
from jaxserve.openai_format import ChatFormat, CompletionFormat
from jaxserve.service import Chunk, GenerateInput, Prompt, Service

HTTP_STATUS = {Status.INVALID_ARGUMENT: 400, Status.UNAUTHENTICATED: 401,
               Status.RESOURCE_EXHAUSTED: 429, Status.UNAVAILABLE: 503, Status.INTERNAL: 500}
_ERROR_TYPES = {Status.INVALID_ARGUMENT: "invalid_request_error",
                Status.UNAUTHENTICATED: "authentication_error",
                Status.RESOURCE_EXHAUSTED: "rate_limit_error",
                Status.UNAVAILABLE: "service_unavailable", Status.INTERNAL: "internal_error"}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "ignore_eos", "stop_token_ids")


@dataclasses.dataclass
class Site:
  runner: web.AppRunner
  port: int

  async def close(self) -> None:
    await self.runner.cleanup()


async def serve(app: web.Application, host: str, port: int,
                ssl_context: ssl.SSLContext | None = None) -> Site:
  # handler_cancellation: a client that disconnects cancels its handler, which aborts the request.
  # No access log: the per-request line of metrics.py says more.
  runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
  await runner.setup()
  await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
  return Site(runner, runner.addresses[0][1])


def build_metrics_app(metrics: Metrics) -> web.Application:
  app = web.Application()
  app.router.add_get("/metrics", _metrics_handler(metrics))
  return app


def build_app(host: ServiceHost, metrics: Metrics | None) -> web.Application:
  """The API; /metrics too when `metrics` is given."""
  app = web.Application(client_max_size=8 * 2**20)
  api = _Api(host)
  app.router.add_get("/v1/models", api.models)
  app.router.add_post("/v1/completions", api.completions)
  app.router.add_post("/v1/chat/completions", api.chat_completions)
  if metrics is not None:
    app.router.add_get("/metrics", _metrics_handler(metrics))
  return app


def _metrics_handler(metrics: Metrics):
  async def handler(_: web.Request) -> web.Response:
    return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})
  return handler


def error_response(e: ApiError) -> web.Response:
  body = {"error": {"message": e.message, "type": _ERROR_TYPES[e.status], "param": None,
                    "code": e.status.value}}
  return web.json_response(body, status=HTTP_STATUS[e.status])


class _Api:

  def __init__(self, host: ServiceHost):
    self._host = host

  async def models(self, request: web.Request) -> web.Response:
    async def run(service, key, body):
      return web.json_response({"object": "list", "data": [
          {"id": service.model_name, "object": "model", "created": 0, "owned_by": "jaxserve",
           "max_model_len": service.max_model_len}]})
    return await self._handle(request, run, read_body=False)

  async def completions(self, request: web.Request) -> web.StreamResponse:
    async def run(service, key, body):
      inp = _input(body, _completion_prompt(body), body.get("logprobs"), "max_tokens")
      return await self._respond(request, service, key, inp, body, CompletionFormat(service))
    return await self._handle(request, run)

  async def chat_completions(self, request: web.Request) -> web.StreamResponse:
    async def run(service, key, body):
      want = body.get("logprobs") or False
      if not isinstance(want, bool):
        raise invalid(f"logprobs must be true or false, got {want!r}")
      top = body.get("top_logprobs") or 0
      max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
      inp = _input(body, Prompt(messages=_messages(body)), top if want else None, max_field)
      return await self._respond(request, service, key, inp, body, ChatFormat(service))
    return await self._handle(request, run)

  async def _handle(self, request: web.Request, run: Callable, read_body: bool = True):
    try:
      service = self._host.current_service()
      key = service.gateway.authenticate(_bearer(request))
      body = await _json_body(request) if read_body else {}
      return await run(service, key, body)
    except ApiError as e:
      with contextlib.suppress(ApiError):
        self._host.current_service().metrics.rejected.labels(e.status.value).inc()
      return error_response(e)
    except Exception:  # pylint: disable=broad-except  (a bug: report it, keep serving)
      logging.exception("%s failed", request.path)
      return error_response(ApiError(Status.INTERNAL, "internal error; see the server log"))

  async def _respond(self, request, service: Service, key, inp: GenerateInput, body, fmt):
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
      raise invalid("stream_options must be an object")
    chunks = service.generate(key, inp)
    async with contextlib.aclosing(chunks):
      first = await anext(chunks)  # Errors before the first token are a plain error response.
      if not body.get("stream"):
        rest = [c async for c in chunks]
        return web.json_response(fmt.whole([first, *rest]))
      return await _sse(request, fmt, first, chunks, bool(options.get("include_usage")))


async def _sse(request: web.Request, fmt, first: Chunk, chunks: AsyncIterator[Chunk],
               include_usage: bool) -> web.StreamResponse:
  """Server-sent events. A client that goes away makes a write fail; leaving the loop closes
  `chunks` (in the caller), which aborts the request."""
  resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
  await resp.prepare(request)
  send = lambda event: resp.write(f"data: {json.dumps(event)}\n\n".encode())
  try:
    for event in fmt.start():
      await send(event)
    chunk = first
    while True:
      await send(fmt.delta(chunk))
      if chunk.record is not None:
        break
      chunk = await anext(chunks)
    if include_usage:
      await send(fmt.usage_event(chunk))
  except ApiError as e:  # The engine failed mid-stream.
    await send({"error": {"message": e.message, "type": _ERROR_TYPES[e.status], "code": e.status.value}})
  except (ConnectionError, StopAsyncIteration):
    return resp
  await resp.write(b"data: [DONE]\n\n")
  await resp.write_eof()
  return resp


def _bearer(request: web.Request) -> str | None:
  scheme, _, token = request.headers.get("Authorization", "").partition(" ")
  return token.strip() if scheme.lower() == "bearer" else None


async def _json_body(request: web.Request) -> dict[str, Any]:
  try:
    body = await request.json()
  except ValueError as e:
    raise invalid(f"the request body is not JSON: {e}") from e
  if not isinstance(body, dict):
    raise invalid("the request body must be a JSON object")
  return body


def _input(body: dict[str, Any], prompt: Prompt, logprobs: Any, max_field: str) -> GenerateInput:
  if (body.get("n") or 1) != 1:
    raise invalid("n must be 1: one completion per request")
  if body.get("logit_bias"):
    raise invalid("logit_bias is not supported")
  sampling = {f: body[f] for f in _SAMPLING_FIELDS if body.get(f) is not None}
  stop = body.get("stop")
  if stop is not None:
    sampling["stop"] = [stop] if isinstance(stop, str) else stop
  max_tokens = body.get(max_field)
  for field, value in ((max_field, max_tokens), ("priority", body.get("priority"))):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
      raise invalid(f"{field} must be an integer, got {value!r}")
  return GenerateInput(prompt, sampling, max_tokens=max_tokens, logprobs=logprobs,
                       request_id=None, priority=body.get("priority") or 0,
                       model=str(body.get("model") or ""),
                       truncate_prompt=bool(body.get("truncate_prompt")))


def _completion_prompt(body: dict[str, Any]) -> Prompt:
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]  # A batch of one.
  if isinstance(prompt, str):
    return Prompt(text=prompt)
  if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
    return Prompt(token_ids=prompt)
  raise invalid("prompt must be a string or a list of token ids (one prompt per request)")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise invalid("messages must be a non-empty list")
  out = []
  for n, m in enumerate(messages):
    if not isinstance(m, dict):
      raise invalid(f"messages[{n}] must be an object")
    content = m.get("content")
    if isinstance(content, list):  # Content parts: only text ones are supported.
      if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        raise invalid(f"messages[{n}].content: only text parts are supported")
      content = "".join(str(p.get("text", "")) for p in content)
    out.append({"role": m.get("role"), "content": content})
  return out

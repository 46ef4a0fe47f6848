"""The OpenAI-compatible HTTP front end (aiohttp): /v1/completions, /v1/chat/completions (both
with `stream` true, as server-sent events, or false), /v1/models and /v1/models/{id}, vLLM's
/tokenize, /detokenize and /tokenizer_info (openai_tokenize.py), /health (200 while the engine
serves, 503 otherwise; no key needed, as for a load balancer's probe), /version, and /metrics.

Requests go through the same service and gateway as gRPC: `Authorization: Bearer <key>`, the
same checks and limits, and errors in OpenAI's shape ({"error": {"message", "type", "code"}})
with 400 / 404 / 401 / 429 / 503 / 500 for INVALID_ARGUMENT / NOT_FOUND (another model) /
UNAUTHENTICATED / RESOURCE_EXHAUSTED / UNAVAILABLE / INTERNAL; aiohttp's own refusals (404,
405, and 413 for a body over 8 MiB) come in the same shape. Besides OpenAI's fields, vLLM's
extras are read: top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
allowed_token_ids, priority, truncate_prompt (openai_request.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import ssl
from typing import Callable

from absl import logging
from aiohttp import web

from jaxserve.api import openai_choices, openai_request, openai_tokenize
from jaxserve.api.grpc_api import ServiceHost
from jaxserve.api.openai_format import ChatFormat, CompletionFormat
from jaxserve.serving.gateway import ApiError, Status
from jaxserve.serving.metrics import CONTENT_TYPE, Metrics
from jaxserve.serving.service import Service

HTTP_STATUS = {Status.INVALID_ARGUMENT: 400, Status.NOT_FOUND: 404, Status.UNAUTHENTICATED: 401,
               Status.RESOURCE_EXHAUSTED: 429, Status.UNAVAILABLE: 503, Status.INTERNAL: 500}
_ERROR_TYPES = {Status.INVALID_ARGUMENT: "invalid_request_error",
                Status.NOT_FOUND: "invalid_request_error",
                Status.UNAUTHENTICATED: "authentication_error",
                Status.RESOURCE_EXHAUSTED: "rate_limit_error",
                Status.UNAVAILABLE: "service_unavailable", Status.INTERNAL: "internal_error"}
MAX_BODY_BYTES = 8 * 2**20  # As gRPC's largest message (server.py).


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
  app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors_as_json])
  api = _Api(host)
  app.router.add_get("/v1/models", api.models)
  app.router.add_get("/v1/models/{model:.+}", api.model)
  app.router.add_post("/v1/completions", api.completions)
  app.router.add_post("/v1/chat/completions", api.chat_completions)
  app.router.add_post("/tokenize", api.tokenize)
  app.router.add_post("/detokenize", api.detokenize)
  app.router.add_get("/tokenizer_info", api.tokenizer_info)
  app.router.add_get("/health", api.health)
  app.router.add_get("/version", api.version)
  if metrics is not None:
    app.router.add_get("/metrics", _metrics_handler(metrics))
  return app


def _metrics_handler(metrics: Metrics):
  async def handler(_: web.Request) -> web.Response:
    return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})
  return handler


@web.middleware
async def _errors_as_json(request: web.Request, handler) -> web.StreamResponse:
  """aiohttp's own refusals (no such path, wrong method, body too large) in the API's shape."""
  try:
    return await handler(request)
  except web.HTTPException as e:
    if e.status < 400:
      raise
    messages = {404: f"no endpoint {request.path}",
                405: f"{request.path} does not take {request.method}",
                413: f"the request body is over the limit of {MAX_BODY_BYTES} bytes "
                     f"({MAX_BODY_BYTES // 2**20} MiB)"}
    body = {"error": {"message": messages.get(e.status, e.text), "type": "invalid_request_error",
                      "param": None, "code": e.reason.lower().replace(" ", "_")}}
    allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None  # Of a 405.
    return web.json_response(body, status=e.status, headers=allow)


def error_response(e: ApiError) -> web.Response:
  code = "model_not_found" if e.status is Status.NOT_FOUND else e.status.value  # OpenAI's code.
  body = {"error": {"message": e.message, "type": _ERROR_TYPES[e.status], "param": None,
                    "code": code}}
  return web.json_response(body, status=HTTP_STATUS[e.status])


class _Api:

  def __init__(self, host: ServiceHost):
    self._host = host

  async def models(self, request: web.Request) -> web.Response:
    async def run(service, key, body):
      return web.json_response({"object": "list", "data": [_model_card(service)]})
    return await self._handle(request, run, read_body=False)

  async def model(self, request: web.Request) -> web.Response:
    async def run(service, key, body):
      service.check_model(request.match_info["model"])
      return web.json_response(_model_card(service))
    return await self._handle(request, run, read_body=False)

  async def tokenize(self, request: web.Request) -> web.Response:
    async def run(service, key, body):
      return web.json_response(openai_tokenize.tokenize(service, body))
    return await self._handle(request, run)

  async def detokenize(self, request: web.Request) -> web.Response:
    async def run(service, key, body):
      return web.json_response(openai_tokenize.detokenize(service, body))
    return await self._handle(request, run)

  async def tokenizer_info(self, request: web.Request) -> web.Response:
    async def run(service, key, body):
      return web.json_response(openai_tokenize.tokenizer_info(service))
    return await self._handle(request, run, read_body=False)

  async def health(self, request: web.Request) -> web.Response:
    """200 only while requests are served: not warming up, draining or with a dead engine."""
    try:
      refusing = self._host.current_service().refusing
    except ApiError as e:  # Warming up.
      refusing = e.message
    if refusing is not None:
      return error_response(ApiError(Status.UNAVAILABLE, refusing))
    return web.Response(status=200)

  async def version(self, request: web.Request) -> web.Response:
    return web.json_response({"version": importlib.metadata.version("jaxserve")})

  async def completions(self, request: web.Request) -> web.StreamResponse:
    async def run(service, key, body):
      req = openai_request.completion_request(body)
      return await self._respond(request, service, key, req, CompletionFormat(service, req))
    return await self._handle(request, run)

  async def chat_completions(self, request: web.Request) -> web.StreamResponse:
    async def run(service, key, body):
      req = openai_request.chat_request(body)
      return await self._respond(request, service, key, req, ChatFormat(service, req))
    return await self._handle(request, run)

  async def _handle(self, request: web.Request, run: Callable, read_body: bool = True):
    try:
      service = self._host.current_service()
      key = service.gateway.authenticate(_bearer(request))
      body = openai_request.parse_body(await request.read()) if read_body else {}
      return await run(service, key, body)
    except ApiError as e:
      with contextlib.suppress(ApiError):
        self._host.current_service().metrics.rejected.labels(e.status.value).inc()
      return error_response(e)
    except web.HTTPException:  # 413 from request.read(): _errors_as_json answers it.
      raise
    except Exception:  # pylint: disable=broad-except  (a bug: report it, keep serving)
      logging.exception("%s failed", request.path)
      return error_response(ApiError(Status.INTERNAL, "internal error; see the server log"))

  async def _respond(self, request, service: Service, key, req: openai_request.Request, fmt):
    async with openai_choices.Choices(service, key, req) as choices:
      await choices.start()  # Errors before the first token are a plain error response.
      if not req.stream:
        return web.json_response(await choices.whole(fmt))
      return await _sse(request, fmt, choices, req.include_usage)


async def _sse(request: web.Request, fmt, choices: openai_choices.Choices,
               include_usage: bool) -> web.StreamResponse:
  """Server-sent events, each choice's chunks as they come. A client that goes away makes a
  write fail; leaving the loop closes the choices (in the caller), which aborts the requests."""
  resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                     "Cache-Control": "no-cache"})
  await resp.prepare(request)
  send = lambda event: resp.write(f"data: {json.dumps(event)}\n\n".encode())
  try:
    for event in fmt.start(range(len(choices))):
      await send(event)
    records = {}
    async for index, chunk in choices.events():
      await send(fmt.delta(chunk, index))
      if chunk.record is not None:
        records[index] = chunk.record
    if include_usage:
      await send(fmt.usage_event(openai_choices.records_in_order(records)))
  except ApiError as e:  # The engine failed mid-stream.
    await send({"error": {"message": e.message, "type": _ERROR_TYPES[e.status],
                          "code": e.status.value}})
  except (ConnectionError, StopAsyncIteration):
    return resp
  await resp.write(b"data: [DONE]\n\n")
  await resp.write_eof()
  return resp


def _model_card(service: Service) -> dict:
  return {"id": service.model_name, "object": "model", "created": 0, "owned_by": "jaxserve",
          "max_model_len": service.max_model_len}


def _bearer(request: web.Request) -> str | None:
  scheme, _, token = request.headers.get("Authorization", "").partition(" ")
  return token.strip() if scheme.lower() == "bearer" else None

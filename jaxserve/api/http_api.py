"""The OpenAI-compatible HTTP front end (aiohttp): /v1/completions, /v1/chat/completions (both
with `stream` true, as server-sent events, or false; chat's content text and image parts, the
images decoded on the work pool by serving/media.py), /v1/models and /v1/models/{id}, vLLM's
/tokenize, /detokenize and /tokenizer_info (openai_tokenize.py), a pooling model's
/v1/embeddings, /v1/rerank and /v1/score (openai_embed.py), /health (200 while the engine
serves, 503 otherwise; no key needed, as for a load balancer's probe), /version, and /metrics;
vLLM's admin routes for a training loop (/sleep, /pause, /reset_prefix_cache, ...) are
http_admin.py's.

Requests go through the same service and gateway as gRPC: `Authorization: Bearer <key>`, the
same checks and limits, and errors in OpenAI's shape ({"error": {"message", "type", "code"}})
with 400 / 404 / 401 / 429 / 503 / 500 for INVALID_ARGUMENT / NOT_FOUND (another model) /
UNAUTHENTICATED / RESOURCE_EXHAUSTED / UNAVAILABLE / INTERNAL; aiohttp's own refusals (404,
405, and 413 for a body over 8 MiB) come in the same shape (http_site.py). Besides OpenAI's
fields, vLLM's extras are read: top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
allowed_token_ids, priority, truncate_prompt (openai_request.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
from typing import Callable

from absl import logging
from aiohttp import web

from jaxserve.api import http_admin, openai_choices, openai_embed, openai_request, openai_tokenize
from jaxserve.api.grpc_api import ServiceHost
from jaxserve.api.http_site import (
  MAX_BODY_BYTES,
  READ_TIMEOUT_S,
  error_event,
  error_response,
  errors_as_json,
  metrics_handler,
)
from jaxserve.api.openai_completion_format import CompletionFormat
from jaxserve.api.openai_format import ChatFormat
from jaxserve.serving import work_pool
from jaxserve.serving.gateway import ApiError, Status
from jaxserve.serving.metrics import Metrics
from jaxserve.serving.requests import Accepted
from jaxserve.serving.service import Service


def build_app(host: ServiceHost, metrics: Metrics | None,
              read_timeout_s: float = READ_TIMEOUT_S) -> web.Application:
  """The API; /metrics too when `metrics` is given. A request body must arrive within
  `read_timeout_s` (else 408, and the connection is closed)."""
  app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[errors_as_json])
  api = _Api(host, read_timeout_s)
  app.router.add_get("/v1/models", api.models)
  app.router.add_get("/v1/models/{model:.+}", api.model)
  app.router.add_post("/v1/completions", api.completions)
  app.router.add_post("/v1/chat/completions", api.chat_completions)
  for route in ("/v1/embeddings", "/v1/rerank", "/v1/score"):  # A pooling model's.
    app.router.add_post(route, api.pooling)
  app.router.add_post("/v1/load_lora_adapter", api.load_lora_adapter)
  app.router.add_post("/v1/unload_lora_adapter", api.unload_lora_adapter)
  app.router.add_post("/tokenize", api.tokenize)
  app.router.add_post("/detokenize", api.detokenize)
  app.router.add_get("/tokenizer_info", api.tokenizer_info)
  app.router.add_get("/health", api.health)
  app.router.add_get("/version", api.version)
  http_admin.add_routes(app, api._work)  # pylint: disable=protected-access
  if metrics is not None:
    app.router.add_get("/metrics", metrics_handler(metrics))
  return app


def _json(data: bytes) -> web.Response:
  return web.Response(body=data, content_type="application/json")


class _Api:

  def __init__(self, host: ServiceHost, read_timeout_s: float):
    self._host = host
    self._read_timeout_s = read_timeout_s

  async def models(self, request: web.Request) -> web.Response:
    async def run(service, key):
      return web.json_response({"object": "list", "data": _model_cards(service, key.admin)})
    return await self._handle(request, run)

  async def model(self, request: web.Request) -> web.Response:
    async def run(service, key):
      lora = service.check_model(request.match_info["model"])
      name = service.model_name if lora is None else lora.lora_name
      cards = _model_cards(service, key.admin)
      return web.json_response(next(c for c in cards if c["id"] == name))
    return await self._handle(request, run)

  async def load_lora_adapter(self, request: web.Request) -> web.Response:
    """vLLM's: {"lora_name", "lora_path"} (a PEFT folder on the server), served from now on."""
    async def run(service, acc, body):
      fields = await acc.work(openai_request.parse_body, body)
      lora = await service.adapters.load(fields.get("lora_name"), fields.get("lora_path"),
                                         acc.work,
                                         service.gateway.may_administer(acc.lease.key))
      return web.Response(text=f"Success: LoRA adapter '{lora.lora_name}' added successfully.")
    return await self._work(request, run, limited=False)

  async def unload_lora_adapter(self, request: web.Request) -> web.Response:
    """vLLM's: {"lora_name"}; refused while a request uses it."""
    async def run(service, acc, body):
      name = (await acc.work(openai_request.parse_body, body)).get("lora_name")
      await service.adapters.unload(name, service.gateway.may_administer(acc.lease.key))
      return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
    return await self._work(request, run, limited=False)

  async def tokenize(self, request: web.Request) -> web.Response:
    async def run(service, acc, body):
      return _json(await acc.work(_tokenizer_route, openai_tokenize.tokenize, service, body))
    return await self._work(request, run, limited=False)

  async def detokenize(self, request: web.Request) -> web.Response:
    async def run(service, acc, body):
      return _json(await acc.work(_tokenizer_route, openai_tokenize.detokenize, service, body))
    return await self._work(request, run, limited=False)

  async def tokenizer_info(self, request: web.Request) -> web.Response:
    async def run(service, key):
      return web.json_response(openai_tokenize.tokenizer_info(service))
    return await self._handle(request, run)

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
    return await self._generate(request, openai_request.completion_request, CompletionFormat)

  async def chat_completions(self, request: web.Request) -> web.StreamResponse:
    return await self._generate(request, openai_request.chat_request, ChatFormat)

  async def pooling(self, request: web.Request) -> web.Response:
    """A pooling model's routes (openai_embed.py), under the key's limits as generation."""
    async def run(service: Service, acc: Accepted, body: bytes):
      return _json(await openai_embed.answer(request.path, service, acc, body))
    return await self._work(request, run)

  async def _generate(self, request: web.Request, parse: Callable, format_type: type):
    async def run(service: Service, acc: Accepted, body: bytes):
      req, runs = await acc.work(openai_choices.prepare, service, acc.lease, body, parse)
      fmt = format_type(service, req)
      async with openai_choices.Choices(service, acc, req, runs) as choices:
        await choices.start()  # Errors before the first token are a plain error response.
        if not req.stream:
          return _json(await choices.whole(fmt))
        return await _sse(request, acc, fmt, choices, req.include_usage)
    return await self._work(request, run)

  async def _handle(self, request: web.Request, run: Callable) -> web.StreamResponse:
    """A route that reads no body and costs nothing: `run(service, key)`."""
    async def answer():
      service = self._host.current_service()
      return await run(service, service.gateway.authenticate(_bearer(request)))
    return await self._answer(request, answer)

  async def _work(self, request: web.Request, run: Callable,
                  limited: bool = True) -> web.StreamResponse:
    """A route that works on what the client sent: the service accepts the request (see
    Service.accept; with `limited`, the key's rate limits) before its body is read, then
    `run(service, accepted, body)`, which does its work on the pool."""
    async def answer():
      service = self._host.current_service()
      async with service.accept(_bearer(request), limited) as acc:
        return await run(service, acc, await acc.during(self._read(request)))
    return await self._answer(request, answer)

  async def _read(self, request: web.Request) -> bytes:
    """The body, within the read timeout: a client that trickles it in holds nothing longer."""
    try:
      return await asyncio.wait_for(request.read(), self._read_timeout_s)
    except asyncio.TimeoutError:
      raise web.HTTPRequestTimeout(
          text=f"the request body did not arrive within {self._read_timeout_s:g} s") from None

  async def _answer(self, request: web.Request, answer: Callable) -> web.StreamResponse:
    try:
      return await answer()
    except ApiError as e:
      with contextlib.suppress(ApiError):
        self._host.current_service().metrics.rejected.labels(e.status.value).inc()
      return error_response(e)
    except web.HTTPException:  # 413 from request.read(), a 408: _errors_as_json answers them.
      raise
    except Exception:  # pylint: disable=broad-except  (a bug: report it, keep serving)
      logging.exception("%s failed", request.path)
      return error_response(ApiError(Status.INTERNAL, "internal error; see the server log"))


def _tokenizer_route(route: Callable, service: Service, body: bytes) -> bytes:
  """A tokenizer route's whole work, on a worker thread."""
  return work_pool.dumps(route(service, openai_request.parse_body(body)))


async def _sse(request: web.Request, acc: Accepted, fmt, choices: openai_choices.Choices,
               include_usage: bool) -> web.StreamResponse:
  """Server-sent events, each choice's chunks as they come. A client that goes away makes a
  write fail; leaving the loop closes the choices (in the caller), which aborts the requests."""
  resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                     "Cache-Control": "no-cache"})
  await resp.prepare(request)
  send = lambda data: resp.write(b"data: " + data + b"\n\n")
  event = lambda event: json.dumps(event).encode()
  try:
    for start in fmt.start(range(len(choices))):
      await send(event(start))
    records = {}
    async for index, chunk in choices.events():
      if chunk.prompt_logprobs is None:
        await send(event(fmt.delta(chunk, index)))
      else:  # Each prompt token's top logprobs: built on a worker.
        await send(await acc.work(_delta, fmt, chunk, index, owed=True))
      if chunk.record is not None:
        records[index] = chunk.record
    if include_usage:
      await send(event(fmt.usage_event(openai_choices.records_in_order(records))))
  except ApiError as e:  # The engine failed mid-stream, or the drain cut it.
    await send(event(error_event(e)))
  except (ConnectionError, StopAsyncIteration):
    return resp
  await resp.write(b"data: [DONE]\n\n")
  await resp.write_eof()
  return resp


def _delta(fmt, chunk, index: int) -> bytes:
  return work_pool.dumps(fmt.delta(chunk, index))


def _model_cards(service: Service, admin: bool) -> list[dict]:
  """The base model's card, then each LoRA adapter's (its `parent` the base, its `root` its
  folder as vLLM's for an admin key, its name for anyone else: the server's paths are not a
  tenant's business)."""
  card = lambda name, root, parent: {"id": name, "object": "model", "created": 0,
                                     "owned_by": "jaxserve", "root": root, "parent": parent,
                                     "max_model_len": service.max_model_len}
  return [card(service.model_name, service.model_name, None),
          *(card(a.lora_name, a.lora_path if admin else a.lora_name, service.model_name)
            for a in service.adapters.served())]


def _bearer(request: web.Request) -> str | None:
  scheme, _, token = request.headers.get("Authorization", "").partition(" ")
  return token.strip() if scheme.lower() == "bearer" else None

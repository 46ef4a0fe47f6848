"""The aiohttp plumbing under the HTTP API (http_api.py): the listening site and its timeouts, the
/metrics app, and the one error shape every HTTP answer takes, OpenAI's
({"error": {"message", "type", "param", "code"}}), aiohttp's own refusals (404, 405, 413, 408)
included.
"""

from __future__ import annotations

import dataclasses
import ssl

from aiohttp import web

from jaxserve.serving.gateway import ApiError, Status
from jaxserve.serving.metrics import CONTENT_TYPE, Metrics

HTTP_STATUS = {Status.INVALID_ARGUMENT: 400, Status.NOT_FOUND: 404, Status.UNAUTHENTICATED: 401,
               Status.PERMISSION_DENIED: 403, Status.RESOURCE_EXHAUSTED: 429,
               Status.UNAVAILABLE: 503, Status.INTERNAL: 500, Status.FAILED_PRECONDITION: 409}
ERROR_TYPES = {Status.INVALID_ARGUMENT: "invalid_request_error",
               Status.NOT_FOUND: "invalid_request_error",
               Status.UNAUTHENTICATED: "authentication_error",
               Status.PERMISSION_DENIED: "permission_error",
               Status.RESOURCE_EXHAUSTED: "rate_limit_error",
               Status.UNAVAILABLE: "service_unavailable", Status.INTERNAL: "internal_error",
               Status.FAILED_PRECONDITION: "conflict_error"}
MAX_BODY_BYTES = 8 * 2**20  # As gRPC's largest message (server.py).
READ_TIMEOUT_S = 30.0  # For a request's headers, and for its body (ServerConfig's default).


@dataclasses.dataclass
class Site:
  runner: web.AppRunner
  port: int

  async def close(self) -> None:
    await self.runner.cleanup()


async def serve(app: web.Application, host: str, port: int,
                ssl_context: ssl.SSLContext | None = None,
                read_timeout_s: float = READ_TIMEOUT_S) -> Site:
  # handler_cancellation: a client that disconnects cancels its handler, which aborts the request.
  # keepalive_timeout: aiohttp closes a connection whose request headers are not all in within
  # it of its start or of its previous response: a header read timeout (a slowloris client holds
  # a connection no longer), and how long an idle keep-alive connection stays open.
  # shutdown_timeout: handlers left at close (after the drain: a client not reading its stream)
  # hold the process no longer. No access log: the per-request line of metrics.py says more.
  runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                         keepalive_timeout=read_timeout_s, shutdown_timeout=1.0)
  await runner.setup()
  await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
  return Site(runner, runner.addresses[0][1])


def build_metrics_app(metrics: Metrics) -> web.Application:
  app = web.Application()
  app.router.add_get("/metrics", metrics_handler(metrics))
  return app


def metrics_handler(metrics: Metrics):
  async def handler(_: web.Request) -> web.Response:
    return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})
  return handler


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
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
    resp = web.json_response(body, status=e.status, headers=allow)
    if e.status == 408:  # The rest of a body that came too slowly is not waited for either.
      await resp.prepare(request)
      await resp.write_eof()
      request.transport.close()
    return resp


def error_response(e: ApiError) -> web.Response:
  code = "model_not_found" if e.status is Status.NOT_FOUND else e.status.value  # OpenAI's code.
  body = {"error": {"message": e.message, "type": ERROR_TYPES[e.status], "param": None,
                    "code": code}}
  return web.json_response(body, status=HTTP_STATUS[e.status])


def error_event(e: ApiError) -> dict:
  """A stream's last event when it fails after its answer began (no status left to set)."""
  return {"error": {"message": e.message, "type": ERROR_TYPES[e.status], "code": e.status.value}}

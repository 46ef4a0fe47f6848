"""vLLM's admin routes on the HTTP port, for an RL loop that shares the device with the server
(issue 49), each an admin key's (401 without a key, 403 for a key that is not an admin's; on a
server without keys, anyone's):

  POST /sleep?level=1|2&mode=abort|wait|keep   pause (mode), then free the KV cache (1) and the
                                                weights too (2): {"level", "freed_bytes"}
  POST /wake_up                                 back, and the pause /sleep made ended
  GET  /is_sleeping                             {"is_sleeping": bool}
  POST /pause?mode=abort|wait|keep&clear_cache=true|false   {"status": "paused"}; `wait`
                                                answers once no request runs
  POST /resume                                  {"status": "resumed"}
  GET  /is_paused                               {"is_paused": bool}
  POST /reset_prefix_cache                      no cached prefix page is reused (503 while
                                                running requests hold pages)
  POST /update_weights_from_disk                SGLang's: {"model_path": folder, "in_flight":
                                                "finish"|"abort"} -> {"success", "message"};
                                                under --weights-root only (weights_from_disk.py)

What each control does, and that nothing accepted is lost (a request sent while paused or
asleep waits, and runs after /resume or /wake_up), is batching/stream_controls.py's. A control
refused in the engine's state (asleep already; /sleep after `keep` froze running requests) is
409. A route is one function in ROUTES: `route(service, accepted, request, body)`, answered as
http_api.py answers every route (the key checked, errors in OpenAI's shape).
"""

from __future__ import annotations

import json
from typing import Awaitable, Callable

from aiohttp import web

from jaxserve.batching.request import PauseMode
from jaxserve.serving.gateway import ApiError, Status, invalid
from jaxserve.serving.requests import Accepted
from jaxserve.serving.service import Service

Route = Callable[[Service, Accepted, web.Request, bytes], Awaitable[web.StreamResponse]]


def add_routes(app: web.Application, work: Callable) -> None:
  """Registers ROUTES; `work(request, run, limited)` is http_api's: it takes the request for
  its key (the drain waits for it), reads its body and answers `run(service, accepted, body)`."""
  for method, path, route in ROUTES:
    app.router.add_route(method, path, _admin(route, work))


def _admin(route: Route, work: Callable):
  async def handler(request: web.Request) -> web.StreamResponse:
    async def run(service: Service, acc: Accepted, body: bytes) -> web.StreamResponse:
      if not service.gateway.may_administer(acc.lease.key):
        raise ApiError(Status.PERMISSION_DENIED, f"{request.path} needs an admin key "
                       "(\"admin\": true in the keys file)")
      try:
        return await route(service, acc, request, body)
      except ValueError as e:  # Refused in the engine's state: the message says why.
        raise ApiError(Status.FAILED_PRECONDITION, str(e)) from None
    return await work(request, run, limited=False)
  return handler


async def sleep(service: Service, acc: Accepted, request: web.Request,
                body: bytes) -> web.Response:
  level = request.query.get("level", "1")
  if level not in ("1", "2"):
    raise invalid(f"level must be 1 (the KV cache) or 2 (the KV cache and the weights), got "
                  f"{level!r}")
  freed = await service.runner.sleep(int(level), _mode(request))
  return web.json_response({"level": int(level), "freed_bytes": freed})


async def wake_up(service: Service, acc: Accepted, request: web.Request,
                  body: bytes) -> web.Response:
  """vLLM's `tags` (weights, kv_cache) are taken, but both always wake together."""
  tags = set(request.query.getall("tags", ())) - {"weights", "kv_cache"}
  if tags:
    raise invalid(f"tags are 'weights' and 'kv_cache', got {sorted(tags)!r}")
  await service.runner.wake_up()
  return web.Response(text="")


async def is_sleeping(service: Service, acc: Accepted, request: web.Request,
                      body: bytes) -> web.Response:
  return web.json_response({"is_sleeping": service.runner.is_sleeping})


async def pause(service: Service, acc: Accepted, request: web.Request,
                body: bytes) -> web.Response:
  clear_cache = request.query.get("clear_cache", "true").lower()
  if clear_cache not in ("true", "false", "1", "0"):
    raise invalid(f"clear_cache must be true or false, got {clear_cache!r}")
  await service.runner.pause(_mode(request), clear_cache in ("true", "1"))
  return web.json_response({"status": "paused"})


async def resume(service: Service, acc: Accepted, request: web.Request,
                 body: bytes) -> web.Response:
  await service.runner.resume()
  return web.json_response({"status": "resumed"})


async def is_paused(service: Service, acc: Accepted, request: web.Request,
                    body: bytes) -> web.Response:
  return web.json_response({"is_paused": service.runner.is_paused})


async def reset_prefix_cache(service: Service, acc: Accepted, request: web.Request,
                             body: bytes) -> web.Response:
  """Forgets every cached prefix page, device and host tier."""
  if not await service.runner.reset_prefix_cache():
    raise ApiError(Status.UNAVAILABLE, "the prefix cache was not reset: running requests hold "
                   "pages; retry when they finish")
  return web.Response(text="")


async def update_weights_from_disk(service: Service, acc: Accepted, request: web.Request,
                                   body: bytes) -> web.Response:
  """SGLang's body, {"model_path": folder[, "in_flight": "finish"|"abort"]}, and answer."""
  try:
    data = json.loads(body or b"{}")
  except ValueError:
    raise invalid("the body must be a JSON object") from None
  if not isinstance(data, dict):
    raise invalid("the body must be a JSON object")
  message = await service.weights.update(data, lambda fn, *a: service.pool.run(fn, *a, owed=True))
  return web.json_response({"success": True, "message": message})


def _mode(request: web.Request) -> PauseMode:
  """The `mode` query parameter, vLLM's default abort."""
  mode = request.query.get("mode", PauseMode.ABORT.value)
  try:
    return PauseMode(mode)
  except ValueError:
    raise invalid(f"mode must be one of {[m.value for m in PauseMode]}, got {mode!r}") from None


ROUTES: tuple[tuple[str, str, Route], ...] = (
    ("POST", "/sleep", sleep),
    ("POST", "/wake_up", wake_up),
    ("GET", "/is_sleeping", is_sleeping),
    ("POST", "/pause", pause),
    ("POST", "/resume", resume),
    ("GET", "/is_paused", is_paused),
    ("POST", "/reset_prefix_cache", reset_prefix_cache),
    ("POST", "/update_weights_from_disk", update_weights_from_disk),
)

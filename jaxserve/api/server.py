"""The jaxserve server: the gRPC API, the OpenAI-compatible HTTP API and metrics, over one engine.

Its life, as `jaxserve serve` runs it:

  start()  binds the ports at once and reports health NOT_SERVING, then runs the `load` it was
           given (`jaxserve serve`'s is llm.load_engine: the model, every step shape compiled) on
           a worker thread (the event loop keeps answering health checks meanwhile; Generate
           answers UNAVAILABLE)
  ready    health SERVING: requests flow through service.Service
  drain()  on SIGTERM: health NOT_SERVING, new requests UNAVAILABLE, open streams run to their
           end for at most drain_timeout_s (then they are aborted)
  stop()   closes the ports and stops the engine thread; the process exits 0

If the engine loop raises, the server does not try to recover in-process: the failed step was
handed the donated KV cache and decode state, so nothing on the device can be trusted, and
reloading weights and recompiling costs what a restart costs. Instead every open request ends with
INTERNAL, health turns NOT_SERVING at once (never back to SERVING), new requests get UNAVAILABLE,
and `jaxserve serve` exits with status 1 for its supervisor (Kubernetes, systemd) to restart it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import ssl
import threading
from typing import Any, Callable

import grpc
from absl import logging
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxserve.api import http_api, reflection_v1
from jaxserve.api.grpc_api import SERVICE_NAME, Servicer
from jaxserve.batching.runner import Runner
from jaxserve.batching.stream import AsyncRunner
from jaxserve.config import SchedulerConfig
from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.serving import kv_publisher
from jaxserve.serving.gateway import ApiError, Gateway, Status, load_keys
from jaxserve.serving.metrics import Metrics
from jaxserve.serving.service import Service

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_MAX_MESSAGE_BYTES = 8 * 2**20


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  host: str = "127.0.0.1"  # Loopback only, unless asked.
  grpc_port: int = 50051  # 0: any free port (see Server.ports).
  http_port: int | None = 8000  # The OpenAI-compatible API; None: off.
  metrics_port: int | None = None  # None: /metrics on the HTTP port.
  keys_file: str | None = None  # None: no API keys, no limits.
  drain_timeout_s: float = 30.0
  tls_cert: str | None = None  # PEM files; both or neither.
  tls_key: str | None = None
  log_prompts: bool = False
  scheduler: SchedulerConfig = SchedulerConfig()
  kv_events: KVEventsConfig | None = None  # Publish the prefix cache's changes (vLLM's events).
  prefix_cache_scope: str | None = None  # "key" or "global"; None: "key" with keys, else global.

  def __post_init__(self):
    if (self.tls_cert is None) != (self.tls_key is None):
      raise ValueError("ServerConfig: give both tls_cert and tls_key, or neither")
    if self.drain_timeout_s < 0:
      raise ValueError(f"ServerConfig.drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


class Server:

  def __init__(self, load: Callable[[], Any], config: ServerConfig = ServerConfig()):
    """`load` runs on a worker thread at start(): it builds the engine and compiles it, and
    returns a jaxserve.llm.Loaded (its .engine, .tokenizer and .model_name). The server takes it
    from its caller: the engine side is above the front ends, which never import it."""
    self.config = config
    self.metrics = Metrics()
    self.gateway = Gateway(load_keys(config.keys_file) if config.keys_file else None,
                           prefix_cache_scope=config.prefix_cache_scope)
    self.service: Service | None = None
    self.ports: dict[str, int] = {}
    self._load = load
    self._grpc: grpc.aio.Server | None = None
    self._health = health.aio.HealthServicer()
    self._http: list[http_api.Site] = []
    self._warmup: asyncio.Task | None = None
    self._runner: AsyncRunner | None = None
    self._kv_publisher: kv_publisher.ZmqPublisher | None = None
    self.engine_failed = asyncio.Event()  # Set on the event loop when the engine loop raised.

  def current_service(self) -> Service:
    """The service, or UNAVAILABLE while warming up."""
    if self.service is None:
      raise ApiError(Status.UNAVAILABLE, "the server is warming up; retry when health is SERVING")
    return self.service

  async def start(self) -> None:
    """Binds every port and starts warming up; returns at once (see wait_ready)."""
    await self._start_grpc()
    if self.config.http_port is not None:
      metrics_here = self.config.metrics_port is None
      self._http.append(await http_api.serve(
          http_api.build_app(self, self.metrics if metrics_here else None), self.config.host,
          self.config.http_port, self._ssl_context()))
      self.ports["http"] = self._http[-1].port
    if self.config.metrics_port is not None:
      self._http.append(await http_api.serve(http_api.build_metrics_app(self.metrics),
                                             self.config.host, self.config.metrics_port))
      self.ports["metrics"] = self._http[-1].port
    self._warmup = asyncio.create_task(self._load_and_serve())

  async def wait_ready(self) -> None:
    """Returns once the engine is compiled and health is SERVING; raises if loading failed."""
    await asyncio.shield(self._warmup)

  async def drain(self) -> None:
    """Stops taking requests and lets open ones finish, for at most drain_timeout_s."""
    await self._health.enter_graceful_shutdown()
    service = self.service
    if service is None:
      return
    service.refusing = "the server is shutting down"
    logging.info("draining %d open requests (at most %.0f s)", service.num_active,
                 self.config.drain_timeout_s)
    if not await service.wait_idle(self.config.drain_timeout_s):
      logging.warning("drain timeout: aborting %d requests", service.num_active)
      service.abort_all()
      await service.wait_idle(5.0)

  async def stop(self) -> None:
    if self._warmup is not None and not self._warmup.done():
      self._warmup.cancel()
    if self._grpc is not None:
      await self._grpc.stop(grace=1.0)
    for site in self._http:
      await site.close()
    if self._runner is not None:
      self._runner.stop()
    if self._kv_publisher is not None:
      self._kv_publisher.close()

  async def run_until_signal(self, announce: Callable[[str], None] = print) -> int:
    """`jaxserve serve`: start, serve until SIGTERM or SIGINT, drain, stop. The exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
      loop.add_signal_handler(sig, stop.set)
    await self.start()
    announce(f"jaxserve: listening on {self.config.host}: " +
             " ".join(f"{name}={port}" for name, port in self.ports.items()) + " (warming up)")
    stopped = asyncio.create_task(stop.wait())
    failed = asyncio.create_task(self.engine_failed.wait())
    await asyncio.wait([self._warmup, stopped], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if self._warmup.done() and self._warmup.exception() is not None:
      announce(f"jaxserve: error: loading the model failed: {self._warmup.exception()}")
      code = 1
    elif not stop.is_set():
      announce("jaxserve: ready")
      await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
      if self.engine_failed.is_set():
        announce("jaxserve: error: the engine failed; exiting for a restart (see the log)")
        code = 1
    failed.cancel()
    announce("jaxserve: shutting down")
    await self.drain()
    await self.stop()
    return code

  async def _start_grpc(self) -> None:
    options = [("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
               ("grpc.so_reuseport", 0)]
    self._grpc = grpc.aio.server(options=options)
    Servicer(self).add_to(self._grpc)
    health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
    reflection_v1.enable((SERVICE_NAME, health.SERVICE_NAME), self._grpc)
    address = _address(self.config.host, self.config.grpc_port)
    if self.config.tls_cert is not None:
      with open(self.config.tls_key, "rb") as k, open(self.config.tls_cert, "rb") as c:
        credentials = grpc.ssl_server_credentials([(k.read(), c.read())])
      self.ports["grpc"] = self._grpc.add_secure_port(address, credentials)
    else:
      self.ports["grpc"] = self._grpc.add_insecure_port(address)
    await self._grpc.start()
    await self._set_health(_NOT_SERVING)

  async def _load_and_serve(self) -> None:
    loaded = await _in_daemon_thread(self._load)
    runner = Runner(loaded.engine, loaded.tokenizer, self.config.scheduler)
    self._kv_publisher = kv_publisher.start(self.config.kv_events, runner.scheduler)
    self._runner = AsyncRunner(runner, on_failure=self._engine_died)
    self._runner.start()
    self.metrics.watch(runner.scheduler, loaded.model_name)
    self.service = Service(self._runner, loaded.tokenizer, loaded.model_name, self.gateway,
                           self.metrics, self.config.log_prompts)
    await self._set_health(_SERVING)
    logging.info("serving %s", loaded.model_name)

  async def _set_health(self, status) -> None:
    """The whole server's and the jaxserve.v1.Jaxserve service's: they never differ."""
    for name in (health.OVERALL_HEALTH, SERVICE_NAME):
      await self._health.set(name, status)

  async def _engine_died(self, error: BaseException) -> None:
    """On the event loop, once, before the open streams get their error: refuse everything."""
    logging.error("the engine loop failed; health is NOT_SERVING until a restart",
                  exc_info=(type(error), error, error.__traceback__))
    self.service.refusing = "the engine failed; the server is restarting"
    await self._set_health(_NOT_SERVING)
    self.engine_failed.set()

  def _ssl_context(self) -> ssl.SSLContext | None:
    if self.config.tls_cert is None:
      return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
    return context


def _address(host: str, port: int) -> str:
  return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
  """Runs `fn` on a daemon thread: a SIGTERM during a long compile can still exit at once."""
  loop = asyncio.get_running_loop()
  future = loop.create_future()

  def settle(result: Any, error: BaseException | None) -> None:
    if future.done():  # Cancelled: the server stopped first.
      return
    if error is None:
      future.set_result(result)
    else:
      future.set_exception(error)

  def run():
    try:
      loop.call_soon_threadsafe(settle, fn(), None)
    except BaseException as e:  # pylint: disable=broad-except
      loop.call_soon_threadsafe(settle, None, e)

  threading.Thread(target=run, name="jaxserve-warmup", daemon=True).start()
  return await future

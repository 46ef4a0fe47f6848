"""The jaxserve server: the gRPC API, the OpenAI-compatible HTTP API and metrics, over one engine.

Its life, as `jaxserve serve` runs it:

  start()  binds the ports at once and reports health NOT_SERVING, then runs the `load` it was
           given (`jaxserve serve`'s is llm.load_engine: the model, every step shape compiled) on
           a worker thread (the event loop keeps answering health checks meanwhile; Generate
           answers UNAVAILABLE)
  ready    health SERVING: requests flow through service.Service
  SIGTERM  from this moment new requests get UNAVAILABLE (HTTP 503)
  drain()  health NOT_SERVING; every request accepted before the signal (running, queued, still
           being read or prepared) runs to its end, and what is still open shortly before
           drain_timeout_s is cut: its client gets UNAVAILABLE ("the server shut down before
           this request finished")
  stop()   closes the ports and stops the engine thread; the process exits 0, within
           drain_timeout_s of the signal (the work pool's threads are daemons: a compile left
           running does not hold it)

If the engine loop raises, the server does not try to recover in-process: the failed step was
handed the donated KV cache and decode state, so nothing on the device can be trusted, and
reloading weights and recompiling costs what a restart costs. Instead every open request ends with
INTERNAL, health turns NOT_SERVING at once (never back to SERVING), new requests get UNAVAILABLE,
and `jaxserve serve` exits with status 1 for its supervisor (Kubernetes, systemd) to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import ssl
import threading
from typing import Any, Callable

import grpc
from absl import logging
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxserve.api import http_api, http_site, kv_link, kv_transfer, reflection_v1
from jaxserve.api.grpc_api import SERVICE_NAME, Servicer
from jaxserve.api.server_config import ServerConfig
from jaxserve.batching.runner import Runner
from jaxserve.batching.stream import AsyncRunner
from jaxserve.serving import kv_publisher
from jaxserve.serving.gateway import ApiError, Gateway, Status, load_keys, one_key
from jaxserve.serving.metrics import Metrics
from jaxserve.serving.service import Service
from jaxserve.serving.work_pool import WorkPool, settle

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_MAX_MESSAGE_BYTES = 8 * 2**20


class Server:

  def __init__(self, load: Callable[[], Any], config: ServerConfig = ServerConfig()):
    """`load` runs on a worker thread at start(): it builds the engine and compiles it, and
    returns a jaxserve.llm.Loaded (its .engine, .tokenizer and .model_name). The server takes it
    from its caller: the engine side is above the front ends, which never import it."""
    self.config = config
    self.metrics = Metrics()
    keys = load_keys(config.keys_file) if config.keys_file else None
    if config.api_key is not None:
      keys = [one_key(config.api_key)]
    self.gateway = Gateway(keys, prefix_cache_scope=config.prefix_cache_scope)
    self.service: Service | None = None
    # PrefillKV's check, on a prefill server only (api/grpc_api.py refuses it elsewhere).
    self.kv_gate = kv_link.PeerGate(config.kv_peer_api_key) if config.kv_role == "prefill" \
        else None
    self.ports: dict[str, int] = {}
    self._load = load
    self._grpc: grpc.aio.Server | None = None
    self._health = health.aio.HealthServicer()
    self._http: list[http_site.Site] = []
    self._warmup: asyncio.Task | None = None
    self._runner: AsyncRunner | None = None
    self._kv_publisher: kv_publisher.ZmqPublisher | None = None
    self._pool: WorkPool | None = None
    self._shutdown_at: float | None = None  # The loop's time of the SIGTERM.
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
      timeout = self.config.http_read_timeout_s
      self._http.append(await http_site.serve(
          http_api.build_app(self, self.metrics if metrics_here else None, timeout),
          self.config.host, self.config.http_port, self._ssl_context(), timeout))
      self.ports["http"] = self._http[-1].port
    if self.config.metrics_port is not None:
      self._http.append(await http_site.serve(http_site.build_metrics_app(self.metrics),
                                             self.config.host, self.config.metrics_port))
      self.ports["metrics"] = self._http[-1].port
    self._warmup = asyncio.create_task(self._load_and_serve())

  async def wait_ready(self) -> None:
    """Returns once the engine is compiled and health is SERVING; raises if loading failed."""
    await asyncio.shield(self._warmup)

  def shut_down(self) -> None:
    """SIGTERM's first step, at once (no await): every request from now on gets UNAVAILABLE."""
    if self._shutdown_at is None:
      self._shutdown_at = asyncio.get_running_loop().time()
    if self.service is not None:
      self.service.refusing = "the server is shutting down"

  async def drain(self) -> None:
    """Stops taking requests and lets the open ones finish, within drain_timeout_s of
    shut_down(): those still open a little before then are cut (UNAVAILABLE), leaving stop()
    the rest of the time."""
    self.shut_down()
    loop = asyncio.get_running_loop()
    timeout = self.config.drain_timeout_s
    cut_at = self._shutdown_at + timeout - min(1.0, timeout / 4)
    await self._health.enter_graceful_shutdown()
    service = self.service
    if service is None:
      return
    logging.info("draining %d open requests (at most %.1f s)", service.num_active, timeout)
    if not await service.wait_idle(cut_at - loop.time()):
      logging.warning("drain timeout: cutting %d requests", service.num_active)
      service.abort_all()
      await service.wait_idle(self._time_left() / 2)

  async def stop(self) -> None:
    if self._warmup is not None and not self._warmup.done():
      self._warmup.cancel()
    if self._grpc is not None:  # Every accepted call has ended (drain): grace for health watches.
      await self._grpc.stop(grace=min(max(self._time_left(), 0.1), 1.0))
    for site in self._http:
      with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(site.close(), max(self._time_left(), 0.1))
    if self._runner is not None:
      self._runner.stop()
    if self._kv_publisher is not None:
      self._kv_publisher.close()
    if self._pool is not None:
      self._pool.close()

  def _time_left(self) -> float:
    """Of the drain timeout, since the SIGTERM (all of it when there was none)."""
    if self._shutdown_at is None:
      return self.config.drain_timeout_s
    elapsed = asyncio.get_running_loop().time() - self._shutdown_at
    return max(self.config.drain_timeout_s - elapsed, 0.0)

  async def run_until_signal(self, announce: Callable[[str], None] = print) -> int:
    """`jaxserve serve`: start, serve until SIGTERM or SIGINT, drain, stop. The exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal():
      self.shut_down()
      stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
      loop.add_signal_handler(sig, on_signal)
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
    # P/D's check at start, before the engine is used: a peer that refuses fails the start.
    peer = await kv_transfer.start(self.config, getattr(loaded.engine, "page_store", None),
                                   self.kv_gate, self.metrics.kv_transfers)
    runner = Runner(loaded.engine, loaded.tokenizer, self.config.scheduler)
    self._kv_publisher = kv_publisher.start(self.config.kv_events, runner.scheduler)
    # The constraint compiler reads the vocabulary in C, holding the GIL for a few hundred ms:
    # here, not on a serving server's first constrained request.
    await _in_daemon_thread(lambda: runner.constraints.compiler)
    # What is loaded by now (JAX, the model, the tokenizer: some 300k objects) lives as long as
    # the server: out of the collector's sight, a full collection (which holds the GIL, whichever
    # thread's allocation sets it off) scans only what requests made since, not 0.5 s of them.
    gc.collect()
    gc.freeze()
    self._runner = AsyncRunner(runner, on_failure=self._engine_died)
    self._runner.start()
    self.metrics.watch(runner.scheduler, loaded.model_name, loaded.num_compiles)
    self._pool = WorkPool(self.config.work_threads, self.config.work_queue)
    self.service = Service(self._runner, loaded.tokenizer, loaded.model_name, self.gateway,
                           self.metrics, self.config.log_prompts, self._pool,
                           getattr(loaded, "read_lora", None), peer,
                           self.config.runtime_lora_roots, getattr(loaded, "pooler", None),
                           getattr(loaded, "read_weights", None), self.config.weights_roots,
                           self.config.media)
    for name, path, adapter in getattr(loaded, "lora_modules", ()):  # Read by `load` already.
      await self.service.adapters.add(name, path, adapter)
    if self._shutdown_at is not None:  # SIGTERM came while it warmed up.
      self.service.refusing = "the server is shutting down"
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

  def run():
    try:
      loop.call_soon_threadsafe(settle, future, fn(), None)
    except BaseException as e:  # pylint: disable=broad-except
      loop.call_soon_threadsafe(settle, future, None, e)

  threading.Thread(target=run, name="jaxserve-warmup", daemon=True).start()
  return await future

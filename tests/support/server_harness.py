"""A real jaxserve server on loopback for the server tests: an event loop on a background thread,
the tiny model's engine compiled once per test session, and the gRPC client helpers (the HTTP ones
are in openai_http.py). conftest.py's `srv` fixture starts one server per module with these."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve import llm
from jaxserve.api import server
from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.api.proto import jaxserve_pb2_grpc
from jaxserve.batching.runner import Runner
from jaxserve.config import EngineConfig, SamplingParams
from jaxserve.engine.engine import Engine
from jaxserve.loading import checkpoint

# Small enough to compile in seconds: one prefill bucket, one decode width (128 / 16 = 8 pages).
ENGINE = EngineConfig(num_slots=4, page_size=16, num_pages=40, max_model_len=128,
                      prefill_buckets=(32,), compilation_cache_dir=None)
# ENGINE's shapes with a pool too small for 4 slots of long sequences (15 usable pages of 16
# tokens, 240 tokens): the tiny checkpoint's preemption tests (test_determinism,
# test_structured_output) share it, so the second loads the first's programs from the persistent
# compilation cache instead of compiling its own.
SMALL_POOL = dataclasses.replace(ENGINE, num_pages=16)
KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-abcdef", "carol": "sk-carol-xyz",
        "ops": "sk-ops-admin-42"}
HEALTH = health_pb2.HealthCheckResponse  # HEALTH.SERVING, HEALTH.NOT_SERVING: what health() says.
LIMITS = {"bob": {"requests_per_minute": 2}, "carol": {"tokens_per_minute": 60},
          "ops": {"admin": True}}  # ops: the admin key (LoRA loads, adapter folders).


@functools.lru_cache(maxsize=None)
def load(path: str):
  """(model, tokenizer) of a checkpoint, loaded once per test session."""
  return checkpoint.load_model(path)


@functools.lru_cache(maxsize=None)
def warm_engine(path: str) -> tuple[Engine, object]:
  """The tiny checkpoint's engine, compiled once and shared by the test modules (one at a time)."""
  model, tokenizer = load(path)
  engine = Engine(model, ENGINE, stop_ids=tokenizer.stop_ids)
  engine.warmup()
  return engine, tokenizer


def write_keys(path) -> str:
  entries = [{"key": key, "name": name, **LIMITS.get(name, {})} for name, key in KEYS.items()]
  path.write_text(json.dumps({"keys": entries}))
  return str(path)


class ServerThread:
  """Runs `server.Server` on its own event loop thread; tests talk to it over sockets."""

  def __init__(self, srv: server.Server):
    self.server = srv
    self.loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

  def start(self, wait_ready: bool = True) -> ServerThread:
    self._thread.start()
    self.call(self.server.start())
    if wait_ready:
      self.call(self.server.wait_ready(), timeout=300)
    return self

  def call(self, coro, timeout: float = 60):
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

  def close(self) -> None:
    self.call(self.server.drain())
    self.call(self.server.stop())
    self.loop.call_soon_threadsafe(self.loop.stop)
    self._thread.join(10)

  @property
  def grpc_address(self) -> str:
    return f"127.0.0.1:{self.server.ports['grpc']}"

  @property
  def http_url(self) -> str:
    return f"http://127.0.0.1:{self.server.ports['http']}"

  @property
  def scheduler(self):
    return self.server.service.runner._runner.scheduler


def serve(engine: Engine, tokenizer, name: str = "tiny", keys_file: str | None = None,
          **config) -> ServerThread:
  """A started server of `engine` on free ports; `config` holds other ServerConfig fields."""
  loaded = llm.Loaded(engine, tokenizer, name, read_weights=llm.read_weights)
  cfg = server.ServerConfig(grpc_port=0, http_port=0, keys_file=keys_file, **config)
  return ServerThread(server.Server(lambda: loaded, cfg)).start()


def start_tiny(path: str, keys_file: str | None = None, **config) -> ServerThread:
  return serve(*warm_engine(path), keys_file=keys_file, **config)


@functools.lru_cache(maxsize=None)
def reference_engine(path: str) -> tuple[Engine, object]:
  """The engine the offline references of server tests run on: `warm_engine`'s model and compiled
  steps (so it compiles nothing), with a KV cache and decode state of its own. A reference Runner
  on the served engine itself shared the server's KV pool without its allocator: it overwrote
  pages the server's prefix cache still pointed to, and later requests read another's KV."""
  engine, tokenizer = warm_engine(path)
  twin = copy.copy(engine)
  twin.params, twin.cache, twin.state, twin.stop_ids = engine.assembly.place(
      engine.params, tokenizer.stop_ids)
  return twin, tokenizer


def offline(engine: Engine, tokenizer, requests: list[tuple[list[int], SamplingParams]]) -> list:
  """What a server must give `requests`: a fresh Runner's outputs (its own prefix cache) on
  `engine`, which must not be the served one (`reference_engine` gives one that is safe)."""
  return Runner(engine, tokenizer).generate(requests)


def stub(channel: grpc.Channel) -> jaxserve_pb2_grpc.JaxserveStub:
  return jaxserve_pb2_grpc.JaxserveStub(channel)


def auth(name: str = "alice") -> tuple[tuple[str, str], ...]:
  return (("authorization", f"Bearer {KEYS[name]}"),)


def generate(grpc_stub, req: pb.GenerateRequest, key: str | None = "alice",
             timeout: float = 60) -> list:
  """Every message of one Generate stream; `key` None sends no API key."""
  return list(grpc_stub.Generate(req, metadata=auth(key) if key else None, timeout=timeout))


def health(channel: grpc.Channel, service: str = "") -> int:
  return health_pb2_grpc.HealthStub(channel).Check(
      health_pb2.HealthCheckRequest(service=service), timeout=10).status


def text_request(text: str, **fields) -> pb.GenerateRequest:
  return pb.GenerateRequest(text=text, **fields)


def idle(scheduler) -> bool:
  """Nothing queued or running and every KV page back in the pool."""
  pages = scheduler.pages
  return (not scheduler.waiting and not scheduler.running
          and pages.num_free_pages == pages.num_usable_pages)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
  """Whether `predicate` held within `timeout` seconds (polled every 5 ms)."""
  deadline = time.monotonic() + timeout
  while not predicate():
    if time.monotonic() > deadline:
      return False
    time.sleep(0.005)
  return True


def wait_idle(srv: ServerThread, timeout: float = 10.0) -> None:
  assert wait_until(lambda: idle(srv.scheduler), timeout), "the engine never went idle"

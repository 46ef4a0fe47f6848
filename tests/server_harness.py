"""A real jaxserve server on loopback for the server tests: an event loop on a background thread,
the tiny model's engine compiled once per test session, and small client helpers."""

from __future__ import annotations

import asyncio
import functools
import json
import threading

import grpc

from jaxserve import llm
from jaxserve.api import server
from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.api.proto import jaxserve_pb2_grpc
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.loading import checkpoint

# Small enough to compile in seconds: one prefill bucket, one decode width (128 / 16 = 8 pages).
ENGINE = EngineConfig(num_slots=4, page_size=16, num_pages=40, max_model_len=128,
                      prefill_buckets=(32,), compilation_cache_dir=None)
KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-abcdef", "carol": "sk-carol-xyz"}
LIMITS = {"bob": {"requests_per_minute": 2}, "carol": {"tokens_per_minute": 60}}


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
    return self.server.service.runner.runner.scheduler


def start_tiny(path: str, keys_file: str | None = None, **config) -> ServerThread:
  engine, tokenizer = warm_engine(path)
  loaded = llm.Loaded(engine, tokenizer, "tiny")
  cfg = server.ServerConfig(grpc_port=0, http_port=0, keys_file=keys_file, **config)
  return ServerThread(server.Server(lambda: loaded, cfg)).start()


def stub(channel: grpc.Channel) -> jaxserve_pb2_grpc.JaxserveStub:
  return jaxserve_pb2_grpc.JaxserveStub(channel)


def auth(name: str = "alice") -> tuple[tuple[str, str], ...]:
  return (("authorization", f"Bearer {KEYS[name]}"),)


def text_request(text: str, **fields) -> pb.GenerateRequest:
  return pb.GenerateRequest(text=text, **fields)


def idle(scheduler) -> bool:
  """Nothing queued or running and every KV page back in the pool."""
  pages = scheduler.pages
  return (not scheduler.waiting and not scheduler.running
          and pages.num_free_pages == pages.num_usable_pages)

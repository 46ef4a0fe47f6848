"""The engine loop raising mid-step: every open request ends with INTERNAL, health turns
NOT_SERVING before anyone hears of the failure and never comes back, new requests get UNAVAILABLE,
and `run_until_signal` (what `jaxserve serve` runs) returns exit status 1 for a supervisor."""

import asyncio
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from jaxserve import llm
from jaxserve.api import server
from support import server_harness as h
from support.server_harness import health

NOT_SERVING = h.HEALTH.NOT_SERVING
SERVING = h.HEALTH.SERVING
LONG = dict(max_tokens=100, ignore_eos=True)


class FaultyEngine:
  """The real engine, whose step raises once armed (before touching the device state, so the
  shared test engine stays usable). The other side of the runner's interface, not a mock of it."""

  def __init__(self, engine, armed: bool = False):
    self._engine = engine
    self.armed = threading.Event()
    if armed:
      self.armed.set()

  def __getattr__(self, name):
    return getattr(self._engine, name)

  def step(self, plan):
    if self.armed.is_set():
      raise FloatingPointError("injected fault in step")
    return self._engine.step(plan)


def test_open_streams_get_internal_and_health_stays_down(tiny_checkpoint):
  engine, tokenizer = h.warm_engine(str(tiny_checkpoint))
  faulty = FaultyEngine(engine)
  cfg = server.ServerConfig(grpc_port=0, http_port=0)
  st = h.ServerThread(server.Server(lambda: llm.Loaded(faulty, tokenizer, "tiny"), cfg)).start()
  with grpc.insecure_channel(st.grpc_address) as ch:
    stub = h.stub(ch)
    done = list(stub.Generate(h.text_request("Hello", max_tokens=5, ignore_eos=True)))
    assert sum(len(m.token_ids) for m in done) == 5 and health(ch) == SERVING

    streams = [stub.Generate(h.text_request(f"Story {i}", **LONG)) for i in range(3)]
    for s in streams:
      next(s)  # Each is running: its first token is out.
    faulty.armed.set()
    for s in streams:
      with pytest.raises(grpc.RpcError) as e:
        list(s)
      assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
      assert "engine failed" in e.value.details()
      assert health(ch) == NOT_SERVING  # Already, when the first client hears of the failure.

    with pytest.raises(grpc.RpcError) as e:
      list(stub.Generate(h.text_request("Hi", max_tokens=1)))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "engine failed" in e.value.details()
    with pytest.raises(urllib.error.HTTPError) as http_error:
      urllib.request.urlopen(urllib.request.Request(
          st.http_url + "/v1/completions", data=b'{"prompt": "Hi", "max_tokens": 1}',
          headers={"Content-Type": "application/json"}))
    assert http_error.value.code == 503
    assert st.server.engine_failed.is_set()
    time.sleep(0.2)
    assert health(ch) == NOT_SERVING
  st.call(st.server.stop())
  st.loop.call_soon_threadsafe(st.loop.stop)


def test_serve_exits_nonzero_when_the_engine_dies(tiny_checkpoint):
  """What a supervisor sees: `run_until_signal` returns 1 (not 0, not a hang)."""
  engine, tokenizer = h.warm_engine(str(tiny_checkpoint))
  faulty = FaultyEngine(engine, armed=True)
  srv = server.Server(lambda: llm.Loaded(faulty, tokenizer, "tiny"),
                      server.ServerConfig(grpc_port=0, http_port=None))
  said, codes = [], []

  def client():
    assert h.wait_until(lambda: "jaxserve: ready" in said, 60)
    with grpc.insecure_channel(f"127.0.0.1:{srv.ports['grpc']}") as ch:
      try:
        list(h.stub(ch).Generate(h.text_request("Hello", max_tokens=4)))
      except grpc.RpcError as e:
        codes.append(e.code())

  async def main():
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    code = await asyncio.wait_for(srv.run_until_signal(said.append), 60)
    await asyncio.to_thread(thread.join, 10)
    return code

  assert asyncio.run(main()) == 1
  assert codes == [grpc.StatusCode.INTERNAL]
  assert any("engine failed" in line for line in said), said

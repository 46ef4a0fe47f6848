"""The server's life on the tiny model: health NOT_SERVING while warming up and while draining,
SERVING between; UNAVAILABLE for requests at both ends; the drain timeout; TLS."""

import asyncio
import json
import shutil
import subprocess
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2

from jaxserve import llm
from jaxserve.api import server
from jaxserve.api.proto import jaxserve_pb2 as pb
from support import server_harness as h
from support.server_harness import health as status

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG = dict(max_tokens=60, ignore_eos=True, temperature=1.0, seed=3)


def gated_server(tiny_checkpoint, **config):
  """A server whose warm-up ends when the returned event is set."""
  engine, tokenizer = h.warm_engine(str(tiny_checkpoint))
  warmed = threading.Event()

  def load():
    assert warmed.wait(60)
    return llm.Loaded(engine, tokenizer, "tiny")

  cfg = server.ServerConfig(grpc_port=0, http_port=0, **config)
  return h.ServerThread(server.Server(load, cfg)).start(wait_ready=False), warmed


def test_health_follows_warmup_and_drain(tiny_checkpoint):
  st, warmed = gated_server(tiny_checkpoint)
  with grpc.insecure_channel(st.grpc_address) as ch:
    stub = h.stub(ch)
    assert status(ch) == status(ch, "jaxserve.v1.Jaxserve") == NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
      list(stub.Generate(h.text_request("Hi", max_tokens=1)))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in e.value.details()
    with pytest.raises(urllib.error.HTTPError) as http_error:
      urllib.request.urlopen(st.http_url + "/v1/models")
    assert http_error.value.code == 503

    warmed.set()
    st.call(st.server.wait_ready())
    assert status(ch) == status(ch, "jaxserve.v1.Jaxserve") == SERVING

    running = stub.Generate(h.text_request("Tell me a story", **LONG))
    first = next(running)
    draining = asyncio.run_coroutine_threadsafe(st.server.drain(), st.loop)
    assert h.wait_until(lambda: status(ch) == NOT_SERVING)
    assert status(ch, "jaxserve.v1.Jaxserve") == NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
      list(stub.Generate(h.text_request("Hi", max_tokens=1)))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
    assert not draining.done()  # The open stream holds the drain...
    rest = list(running)  # ...and runs to its end.
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 60
    draining.result(10)
  st.call(st.server.stop())
  st.loop.call_soon_threadsafe(st.loop.stop)
  assert h.idle(st.server.service.runner._runner.scheduler)


def test_drain_timeout_aborts_what_is_left(tiny_checkpoint):
  st, warmed = gated_server(tiny_checkpoint, drain_timeout_s=0.1, metrics_port=0)
  warmed.set()
  st.call(st.server.wait_ready())
  metrics_url = f"http://127.0.0.1:{st.server.ports['metrics']}/metrics"
  assert b"jaxserve:num_requests_running" in urllib.request.urlopen(metrics_url, timeout=10).read()
  with pytest.raises(urllib.error.HTTPError):  # Not on the API port when it has its own.
    urllib.request.urlopen(st.http_url + "/metrics", timeout=10)
  with grpc.insecure_channel(st.grpc_address) as ch:
    running = h.stub(ch).Generate(h.text_request("Tell me a story", **dict(LONG, max_tokens=120)))
    next(running)
    st.call(st.server.drain())
    with pytest.raises(grpc.RpcError) as e:
      list(running)
  assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shut down" in e.value.details()
  st.call(st.server.stop())
  st.loop.call_soon_threadsafe(st.loop.stop)
  assert h.idle(st.server.service.runner._runner.scheduler)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(tiny_checkpoint, tmp_path):
  cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                  "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                  "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
  st, warmed = gated_server(tiny_checkpoint, tls_cert=str(cert), tls_key=str(key))
  warmed.set()
  st.call(st.server.wait_ready())
  try:
    credentials = grpc.ssl_channel_credentials(cert.read_bytes())
    with grpc.secure_channel(st.grpc_address, credentials) as ch:
      info = h.stub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
      assert info.name == "tiny"
    with grpc.insecure_channel(st.grpc_address) as ch:  # Plain text is not served.
      with pytest.raises(grpc.RpcError):
        h.stub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    import ssl
    context = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{st.server.ports['http']}/v1/models"
    models = json.loads(urllib.request.urlopen(url, context=context, timeout=10).read())
    assert models["data"][0]["id"] == "tiny"
  finally:
    st.close()


def test_a_failed_load_is_reported_and_never_serves():
  def load():
    raise FileNotFoundError("no such model: /nowhere")

  st = h.ServerThread(server.Server(load, server.ServerConfig(grpc_port=0, http_port=None)))
  st.start(wait_ready=False)
  try:
    with pytest.raises(FileNotFoundError, match="nowhere"):
      st.call(st.server.wait_ready())
    with grpc.insecure_channel(st.grpc_address) as ch:
      assert status(ch) == NOT_SERVING
      with pytest.raises(grpc.RpcError) as e:
        list(h.stub(ch).Generate(h.text_request("Hi", max_tokens=1)))
      assert e.value.code() == grpc.StatusCode.UNAVAILABLE
  finally:
    st.close()

"""End to end with the real default model: `jaxserve serve` as a process, `jaxserve client`, and
SIGTERM mid-request (health NOT_SERVING, new requests refused, open streams finish, exit 0)."""

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.cli import main as cli
from jaxserve.loading import checkpoint
from support import server_harness as h
from support.server_harness import HEALTH, health

QUESTION = "What is the capital of France?"
# test_router.py's replica shapes: its replicas (run first) left these programs in the persistent
# compilation cache, so this server loads them instead of compiling.
SHAPES = ["--slots", "2", "--buckets", "64", "--max-model-len", "256", "--num-pages", "48",
          "--page-size", "16"]


def chat(text, **fields) -> pb.GenerateRequest:
  messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)])
  return pb.GenerateRequest(chat=messages, **fields)


@pytest.fixture(scope="module")
def serve_process(tmp_path_factory):
  log = tmp_path_factory.mktemp("serve") / "stderr.log"
  args = [sys.executable, "-m", "jaxserve.cli.main", "serve",
          "--model", str(checkpoint.resolve(None)), "--grpc-port", "0", "--http-port", "0",
          *SHAPES, "--drain-timeout", "60"]
  with open(log, "w") as stderr:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
  first = proc.stdout.readline()
  ports = dict(re.findall(r"(\w+)=(\d+)", first))
  assert "grpc" in ports, (first, log.read_text())
  yield proc, f"127.0.0.1:{ports['grpc']}", log
  if proc.poll() is None:
    proc.kill()
    proc.wait()


@pytest.mark.real_model
def test_serve_client_and_sigterm_drain(serve_process, capsys):
  proc, address, log = serve_process
  with grpc.insecure_channel(address) as channel:
    assert health(channel) == HEALTH.NOT_SERVING  # Loading and compiling.
    deadline = time.monotonic() + 300
    while health(channel) != HEALTH.SERVING:
      assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
      time.sleep(0.2)

    assert cli.main(["client", QUESTION, "--address", address, "--max-tokens", "8"]) == 0
    assert "Paris" in capsys.readouterr().out

    stub = h.stub(channel)
    answer = stub.Generate(chat(QUESTION, max_tokens=16, temperature=0.0))
    long = stub.Generate(chat("Count.", max_tokens=48, ignore_eos=True, temperature=0.0))
    first = next(answer)
    proc.send_signal(signal.SIGTERM)
    while health(channel) != HEALTH.NOT_SERVING:  # `long` keeps the server draining meanwhile.
      time.sleep(0.005)
    with pytest.raises(grpc.RpcError) as e:
      list(stub.Generate(chat("Hi", max_tokens=1)))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    rest, counted = list(answer), list(long)
  assert first.text + "".join(m.text for m in rest) == "The capital of France is Paris."
  assert rest[-1].finish_reason == pb.FINISH_REASON_STOP
  assert counted[-1].finish_reason == pb.FINISH_REASON_LENGTH
  assert sum(len(m.token_ids) for m in counted) == 48
  assert proc.wait(60) == 0
  assert "jaxserve: shutting down" in proc.stdout.read()
  logged = log.read_text()
  assert logged.count(" finished: ") == 3 and "France" not in logged  # No prompt text.

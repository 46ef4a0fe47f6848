"""SIGTERM while `jaxserve serve` is loaded (the tiny model, as a process): every request accepted
before it ends with either its complete output or UNAVAILABLE (an HTTP one whose body is still
arriving included), every request after it is refused, the process exits 0 within the drain
timeout, and none is lost without a status."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc

from support import server_harness as h
from support.server_harness import HEALTH, health

NUM_REQUESTS = 48  # More than the drain can finish: some are cut, whatever the CPU.
DRAIN_S = 1.0
BODY = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()


def stream(address, i, results, started):
  max_tokens = 40 + 10 * (i % 9)
  with grpc.insecure_channel(address) as ch:
    tokens = 0
    try:
      for msg in h.stub(ch).Generate(h.text_request(f"Story {i}:", max_tokens=max_tokens,
                                                    ignore_eos=True), timeout=120):
        tokens += len(msg.token_ids)
        started.set()
        last = msg
      results[i] = ("ok", tokens == max_tokens and last.finish_reason == 2, tokens)  # LENGTH
    except grpc.RpcError as e:
      results[i] = (e.code().name, e.details(), tokens)


def slow_upload(port: int) -> socket.socket:
  """An HTTP request whose headers and first body bytes are sent: accepted, its body arriving."""
  sock = socket.create_connection(("127.0.0.1", port), timeout=30)
  sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(BODY)}\r\n"
               f"Content-Type: application/json\r\n\r\n".encode() + BODY[:10])
  return sock


def late_http(port: int) -> int:
  """The status of a request sent now (the server is still draining its streams: it answers)."""
  req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=BODY)
  try:
    return urllib.request.urlopen(req, timeout=10).status
  except urllib.error.HTTPError as e:
    return e.code


def test_sigterm_under_load(tiny_checkpoint, tmp_path):
  log = tmp_path / "stderr.log"
  args = [sys.executable, "-m", "jaxserve.cli.main", "serve", "--model", str(tiny_checkpoint),
          "--grpc-port", "0", "--http-port", "0", "--slots", "4", "--buckets", "32",
          "--max-model-len", "128", "--num-pages", "40", "--drain-timeout", str(DRAIN_S)]
  with open(log, "w") as stderr:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
  try:
    ports = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", proc.stdout.readline())}
    address = f"127.0.0.1:{ports['grpc']}"
    with grpc.insecure_channel(address) as ch:
      deadline = time.monotonic() + 120
      while health(ch) != HEALTH.SERVING:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
      results, started = {}, threading.Event()
      threads = [threading.Thread(target=stream, args=(address, i, results, started))
                 for i in range(NUM_REQUESTS)]
      for t in threads:
        t.start()
      assert started.wait(60)
      finishing, never_ending = slow_upload(ports["http"]), slow_upload(ports["http"])
      time.sleep(0.3)  # Both accepted: their handlers are reading their bodies.
      proc.send_signal(signal.SIGTERM)
      signalled = time.monotonic()
      late = [late_http(ports["http"])]  # At once: refused from the signal on.
      while proc.poll() is None and health(ch) != HEALTH.NOT_SERVING:
        time.sleep(0.005)
      try:
        list(h.stub(ch).Generate(h.text_request("late", max_tokens=2), timeout=10))
        late.append("served")
      except grpc.RpcError as e:
        late.append((e.code(), e.details()))
      finishing.sendall(BODY[10:])
      with finishing, never_ending:
        answers = [sock.recv(65536) for sock in (finishing, never_ending)]
    for t in threads:
      t.join(60)
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    took = time.monotonic() - signalled
  finally:
    if proc.poll() is None:
      proc.kill()
  assert late[0] == 503, late
  assert late[1][0] == grpc.StatusCode.UNAVAILABLE and "shut" in late[1][1], late
  # Accepted before the signal: served, or (queued behind the streams) cut at the drain timeout;
  # never refused as a new request ("the server is shutting down").
  assert answers[0].startswith(b"HTTP/1.1 200") or (
      answers[0].startswith(b"HTTP/1.1 503") and b"shut down before" in answers[0]), answers[0]
  assert answers[1].startswith(b"HTTP/1.1 503") and b"shut down before" in answers[1], answers[1]
  assert took < DRAIN_S + 0.25, f"exited {took:.2f} s after SIGTERM (drain timeout {DRAIN_S} s)"
  assert sorted(results) == list(range(NUM_REQUESTS))  # Every request ended, with a status.
  outcomes = {}
  for i, (kind, detail, tokens) in results.items():
    outcomes[kind] = outcomes.get(kind, 0) + 1
    if kind == "ok":
      assert detail is True, (i, tokens)  # Complete: all its tokens and a LENGTH finish.
    else:
      assert kind == "UNAVAILABLE" and "shut" in detail, (i, kind, detail)  # Cut, or too late.
  assert outcomes.get("ok", 0) >= 1 and outcomes.get("UNAVAILABLE", 0) >= 1, outcomes
  assert "jaxserve: shutting down" in proc.stdout.read()

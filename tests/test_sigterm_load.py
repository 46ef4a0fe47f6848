"""SIGTERM while `jaxserve serve` is loaded (the tiny model, as a process): every request ends with
either its complete output or UNAVAILABLE, the process exits 0, and none is lost without a
status."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc

from support import server_harness as h
from support.server_harness import HEALTH, health

NUM_REQUESTS = 16


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


def test_sigterm_under_load(tiny_checkpoint, tmp_path):
  log = tmp_path / "stderr.log"
  args = [sys.executable, "-m", "jaxserve.cli.main", "serve", "--model", str(tiny_checkpoint),
          "--grpc-port", "0", "--http-port", "-1", "--slots", "4", "--buckets", "32",
          "--max-model-len", "128", "--num-pages", "40", "--drain-timeout", "1.0"]
  with open(log, "w") as stderr:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
  try:
    ports = dict(re.findall(r"(\w+)=(\d+)", proc.stdout.readline()))
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
      proc.send_signal(signal.SIGTERM)
      late = []
      while proc.poll() is None and health(ch) != HEALTH.NOT_SERVING:
        time.sleep(0.005)
      try:
        list(h.stub(ch).Generate(h.text_request("late", max_tokens=2), timeout=10))
      except grpc.RpcError as e:
        late.append(e.code())
    for t in threads:
      t.join(60)
    assert proc.wait(60) == 0, log.read_text()[-3000:]
  finally:
    if proc.poll() is None:
      proc.kill()
  assert late in ([grpc.StatusCode.UNAVAILABLE], [])  # [] if it had already exited.
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

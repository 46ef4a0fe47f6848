"""`jaxserve serve` in a process of its own, on free ports: for the tests that need a real OS
process (a router in front of replicas, P/D between two servers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def healthy(url: str) -> bool:
  try:
    with urllib.request.urlopen(url + "/health", timeout=2) as r:
      return r.status == 200
  except OSError:
    return False


class ServerProcess:
  """One `jaxserve serve --model MODEL *flags` process; its stderr goes to `log_dir`."""

  def __init__(self, model: str, flags: list[str], log_dir, wait: bool = True):
    self.log = log_dir / "stderr.log"
    args = [sys.executable, "-m", "jaxserve.cli.main", "serve", "--model", model,
            "--grpc-port", "0", "--http-port", "0", *flags]
    with open(self.log, "w") as stderr:
      self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    self.ports = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", self.proc.stdout.readline())}
    assert "http" in self.ports, self.log.read_text()[-3000:]
    self.url = f"http://127.0.0.1:{self.ports['http']}"
    self.grpc_address = f"127.0.0.1:{self.ports['grpc']}"
    if wait:
      self.wait_healthy()

  def wait_healthy(self, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not healthy(self.url):
      assert self.proc.poll() is None, self.log.read_text()[-3000:]
      assert time.monotonic() < deadline, "the server never became healthy"
      time.sleep(0.5)

  def metric(self, name: str, **labels) -> float:
    """The sum of `name`'s samples (counters: their _total) whose labels include `labels`."""
    with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
      text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == name
               for s in f.samples if s.name in (name, name + "_total")
               and labels.items() <= s.labels.items())

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()

"""vllm-router (the Rust router on PyPI) in front of two `jaxserve serve` replicas, through the
official `openai` client: every request answered, streams intact, requests sharing a long prefix
sent to the replica whose prefix cache holds it, and a replica stopped (SIGTERM) mid-run costing
no request. The replicas start once per module; which one answered is read from each replica's
own `jaxserve:request_success` counter."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.loading import checkpoint
from support.server_process import ServerProcess, healthy

pytestmark = pytest.mark.real_model

PAGE_SIZE = 16
REPLICA_FLAGS = ["--slots", "2", "--buckets", "64", "--max-model-len", "256",
                 "--num-pages", "48", "--page-size", str(PAGE_SIZE), "--drain-timeout", "60"]
# 159 tokens that no other test sends: whichever replica prefills it first is the only holder.
PREFIX = "Background for the router test. " + " ".join(
    f"Shelf {i} holds {i * 7 % 13} red books and {i * 5 % 11} blue ones." for i in range(10))
QUESTIONS = ["Name a color.", "Count to three.", "Say hello.", "Name a fruit."]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Replica(ServerProcess):
  """One `jaxserve serve` process on free ports."""

  def __init__(self, log_dir):
    super().__init__(str(checkpoint.resolve(None)), REPLICA_FLAGS, log_dir, wait=False)

  def num_finished(self) -> float:
    return self.metric("jaxserve:request_success")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
  """One after the other: the second loads the first's programs from the XLA compilation cache
  instead of compiling them again on the same two cores."""
  started = []
  try:
    for i in range(2):
      started.append(Replica(tmp_path_factory.mktemp(f"replica{i}")))
      started[-1].wait_healthy()
    yield started
  finally:
    for r in started:
      r.stop()


class Router:
  """vllm-router at its defaults but for the policy (its retries and circuit breaker included;
  health checks every 60 s, so a stopped replica is found by its refusals)."""

  def __init__(self, replicas: list[Replica], policy: str):
    router_bin = shutil.which("vllm-router", path=os.path.dirname(sys.executable))
    assert router_bin, "vllm-router is missing: pip install -e '.[test]'"
    port, self.metrics_port = _free_port(), _free_port()
    self.proc = subprocess.Popen(
        [router_bin, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
         "--worker-urls", *[r.url for r in replicas], "--prometheus-port", str(self.metrics_port),
         "--worker-startup-check-interval", "1", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    self.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not healthy(self.url):
      assert self.proc.poll() is None and time.monotonic() < deadline
      time.sleep(0.2)
    self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                timeout=300)
    # Asked once: the router sends GET /v1/models to one replica and does not retry it, so it
    # can fail while a replica stops (generation requests are retried).
    self.model = self.client.models.list().data[0].id

  def num_retries(self) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
      text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "vllm_router_retries" for s in f.samples)

  def __enter__(self) -> Router:
    return self

  def __exit__(self, *exc) -> None:
    self.proc.kill()
    self.proc.wait()


def _chat(client, model: str, question: str, stream: bool) -> tuple[str, str, int]:
  """(text, finish_reason, completion tokens) of one greedy chat request."""
  fields = dict(model=model, messages=[{"role": "user", "content": question}],
                max_tokens=12, temperature=0.0)
  if not stream:
    r = client.chat.completions.create(**fields)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
  chunks = list(client.chat.completions.create(**fields, stream=True,
                                               stream_options={"include_usage": True}))
  deltas = [c.choices[0] for c in chunks if c.choices]
  assert sum(1 for d in deltas if d.delta.content) > 1  # Streamed, not sent in one piece.
  assert chunks[-1].usage is not None and not chunks[-1].choices
  return ("".join(d.delta.content or "" for d in deltas), deltas[-1].finish_reason,
          chunks[-1].usage.completion_tokens)


def test_every_request_answered_and_streams_intact(replicas):
  before = [r.num_finished() for r in replicas]
  jobs = [(q, stream) for q in QUESTIONS for stream in (False, True)]
  with Router(replicas, "round_robin") as router:
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
      ask = lambda job: _chat(router.client, router.model, *job)
      answers = dict(zip(jobs, pool.map(ask, jobs)))
  for q in QUESTIONS:  # Greedy and batch-invariant: the stream is the whole answer, in order.
    assert answers[(q, True)] == answers[(q, False)]
    text, reason, tokens = answers[(q, False)]
    assert text and reason in ("stop", "length") and 0 < tokens <= 12
  served = [r.num_finished() - b for r, b in zip(replicas, before)]
  assert sum(served) == len(jobs) and min(served) > 0, served  # Both replicas took requests.


def _num_tokens(url: str, text: str) -> int:
  request = urllib.request.Request(url + "/tokenize", data=json.dumps({"prompt": text}).encode())
  with urllib.request.urlopen(request, timeout=10) as r:
    return json.loads(r.read())["count"]


def _complete(client, model: str, question: str):
  return client.completions.create(model=model, prompt=f"{PREFIX}\nQ: {question}\nA:",
                                   max_tokens=4, temperature=0.0)


def test_shared_prefix_lands_on_the_replica_that_holds_it(replicas):
  num_prefix = _num_tokens(replicas[0].url, PREFIX)
  with Router(replicas, "cache_aware") as router:
    before = [r.num_finished() for r in replicas]
    first = _complete(router.client, router.model, QUESTIONS[0])
    holder = [r.num_finished() - b for r, b in zip(replicas, before)].index(1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # Nobody held it yet.
    for q in QUESTIONS[1:]:
      before = [r.num_finished() for r in replicas]
      r = _complete(router.client, router.model, q)
      assert [x.num_finished() - b for x, b in zip(replicas, before)] == [holder == 0, holder == 1]
      # Every whole page of the prefix came from the cache (its last token may merge with "\n").
      cached = r.usage.prompt_tokens_details.cached_tokens
      assert cached >= (num_prefix - 1) // PAGE_SIZE * PAGE_SIZE
  # The other replica never saw the prefix: sent there directly, nothing is cached.
  other = openai.OpenAI(base_url=replicas[1 - holder].url + "/v1", api_key="none")
  assert _complete(other, router.model, QUESTIONS[0]).usage.prompt_tokens_details.cached_tokens == 0


def test_replica_stopped_mid_run_costs_no_request(replicas):
  """SIGTERM (what Kubernetes sends) to one replica while 12 requests run through a round-robin
  router 6 at a time: it finishes what it holds and refuses the rest with 503, which the router
  retries on the other; the requests sent after it exited are answered too."""
  questions = [f"Write a sentence about the number {i}." for i in range(12)]
  with Router(replicas, "round_robin") as router:
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
      futures = [pool.submit(_chat, router.client, router.model, q, i % 2 == 1)
                 for i, q in enumerate(questions)]
      while not any(f.done() for f in futures):
        time.sleep(0.05)
      replicas[1].proc.send_signal(signal.SIGTERM)
      answers = [f.result() for f in futures]  # Raises if any request failed.
    assert all(text and reason in ("stop", "length") for text, reason, _ in answers)
    assert replicas[1].proc.wait(60) == 0
    assert router.num_retries() > 0  # Some requests did reach the stopped replica.
    left = replicas[0].num_finished()
    assert all(_chat(router.client, router.model, q, False)[0] for q in QUESTIONS)
    assert replicas[0].num_finished() - left == len(QUESTIONS)  # The survivor takes them all.

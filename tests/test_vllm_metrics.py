"""/metrics under vLLM's names (issue 27): what llm-d's endpoint picker and the GKE Inference
Gateway read, beside the jaxserve: families, the same values, labelled model_name."""

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.api.proto import jaxserve_pb2 as pb
from support import mock_serving
from support import server_harness as h
from support.mock_engine import MockEngine

MODEL = (("model_name", "mock"),)
# vLLM family -> its type, for every family llm-d or vLLM's dashboards read that we measure.
TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}


@pytest.fixture
def gate():
  return mock_serving.Gate()


@pytest.fixture
def srv(gate):
  # 2 slots, 4-token pages, 159 usable pages.
  engine = MockEngine(num_slots=2, num_pages=160, max_model_len=256, next_token=gate,
                      vocab_size=mock_serving.VOCAB_SIZE)
  server = mock_serving.serve(engine)
  yield server
  gate.open()
  server.close()


def scrape(srv):
  text = urllib.request.urlopen(srv.http_url + "/metrics", timeout=10).read().decode()
  families = {f.name: f for f in text_string_to_metric_families(text)}
  samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in families.values() for s in f.samples}
  return families, samples


def same_as_ours(samples):
  """Every vllm: sample equals the jaxserve: sample it mirrors, label for label."""
  vllm = {k: v for k, v in samples.items() if k[0].startswith("vllm:")
          and not k[0].startswith(("vllm:cache_config_info", "vllm:inter_token"))}
  for (name, labels), value in vllm.items():
    ours = (name.replace("vllm:", "jaxserve:"), tuple(l for l in labels if l[0] != "model_name"))
    assert samples[ours] == value, (name, labels)
    assert ("model_name", "mock") in labels, name
  return len(vllm)


def start(stub, prompt, max_tokens):
  return stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                                          ignore_eos=True), metadata=(), timeout=30)


def test_names_types_and_values_follow_the_server(srv, gate):
  stub = h.stub(grpc.insecure_channel(srv.grpc_address))
  families, samples = scrape(srv)
  for name, kind in TYPES.items():
    assert families[name].type == kind, name
  info = [s for s in families["vllm:cache_config_info"].samples]
  assert len(info) == 1 and info[0].value == 1
  assert info[0].labels["block_size"] == "4" and info[0].labels["num_gpu_blocks"] == "159"
  # Three requests for two slots, stopped inside a step: 2 running, 1 waiting, pages held.
  sched = srv.scheduler
  three_in = lambda: len(sched.running) == 2 and len(sched.waiting) == 1
  gate.close(when=three_in)
  # The first two must still run when the third has been prepared (on the work pool) and queued:
  # 200 tokens take 0.2 s, not the 20 ms in which a cold server's third request could miss them.
  gate.token_s = 0.001
  streams = [start(stub, list(range(10 * i + 1, 10 * i + 11)), 200) for i in range(3)]
  assert h.wait_until(three_in)
  _, samples = scrape(srv)
  pages = srv.scheduler.pages
  assert samples[("vllm:num_requests_running", MODEL)] == 2
  assert samples[("vllm:num_requests_waiting", MODEL)] == 1
  used = samples[("vllm:kv_cache_usage_perc", MODEL)]
  assert 0 < used < 1 and used == 1 - pages.num_free_pages / pages.num_usable_pages
  assert same_as_ours(samples) >= 5
  gate.open()
  for stream in streams:
    assert list(stream)[-1].finish_reason == pb.FINISH_REASON_LENGTH
  # The same prompt again: its first two pages (8 of its 10 tokens) come from the cache.
  list(start(stub, list(range(1, 11)), 3))
  h.wait_idle(srv)
  _, samples = scrape(srv)
  assert samples[("vllm:prompt_tokens_total", MODEL)] == 40
  assert samples[("vllm:generation_tokens_total", MODEL)] == 3 * 200 + 3
  assert samples[("vllm:request_success_total", (("finished_reason", "length"),) + MODEL)] == 4
  assert samples[("vllm:prefix_cache_queries_total", MODEL)] == pages.num_query_tokens == 40
  assert samples[("vllm:prefix_cache_hits_total", MODEL)] == pages.num_hit_tokens == 8
  assert samples[("vllm:num_preemptions_total", MODEL)] == srv.scheduler.num_preemptions
  for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
               "request_queue_time_seconds", "request_prefill_time_seconds",
               "request_decode_time_seconds"):
    assert samples[(f"vllm:{name}_count", MODEL)] == 4, name
  assert samples[("vllm:inter_token_latency_seconds_count", MODEL)] == 3 * 199 + 2
  assert samples[("vllm:time_per_output_token_seconds_count", MODEL)] == 3 * 199 + 2
  assert samples[("vllm:num_requests_running", MODEL)] == 0
  assert samples[("vllm:kv_cache_usage_perc", MODEL)] == 0
  assert same_as_ours(samples) >= 40

"""Prometheus metrics under vLLM's names (with a `jaxserve:` prefix), and one log line per request.

Both come from one `RequestRecord`, built when a request ends, so the log line answers "why was
the first token slow?" with the same numbers the histograms hold:

  time_to_first_token ~= tokenize + queue (waiting for a slot and pages) + prefill

Engine gauges and counters (running, waiting, KV usage, prefix cache, preemptions) are read from
the scheduler when Prometheus scrapes, not pushed every step.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, Sequence

import prometheus_client
from absl import logging
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.batching.request import FinishReason, Request
from jaxserve.batching.scheduler import Scheduler
from jaxserve.batching.speculative import SpecStats
from jaxserve.serving.vllm_metrics import VllmCollector

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5)


@dataclasses.dataclass(frozen=True)
class RequestRecord:
  """A finished request's counts and time breakdown (seconds; None where it never got there)."""

  request_id: str
  key_name: str
  finish_reason: FinishReason
  num_prompt_tokens: int
  num_cached_tokens: int
  num_output_tokens: int
  tokenize: float
  queue: float | None  # Arrival at the queue to first admission.
  prefill: float | None  # First admission to the first token.
  time_to_first_token: float | None  # Receipt by the server (before tokenizing) to the first token.
  token_intervals: Sequence[float]  # Between consecutive output tokens.
  total: float  # Receipt to the end.

  @classmethod
  def of(cls, req: Request, key_name: str, reason: FinishReason, received: float, tokenize: float,
         end: float) -> RequestRecord:
    t = req.timings
    times = list(t.token_times)
    return cls(
        req.request_id, key_name, reason, req.num_prompt_tokens, req.num_cached_tokens,
        len(times), tokenize, t.queue_time,
        None if t.first_token is None or t.admitted is None else t.first_token - t.admitted,
        None if t.first_token is None else t.first_token - received,
        tuple(b - a for a, b in zip(times, times[1:])), end - received)

  @property
  def time_per_output_token(self) -> float | None:
    n = len(self.token_intervals)
    return sum(self.token_intervals) / n if n else None

  @property
  def decode(self) -> float | None:
    """First token to the last (vLLM's decode time)."""
    return None if self.time_to_first_token is None else sum(self.token_intervals)

  def log_line(self) -> str:
    """Counts and milliseconds; never the prompt or output text."""
    ms = lambda s: "-" if s is None else f"{s * 1e3:.1f}ms"
    return (f"request {self.request_id} finished: key={self.key_name} "
            f"reason={self.finish_reason.value} prompt_tokens={self.num_prompt_tokens} "
            f"cached_tokens={self.num_cached_tokens} completion_tokens={self.num_output_tokens} "
            f"tokenize={ms(self.tokenize)} queue={ms(self.queue)} prefill={ms(self.prefill)} "
            f"ttft={ms(self.time_to_first_token)} tpot={ms(self.time_per_output_token)} "
            f"total={ms(self.total)}")



class Metrics:
  """One registry per server, so several servers (tests) never share counts."""

  def __init__(self):
    self.registry = prometheus_client.CollectorRegistry()
    prometheus_client.ProcessCollector(registry=self.registry)  # Resident memory, CPU, open fds.
    hist = lambda name, doc, buckets: prometheus_client.Histogram(
        f"jaxserve:{name}", doc, buckets=buckets, registry=self.registry)
    count = lambda name, doc, labels=(): prometheus_client.Counter(
        f"jaxserve:{name}", doc, labels, registry=self.registry)
    self.ttft = hist("time_to_first_token_seconds", "Receipt to first token.", _LATENCY_BUCKETS)
    self.tpot = hist("time_per_output_token_seconds", "Between output tokens.", _TOKEN_BUCKETS)
    self.queue = hist("request_queue_time_seconds", "Waiting for a slot and KV pages.",
                      _LATENCY_BUCKETS)
    self.prefill = hist("request_prefill_time_seconds", "Admission to first token.",
                        _LATENCY_BUCKETS)
    self.e2e = hist("e2e_request_latency_seconds", "Receipt to the last token.", _LATENCY_BUCKETS)
    self.decode = hist("request_decode_time_seconds", "First token to the last.",
                       _LATENCY_BUCKETS)
    self.prompt_tokens = count("prompt_tokens", "Prompt tokens of requests that reached prefill.")
    self.generation_tokens = count("generation_tokens", "Output tokens sent.")
    self.requests = count("request_success", "Finished requests.", ("finished_reason",))
    self.rejected = count("request_rejected", "Requests refused before the queue.", ("code",))
    self.kv_transfers = count("kv_transfers", "P/D handoffs from the prefill server, by outcome "
                              "(ok, or why pages were recomputed).", ("outcome",))

  def watch(self, scheduler: Scheduler, model_name: str = "",
            num_compiles: Callable[[], int] | None = None) -> None:
    """Reads `scheduler` (and `num_compiles()`, the process's XLA compiles) at each scrape, and
    serves every family again under vLLM's names."""
    engine = _SchedulerCollector(scheduler, num_compiles)
    self.registry.register(engine)
    pages = scheduler.pages
    self.registry.register(VllmCollector(
        (engine, self.ttft, self.tpot, self.queue, self.prefill, self.e2e, self.decode,
         self.prompt_tokens, self.generation_tokens, self.requests), model_name,
        pages.page_size, pages.num_pages, pages.enable_prefix_caching))

  def observe(self, record: RequestRecord) -> None:
    for histogram, value in ((self.ttft, record.time_to_first_token), (self.queue, record.queue),
                             (self.prefill, record.prefill), (self.e2e, record.total),
                             (self.decode, record.decode)):
      if value is not None:
        histogram.observe(value)
    for interval in record.token_intervals:
      self.tpot.observe(interval)
    self.requests.labels(record.finish_reason.value).inc()
    logging.info("%s", record.log_line())

  def exposition(self) -> bytes:
    return prometheus_client.generate_latest(self.registry)


class _SchedulerCollector:
  """Engine state read at scrape time. The scheduler lives on the engine thread; these are
  single reads of ints and container lengths, which need no lock."""

  def __init__(self, scheduler: Scheduler, num_compiles: Callable[[], int] | None):
    self._scheduler, self._num_compiles = scheduler, num_compiles

  def collect(self) -> Iterator:
    s = self._scheduler
    pages = s.pages
    yield GaugeMetricFamily("jaxserve:num_requests_running", "Requests holding a slot.",
                            value=len(s.running))
    yield GaugeMetricFamily("jaxserve:num_requests_waiting", "Requests in the queue.",
                            value=len(s.waiting))
    # Cached pages that nobody holds count as free: an allocation may evict them.
    used = 1 - pages.num_free_pages / pages.num_usable_pages
    yield GaugeMetricFamily("jaxserve:kv_cache_usage_perc", "KV pages in use (1 = all).",
                            value=used)
    window = s.window_pages
    if window is not None:  # Sliding-window layers' pages (Gemma 3), as the KV pool's above.
      yield GaugeMetricFamily("jaxserve:kv_window_usage_perc", "Window pages in use (1 = all).",
                              value=1 - window.num_free_pages / window.num_usable_pages)
    yield CounterMetricFamily("jaxserve:prefix_cache_queries", "Prompt tokens looked up.",
                              value=pages.num_query_tokens)
    yield CounterMetricFamily("jaxserve:prefix_cache_hits", "Prompt tokens found cached.",
                              value=pages.num_hit_tokens)
    yield CounterMetricFamily("jaxserve:num_preemptions", "Requests preempted.",
                              value=s.num_preemptions)
    if self._num_compiles is not None:
      yield CounterMetricFamily("jaxserve:xla_compiles", "XLA programs compiled (or loaded from "
                                "the compilation cache); none after warm-up.",
                                value=self._num_compiles())
    if pages.host is not None:
      yield CounterMetricFamily("jaxserve:prefix_cache_host_hits",
                                "Prompt tokens found in the host tier.",
                                value=pages.num_host_hit_tokens)
      yield GaugeMetricFamily("jaxserve:kv_offload_pages", "KV pages in the host tier.",
                              value=pages.host.num_used)
    if s.speculative is not None:
      yield from _speculative_metrics(s.spec_stats)
    if s.loras is not None:
      yield from _lora_metrics(s)


def _lora_metrics(s: Scheduler) -> Iterator:
  """vLLM's `lora_requests_info`: the adapters of the running and of the waiting requests (comma
  separated names, in labels), the adapter slots, and the time now as its value (as vLLM's)."""
  names = lambda reqs: ",".join(sorted({r.lora.lora_name for r in reqs if r.lora is not None}))
  running, waiting = names(list(s.running)), names(s.waiting.snapshot())
  for prefix in ("jaxserve:", "vllm:"):
    info = GaugeMetricFamily(f"{prefix}lora_requests_info", "Running stats on LoRA requests.",
                             labels=["running_lora_adapters", "waiting_lora_adapters",
                                     "max_lora"])
    info.add_metric([running, waiting, str(s.loras.num_slots)], time.time())
    yield info


def _speculative_metrics(stats: SpecStats) -> Iterator:
  """Speculative decoding's counters, under our prefix and under vLLM's names beside it
  (`vllm:spec_decode_*`, which dashboards built for vLLM read)."""
  for prefix in ("jaxserve:", "vllm:"):
    yield CounterMetricFamily(f"{prefix}spec_decode_num_drafts", "Proposed runs verified.",
                              value=stats.num_drafts)
    yield CounterMetricFamily(f"{prefix}spec_decode_num_draft_tokens", "Tokens proposed.",
                              value=stats.num_draft_tokens)
    yield CounterMetricFamily(f"{prefix}spec_decode_num_accepted_tokens", "Proposals accepted.",
                              value=stats.num_accepted_tokens)
    per_pos = CounterMetricFamily(f"{prefix}spec_decode_num_accepted_tokens_per_pos",
                                  "Proposals accepted at each position of a run.",
                                  labels=["position"])
    for i, n in enumerate(stats.accepted_per_pos):
      per_pos.add_metric([str(i)], n)
    yield per_pos

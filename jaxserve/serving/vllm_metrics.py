"""The metrics again under vLLM's names, for routers that read a model server as vLLM.

llm-d's endpoint picker, the GKE Inference Gateway and KServe read `vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (a fraction, 0-1) and
`vllm:cache_config_info{block_size, num_gpu_blocks}` from any pod without an engine-type label
(llm-d "Model Servers"; gateway-api-inference-extension proposal 003). The rest are the
counters and histograms of vLLM's `vllm/v1/metrics/loggers.py` that jaxserve measures too.

Every sample is copied at scrape time from the `jaxserve:` family it mirrors, with a
`model_name` label added, so the two names can never disagree.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

# jaxserve family -> the vLLM families it is also served as. vLLM renamed the per-token interval
# to inter_token_latency (v0.10); both names are read by dashboards, so both are served.
VLLM_NAMES = {
    "jaxserve:num_requests_running": ("vllm:num_requests_running",),
    "jaxserve:num_requests_waiting": ("vllm:num_requests_waiting",),
    "jaxserve:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc",),
    "jaxserve:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "jaxserve:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "jaxserve:num_preemptions": ("vllm:num_preemptions",),
    "jaxserve:prompt_tokens": ("vllm:prompt_tokens",),
    "jaxserve:generation_tokens": ("vllm:generation_tokens",),
    "jaxserve:request_success": ("vllm:request_success",),
    "jaxserve:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "jaxserve:time_per_output_token_seconds": ("vllm:time_per_output_token_seconds",
                                               "vllm:inter_token_latency_seconds"),
    "jaxserve:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "jaxserve:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "jaxserve:request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "jaxserve:request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
}


class VllmCollector:
  """Collects `sources` (the collectors of the jaxserve families) under vLLM's names."""

  def __init__(self, sources: Iterable, model_name: str, page_size: int, num_pages: int,
               enable_prefix_caching: bool):
    self._sources = tuple(sources)
    self._model_name = model_name
    # vLLM's num_gpu_blocks counts the blocks a request may get: page 0 is our scratch page.
    self._cache_config = {"block_size": str(page_size), "num_gpu_blocks": str(num_pages - 1),
                          "enable_prefix_caching": str(enable_prefix_caching)}

  def collect(self) -> Iterator[Metric]:
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache config.",
                             labels=list(self._cache_config))
    info.add_metric(list(self._cache_config.values()), 1.0)
    yield info
    for source in self._sources:
      for family in source.collect():
        for name in VLLM_NAMES.get(family.name, ()):
          yield self._renamed(family, name)

  def _renamed(self, family: Metric, name: str) -> Metric:
    out = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
      out.add_sample(name + sample.name[len(family.name):],
                     {**sample.labels, "model_name": self._model_name}, sample.value,
                     sample.timestamp)
    return out

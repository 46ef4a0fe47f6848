"""The server's settings (api/server.py's; `jaxserve serve`'s flags): its ports, API keys, TLS,
drain, P/D role, work pool and limits on images, checked when made. The scheduler's config rides
along to the runner it builds.
"""

from __future__ import annotations

import dataclasses

from jaxserve.api import http_site, kv_link
from jaxserve.config import SchedulerConfig
from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.serving.media import MediaLimits


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  host: str = "127.0.0.1"  # Loopback only, unless asked.
  grpc_port: int = 50051  # 0: any free port (see Server.ports).
  http_port: int | None = 8000  # The OpenAI-compatible API; None: off.
  metrics_port: int | None = None  # None: /metrics on the HTTP port.
  keys_file: str | None = None  # None: no API keys, no limits.
  api_key: str | None = None  # vLLM's --api-key: one admin key, no limits (not with keys_file).
  drain_timeout_s: float = 30.0
  tls_cert: str | None = None  # PEM files; both or neither.
  tls_key: str | None = None
  log_prompts: bool = False
  scheduler: SchedulerConfig = SchedulerConfig()
  kv_events: KVEventsConfig | None = None  # Publish the prefix cache's changes (vLLM's events).
  # Prefill/decode disaggregation (api/kv_transfer.py, the link api/kv_link.py): "prefill"
  # serves PrefillKV to the holders of `kv_peer_api_key` (required unless bound to loopback);
  # "decode" brings each prompt's KV from the prefill server at `kv_peer` (host:port of its
  # gRPC API) presenting `kv_peer_api_key`, over TLS verified by `kv_peer_tls_ca` when given,
  # each handoff within `kv_peer_timeout_s`; "both": neither role, every prompt prefilled here.
  kv_role: str = "both"
  kv_peer: str | None = None
  kv_peer_api_key: str | None = None
  kv_peer_tls_ca: str | None = None
  kv_peer_timeout_s: float = 10.0
  prefix_cache_scope: str | None = None  # "key" or "global"; None: "key" with keys, else global.
  # Run-time LoRA loads and unloads (serving/adapters.py): None off; else on, for admin keys,
  # reading adapter folders only from under these directories.
  runtime_lora_roots: tuple[str, ...] | None = None
  # POST /update_weights_from_disk reads weights only from under these (none: the route is off).
  weights_roots: tuple[str, ...] = ()
  # Each request's CPU work (parsing, tokenizing, constraint compiles, large responses) runs on
  # this many threads; a request that finds work_queue others waiting gets RESOURCE_EXHAUSTED.
  work_threads: int = 4
  work_queue: int = 1024
  http_read_timeout_s: float = http_site.READ_TIMEOUT_S  # For a request's headers, and its body.
  media: MediaLimits = MediaLimits()  # A request's images: how many, how large, which files.

  def __post_init__(self):
    if (self.tls_cert is None) != (self.tls_key is None):
      raise ValueError("ServerConfig: give both tls_cert and tls_key, or neither")
    kv_link.check_config(self)
    if self.api_key is not None and self.keys_file is not None:
      raise ValueError("ServerConfig: give keys_file (--keys-file) or api_key (--api-key), not "
                       "both")
    if self.runtime_lora_roots is not None and not self.runtime_lora_roots:
      raise ValueError("ServerConfig: run-time LoRA updates (--enable-runtime-lora-updates) need "
                       "at least one directory to load adapters from (--lora-root DIR)")
    for field in ("drain_timeout_s", "work_queue"):
      if getattr(self, field) < 0:
        raise ValueError(f"ServerConfig.{field} must be >= 0, got {getattr(self, field)}")
    for field in ("work_threads", "http_read_timeout_s"):
      if getattr(self, field) <= 0:
        raise ValueError(f"ServerConfig.{field} must be > 0, got {getattr(self, field)}")

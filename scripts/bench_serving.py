"""Load generator against a running `jaxserve serve`, over gRPC streaming.

  python scripts/bench_serving.py --address 127.0.0.1:50051 \
      --workload scripts/workloads/peers_64.jsonl --request-rate 4 [--num-requests 64] \
      [--json out.json]
  python scripts/bench_serving.py --concurrency 16 ...          # a fixed number in flight instead

Requests arrive as a Poisson process at --request-rate per second (inter-arrival times drawn from
an exponential distribution, seeded), or --concurrency keeps that many in flight. Each workload
line is JSON with `prompt` (text) or `prompt_token_ids`, and `max_tokens`; end-of-sequence is
ignored so every request generates its full budget. Reported, as in vLLM's and JetStream's serving
benchmarks: time to first token (TTFT), time per output token after the first (TPOT), inter-token
latency (ITL, every gap between streamed tokens) and end-to-end latency, each at p50/p90/p99 and
mean; request and token throughput over the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time

import grpc
import numpy as np

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.api.proto import jaxserve_pb2_grpc


@dataclasses.dataclass
class Result:
  ok: bool
  prompt_tokens: int = 0
  output_tokens: int = 0
  ttft: float = 0.0
  e2e: float = 0.0
  gaps: list[float] = dataclasses.field(default_factory=list)  # Between streamed tokens.
  error: str = ""


def load_workload(path: str, num: int | None) -> list[dict]:
  with open(path) as f:
    items = [json.loads(line) for line in f if line.strip()]
  return items[:num] if num else items


def to_request(item: dict) -> pb.GenerateRequest:
  prompt = ({"token_ids": pb.TokenIds(ids=item["prompt_token_ids"])} if "prompt_token_ids" in item
            else {"text": item["prompt"]})
  return pb.GenerateRequest(**prompt, max_tokens=int(item["max_tokens"]), temperature=0.0,
                            ignore_eos=True, chunk_tokens=1)


async def send(stub, req: pb.GenerateRequest, metadata) -> Result:
  start = last = time.perf_counter()
  result = Result(ok=True)
  try:
    async for msg in stub.Generate(req, metadata=metadata):
      now = time.perf_counter()
      if msg.token_ids:
        if result.output_tokens == 0:
          result.ttft = now - start
        else:
          result.gaps.append(now - last)
        result.output_tokens += len(msg.token_ids)
        last = now
      if msg.finish_reason:
        result.prompt_tokens = msg.usage.prompt_tokens
  except grpc.aio.AioRpcError as e:
    return Result(ok=False, error=f"{e.code().name}: {e.details()}")
  result.e2e = time.perf_counter() - start
  return result


async def run(args) -> tuple[list[Result], float]:
  items = load_workload(args.workload, args.num_requests)
  metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
  rng = np.random.default_rng(args.seed)
  async with grpc.aio.insecure_channel(args.address) as channel:
    stub = jaxserve_pb2_grpc.JaxserveStub(channel)
    start = time.perf_counter()
    if args.concurrency:
      gate = asyncio.Semaphore(args.concurrency)

      async def gated(item):
        async with gate:
          return await send(stub, to_request(item), metadata)

      results = await asyncio.gather(*(gated(item) for item in items))
    else:
      tasks = []
      for item in items:
        tasks.append(asyncio.create_task(send(stub, to_request(item), metadata)))
        await asyncio.sleep(rng.exponential(1 / args.request_rate))
      results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(results: list[Result], wall: float) -> dict:
  ok = [r for r in results if r.ok]
  stats = lambda xs: ({"mean": float(np.mean(xs)),
                       **{f"p{p}": float(np.percentile(xs, p)) for p in (50, 90, 99)}}
                      if xs else {})
  tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
  out_tokens = sum(r.output_tokens for r in ok)
  return {
      "requests": len(results), "failed": len(results) - len(ok),
      "errors": sorted({r.error for r in results if not r.ok}),
      "wall_s": wall, "request_throughput": len(ok) / wall,
      "output_token_throughput": out_tokens / wall,
      "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / wall,
      "ttft_s": stats([r.ttft for r in ok]), "tpot_s": stats(tpot),
      "itl_s": stats([g for r in ok for g in r.gaps]), "e2e_s": stats([r.e2e for r in ok]),
  }


def print_report(s: dict) -> None:
  print(f"requests {s['requests']} ({s['failed']} failed), wall {s['wall_s']:.1f} s, "
        f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output tokens/s, "
        f"{s['total_token_throughput']:.1f} total tokens/s")
  print("| metric | mean | p50 | p90 | p99 |\n|---|---|---|---|---|")
  for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
    row = s[name]
    if row:
      print(f"| {name[:-2].upper()} ms | "
            + " | ".join(f"{1000 * row[k]:.1f}" for k in ("mean", "p50", "p90", "p99")) + " |")
  for error in s["errors"]:
    print(f"error: {error}", file=sys.stderr)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--address", default="127.0.0.1:50051")
  parser.add_argument("--workload", default="scripts/workloads/peers_64.jsonl")
  parser.add_argument("--num-requests", type=int, default=None, help="first N lines (default: all)")
  mode = parser.add_mutually_exclusive_group()
  mode.add_argument("--request-rate", type=float, default=4.0, help="Poisson arrivals per second")
  mode.add_argument("--concurrency", type=int, default=0,
                    help="requests in flight, instead of a rate")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--api-key", default=None)
  parser.add_argument("--json", default=None, help="write the summary here")
  args = parser.parse_args(argv)
  results, wall = asyncio.run(run(args))
  summary = summarize(results, wall)
  print_report(summary)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), **summary}, f, indent=2)
  return 0 if not summary["failed"] else 1


if __name__ == "__main__":
  sys.exit(main())

"""What serving costs around the model: `python -m scripts.bench serving | structured | host`
(each command's --help says how).

  serving     load against a running `jaxserve serve` over gRPC: TTFT, TPOT, ITL, end-to-end
  structured  64 requests, half of them JSON-schema constrained, against none; grammar compiles
  host        the Runner and Scheduler's host time per step at 64 busy slots, a zero-cost engine
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import sys
import time
from typing import Sequence

import grpc
import numpy as np

import jaxserve
from jaxserve import Constraint, EngineConfig, SamplingParams
from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.api.proto import jaxserve_pb2_grpc
from jaxserve.batching.plan import EngineInfo, StepPlan
from jaxserve.batching.runner import Runner
from jaxserve.config import SchedulerConfig
from jaxserve.text.constraint import ConstraintCompiler

from . import harness

# ---- serving


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


def main_serving(argv=None) -> int:
  """Load generator against a running `jaxserve serve`, over gRPC streaming.

    python -m scripts.bench serving --address 127.0.0.1:50051 \\
        --workload scripts/workloads/peers_64.jsonl --request-rate 4 [--num-requests 64] \\
        [--json out.json]
    python -m scripts.bench serving --concurrency 16 ...    # a fixed number in flight instead

  Requests arrive as a Poisson process at --request-rate per second (inter-arrival times drawn
  from an exponential distribution, seeded), or --concurrency keeps that many in flight. Each
  workload line is JSON with `prompt` (text) or `prompt_token_ids`, and `max_tokens`;
  end-of-sequence is ignored so every request generates its full budget. Reported, as in vLLM's
  and JetStream's serving benchmarks: time to first token (TTFT), time per output token after
  the first (TPOT), inter-token latency (ITL, every gap between streamed tokens) and end-to-end
  latency, each at p50/p90/p99 and mean; request and token throughput over the whole run.
  """
  parser = harness.parser("serving", main_serving.__doc__)
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


# ---- structured

SCHEMAS = {
    "flat": {"type": "object",
             "properties": {"name": {"type": "string", "maxLength": 16},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "role": {"enum": ["admin", "user", "guest"]},
        "home": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "pos": {"type": "object", "properties": {
                "x": {"type": "integer", "minimum": -9, "maximum": 9},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
                "required": ["x", "tags"]}}, "required": ["city", "pos"]},
        "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
        "required": ["id", "role", "home", "scores"]},
}


def compile_times(tokenizer, repeats: int = 5) -> dict[str, float]:
  """Milliseconds per compile of each schema, cache off (a fresh compiler holds none)."""
  out = {}
  for name, schema in SCHEMAS.items():
    times = []
    for _ in range(repeats):
      compiler = ConstraintCompiler(tokenizer, max_grammars=0)
      start = time.perf_counter()
      compiler.compile(Constraint.json_schema(schema))
      times.append(time.perf_counter() - start)
    out[name] = 1000 * statistics.median(times)
  return out


def run_constrained(llm, prompts, params) -> dict[str, float]:
  runner = llm.runner
  constraints, steps0 = runner.constraints, runner.scheduler.num_steps
  masks0, mask_s0 = constraints.num_masks, constraints.mask_seconds
  start = time.perf_counter()
  outs = llm.generate(prompts, params, chat=True)
  wall = time.perf_counter() - start
  tokens = sum(len(o.token_ids) for o in outs)
  steps = runner.scheduler.num_steps - steps0
  mask_s = constraints.mask_seconds - mask_s0
  return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": steps,
          "mask_rows": constraints.num_masks - masks0, "mask_ms_per_step": 1000 * mask_s / steps,
          "ms_per_step": 1000 * wall / steps}


def main_structured(argv=None) -> int:
  """Constrained decoding's cost: 64 requests with half of them JSON-schema constrained vs none,
  grammar compile time per schema, and the host time per step spent filling masks.

    python -m scripts.bench structured                 # the default model, 16 slots, 64 requests
    python -m scripts.bench structured --requests 16   # quicker

  Both workloads run on one engine, one after the other, with the same prompts and seeds; the
  constrained half decodes every other step (batching/constrained.py), so its requests take
  about twice the steps, while the free half keeps the overlap. Prints a markdown table and, with
  --json, the numbers. Wall times on a machine shared with other work are noisy: read the ratios.
  """
  p = harness.parser("structured", main_structured.__doc__)
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--max-tokens", type=int, default=64)
  p.add_argument("--json", action="store_true")
  args = p.parse_args(argv)
  llm = jaxserve.LLM(engine_config=EngineConfig(num_slots=args.slots, max_model_len=512,
                                                prefill_buckets=(64, 128)))
  prompts = [f"Describe user number {i} of a website as JSON." for i in range(args.requests)]
  free = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens)
          for i in range(args.requests)]
  constraint = Constraint.json_schema(SCHEMAS["nested"])
  half = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens,
                         constraint=constraint if i % 2 else None) for i in range(args.requests)]
  # Warms the grammar cache and the llguidance tokenizer.
  llm.generate(prompts[:2], half[:2], chat=True)
  result = {"none": run_constrained(llm, prompts, free),
            "half": run_constrained(llm, prompts, half),
            "compile_ms": compile_times(llm.tokenizer)}
  result["half_over_none_tokens_per_s"] = (result["half"]["tokens_per_s"]
                                           / result["none"]["tokens_per_s"])
  if args.json:
    print(json.dumps(result, indent=2))
  print("| workload | tokens | steps | wall s | tokens/s | ms/step | mask rows | mask ms/step |")
  print("|---|---|---|---|---|---|---|---|")
  for name in ("none", "half"):
    r = result[name]
    print(f"| {name} constrained | {r['tokens']} | {r['steps']} | {r['wall_s']:.1f} | "
          f"{r['tokens_per_s']:.1f} | {r['ms_per_step']:.1f} | {r['mask_rows']} | "
          f"{r['mask_ms_per_step']:.2f} |")
  print(f"\nhalf / none tokens/s: {result['half_over_none_tokens_per_s']:.2f}")
  print("compile ms per schema (cache off): " +
        ", ".join(f"{k} {v:.2f}" for k, v in result["compile_ms"].items()))
  return 0


# ---- host

class _Done:

  def __init__(self, tokens: np.ndarray):
    self._tokens = tokens

  def result(self) -> np.ndarray:
    return self._tokens


class ZeroEngine:
  """plan.Engine that does no work: tokens come from a few precomputed arrays. Its limits are the
  default EngineConfig's (prefill buckets, prompts per step), so the scheduler plans as it would
  for the real engine."""

  sleep_level = 0  # Never asleep.

  def __init__(self, num_slots: int, num_pages: int, page_size: int = 16,
               max_model_len: int = 2048, vocab_size: int = 49152):
    config = EngineConfig(num_slots=num_slots, page_size=page_size, num_pages=num_pages,
                          max_model_len=max_model_len)
    self.info = EngineInfo(num_slots, page_size, num_pages, max_model_len,
                           config.prefill_buckets[-1], True, vocab_size,
                           config.prefill_buckets, config.dtype.value,
                           config.max_prefill_seqs)
    rng = np.random.default_rng(0)
    # Ordinary word-piece ids of a gpt2-style vocab, so the detokenizer makes real text.
    self._tokens = [rng.integers(300, 8000, num_slots, dtype=np.int32) for _ in range(97)]
    self._n = 0

  def step(self, plan: StepPlan, bitmask: np.ndarray | None = None) -> _Done:
    """One token per decode slot, then one per chunk that ends its prompt."""
    n = len(plan.decode_slots) + sum(ch.is_last for ch in plan.prefills)
    self._n += 1
    tokens = self._tokens[self._n % len(self._tokens)]
    return _Done(np.resize(tokens, n))


class NullTokenizer:
  stop_ids = frozenset()
  eos_id = None

  def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return ""


def host_overhead(num_slots: int, num_requests: int, tokenizer,
                  stop: Sequence[str]) -> dict[str, float]:
  rng = random.Random(0)
  engine = ZeroEngine(num_slots, num_pages=num_slots * 64 + 1)
  runner = Runner(engine, tokenizer, SchedulerConfig())
  for i in range(num_requests):
    prompt = [rng.randrange(300, 8000) for _ in range(rng.randint(64, 256))]
    runner.add_request(prompt, SamplingParams(max_tokens=rng.randint(256, 768), ignore_eos=True,
                                              stop=stop))
  wall, cpu, busy = [], [], []
  while runner.has_unfinished:
    busy.append(len(runner.scheduler.running) == num_slots)
    start, start_cpu = time.perf_counter(), time.thread_time()
    runner.step()
    cpu.append(time.thread_time() - start_cpu)
    wall.append(time.perf_counter() - start)
  busy = np.array(busy)
  busy[:50] = False  # Skip the first steps (cold caches, the first big admissions).
  stats = {"steps": len(wall), "busy_steps": int(busy.sum())}
  for name, times in (("wall", np.array(wall) * 1e3), ("cpu", np.array(cpu) * 1e3)):
    stats[name] = (times[busy].mean(), np.percentile(times[busy], 50),
                   np.percentile(times[busy], 99), times.mean())
  return stats


def main_host(argv=None) -> None:
  """Host overhead per step: the Runner and Scheduler at 64 busy slots with a zero-cost engine.

  Everything measured is host work: planning, page bookkeeping, reading tokens back, stop
  checks, detokenizing and building outputs. Target: under 1 ms per step. Both wall time and this
  thread's CPU time are reported: on a loaded machine the wall time's tail is other processes.

    python -m scripts.bench host              # a null tokenizer: scheduler + runner only
    python -m scripts.bench host --tokenizer  # SmolLM2's tokenizer and the detokenizer too
  """
  parser = harness.parser("host", main_host.__doc__)
  parser.add_argument("--slots", type=int, default=64)
  parser.add_argument("--requests", type=int, default=256)
  parser.add_argument("--tokenizer", action="store_true",
                      help="detokenize with SmolLM2's tokenizer (and check a stop string)")
  args = parser.parse_args(argv)
  tokenizer, stop = NullTokenizer(), ()
  if args.tokenizer:
    from jaxserve.loading import pull  # pylint: disable=g-import-not-at-top
    from jaxserve.text.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
    tokenizer, stop = Tokenizer.from_gguf(pull.gguf_path(pull.SMOLLM2)), ("\n\nUser:",)
  r = host_overhead(args.slots, args.requests, tokenizer, stop)
  print(f"{args.slots} slots, {args.requests} requests, "
        f"{'SmolLM2 tokenizer + stop string' if args.tokenizer else 'null tokenizer'}: "
        f"{r['steps']} steps, {r['busy_steps']} with every slot decoding")
  for name in ("wall", "cpu"):
    mean, p50, p99, overall = r[name]
    print(f"  {name:4s} ms/step, all slots busy: mean {mean:.3f}, p50 {p50:.3f}, p99 {p99:.3f}; "
          f"over all steps: mean {overall:.3f}")


COMMANDS = {"serving": main_serving, "structured": main_structured, "host": main_host}

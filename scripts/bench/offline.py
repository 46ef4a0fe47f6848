"""Whole runs through the offline API, one side of each comparison in its own fresh process:
`python -m scripts.bench quant | speculative | step | lora | offload` (each command's --help
says how).

  quant        --quantization none, gguf and int8: decode step time and the 64-request workload
  speculative  speculative decoding (n-gram or a draft model) against none, interleaved rounds
  step         this tree's engine against another source tree's (--old): one engine call per
               iteration against the design before it
  lora         the 64-request workload with 0, 1 and 8 LoRA adapters, and one merged
  offload      a multi-turn chat whose prefixes need 4x the device pool, without and with the
               prefix cache's host tier; its workload (`Chat`, `run_chat`) is the ablation's too

Nothing here imports jaxserve at the top: `step` puts the tree it measures first on sys.path
before the first jaxserve import.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

from . import harness

# ---- quant

MODES = ("none", "gguf", "int8")


def _llm(mode: str, slots: int, layers: str = "scan"):
  from jaxserve.config import EngineConfig
  from jaxserve.llm import LLM

  cfg = EngineConfig(num_slots=slots, page_size=16, max_model_len=512,
                     num_pages=slots * 32 + 1, prefill_buckets=(64, 128, 256),
                     compilation_cache_dir=None, quantization=mode,
                     unroll_layers={"scan": False, "unrolled": True}[layers])
  return LLM(None, engine_config=cfg)


def _generate_s(llm, prompts, max_tokens: int) -> float:
  from jaxserve.config import SamplingParams

  params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
  t = time.perf_counter()
  llm.generate(prompts, params)
  return time.perf_counter() - t


def measure(mode: str, args) -> dict:
  out = {"mode": mode, "decode_ms": {}}
  for slots in args.slots_list:
    llm = _llm(mode, slots, args.layers)
    prompts = [[100 + i] * 8 for i in range(slots)]
    _generate_s(llm, prompts, 2)  # Compiles nothing new; warms the host path.
    short, long = (min(harness.timed(lambda: _generate_s(llm, prompts, n), 2, warmup=False))
                   for n in (args.steps, 2 * args.steps))
    out["decode_ms"][str(slots)] = 1e3 * (long - short) / args.steps
  if args.requests:
    from jaxserve.config import SamplingParams

    work = [json.loads(line) for line in harness.WORKLOAD.read_text().splitlines()]
    work = work[:args.requests]
    llm = _llm(mode, 64, args.layers)
    params = [SamplingParams(temperature=0, max_tokens=min(r["max_tokens"], args.max_tokens),
                             ignore_eos=True) for r in work]
    t = time.perf_counter()
    llm.generate([r["prompt_token_ids"] for r in work], params)
    out["workload_s"] = time.perf_counter() - t
  out["load_avg"] = os.getloadavg()[0]
  return out


def matmul_scan() -> None:
  """30 SmolLM2-shaped [M, 576] x [576, 1536] layers under one scan, weights float32, int8 per
  output channel, int8 + a float32 scale per 32 inputs, or int8 + float32 scale and minimum per
  32 (the gguf form): min of 7 runs, each form back to back in this one process."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  L, D, F, g = 30, 576, 1536, 32
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.integers(-8, 8, (L, D, F)).astype(np.int8))
  per_channel = jnp.asarray(rng.random((L, 1, F), np.float32))
  group = lambda: jnp.asarray(rng.random((L, D // g, 1, F), np.float32))
  weights = {
      "float32": (lambda h, w: h @ w, jnp.asarray(rng.standard_normal((L, D, F), np.float32))),
      "int8": (lambda h, w: h @ (w[0].astype(h.dtype) * w[1]), (q, per_channel)),
      "int8 per 32": (lambda h, w: h @ (w[0].reshape(D // g, g, F).astype(h.dtype) * w[1])
                      .reshape(D, F), (q, group())),
      "gguf": (lambda h, w: h @ (w[0].reshape(D // g, g, F).astype(h.dtype) * w[1] + w[2])
               .reshape(D, F), (q, group(), group())),
  }
  for m in (1, 16, 64):
    x, times = jnp.asarray(rng.standard_normal((m, D), np.float32)), {}
    for name, (dot, w) in weights.items():
      body = lambda h, wl, dot=dot: (jnp.tanh(dot(h, wl)[:, :D]), None)
      run = jax.jit(lambda x, w, body=body: jax.lax.scan(body, x, w)[0])
      times[name] = min(harness.timed(lambda: run(x, w).block_until_ready(), 7))
    print(f"M={m}: " + ", ".join(f"{k} {1e3 * v:.1f} ms ({v / times['float32']:.2f}x)"
                                 for k, v in times.items()), flush=True)


def kernel_scan(rows: list[int]) -> None:
  """kernels_cpu's matmuls alone at the default model's shapes: 30 layers of Q4_1 (packed) q/k/v,
  o, gate, up and down under one scan, then the Q8_0 tied head [49152, 576] (random values of
  those types): the median of 200 runs at each M, and the bytes read a second."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import kernels_cpu
  from kernels_cpu.reference import packed

  L, D, F, V, G = 30, 576, 1536, 49152, 32
  rng = np.random.default_rng(0)

  def q4_1(K, N):
    values = packed(rng.integers(0, 16, (L, K, N), dtype=np.int8), 1)
    return tuple(jnp.asarray(a) for a in (values, rng.random((L, K // G, N), np.float32) / 100,
                                          -rng.random((L, K // G, N), np.float32) / 100))

  qkv, o, gate, up, down = q4_1(D, D + 2 * 192), q4_1(D, D), q4_1(D, F), q4_1(D, F), q4_1(F, D)
  head = (jnp.asarray(rng.integers(-127, 128, (V, D), dtype=np.int8)),
          jnp.asarray(rng.random((V, D // G), np.float32) / 100))

  def layer(h, i):
    mm = lambda x, w: kernels_cpu.qmatmul(x, *w, layer=i)
    h = h + mm(mm(h, qkv)[:, :D], o)
    return h + mm(mm(h, gate) * mm(h, up), down) / 1000, None

  step = jax.jit(lambda h: kernels_cpu.qmatmul(jax.lax.scan(layer, h, jnp.arange(L))[0], *head,
                                               nk=True))
  nbytes = sum(a.nbytes for w in (qkv, o, gate, up, down, head) for a in w)
  for m in rows:
    x = jnp.asarray(rng.standard_normal((m, D), np.float32))
    t = float(np.median(harness.timed(lambda: step(x).block_until_ready(), 200)))
    print(f"M={m}: {1e3 * t:.2f} ms, {nbytes / t / 1e9:.1f} GB/s of {nbytes / 1e6:.0f} MB",
          flush=True)


def main_quant(argv=None) -> None:
  """Weight quantization on CPU: decode step time at 1, 16 and 64 slots and the 64-request
  workload, for --quantization none, gguf and int8 on the default model, each mode in its own
  fresh process; prints each mode's figures and its ratios to none.

    python -m scripts.bench quant [--slots-list 1,16,64] [--steps 32] [--requests 64]
        [--layers scan|unrolled]
    python -m scripts.bench quant --matmul   # the layer scan behind `auto`'s choice
    python -m scripts.bench quant --kernel 1,4,7   # kernels_cpu's matmuls alone, M rows

  A decode step's time is the difference of two runs through the offline API that differ only in
  output length (max_tokens `steps` and 2 * `steps`, ignore_eos, 8-token prompts), divided by
  `steps`: prefill, warm-up and host set-up cancel out. On a loaded machine only the ratios mean
  much: the load average is printed with them.
  """
  p = harness.parser("quant", main_quant.__doc__)
  p.add_argument("--mode", choices=MODES, default=None, help="(internal) measure one mode here")
  p.add_argument("--slots-list", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--max-tokens", type=int, default=128)
  p.add_argument("--matmul", action="store_true", help="only the layer scan, in this process")
  p.add_argument("--kernel", type=lambda s: [int(x) for x in s.split(",")], default=None,
                 metavar="M,...", help="only kernels_cpu's matmuls at these rows, in this process")
  p.add_argument("--layers", choices=("scan", "unrolled"), default="scan",
                 help="EngineConfig.unroll_layers False (the default) or True")
  args = p.parse_args(argv)
  if args.matmul:
    matmul_scan()
    return
  if args.kernel:
    kernel_scan(args.kernel)
    return
  if args.mode:
    print(json.dumps(measure(args.mode, args)))
    return
  results = {}
  for mode in MODES:
    results[mode] = harness.fresh("quant", [
        "--mode", mode, "--steps", str(args.steps),
        "--slots-list", ",".join(map(str, args.slots_list)), "--requests", str(args.requests),
        "--max-tokens", str(args.max_tokens), "--layers", args.layers],
        env={"JAX_PLATFORMS": "cpu"})
    print(json.dumps(results[mode]), flush=True)
  base = results["none"]
  for mode in ("gguf", "int8"):
    r = results[mode]
    ratios = {s: base["decode_ms"][s] / r["decode_ms"][s] for s in r["decode_ms"]}
    line = f"{mode}: decode speed-up over none " + ", ".join(
        f"{s} slots {x:.2f}x" for s, x in ratios.items())
    if "workload_s" in r:
      speedup = base["workload_s"] / r["workload_s"]
      line += f"; {args.requests}-request workload {speedup:.2f}x"
    print(line)


# ---- speculative

COPY_PROMPTS = [
    "Rename the function `area` to `rect_area` everywhere in this code and give back the whole "
    "code, nothing else:\n```python\ndef area(width, height):\n    \"\"\"The area of a "
    "rectangle.\"\"\"\n    return width * height\n\n\ndef total_area(rects):\n    return "
    "sum(area(w, h) for w, h in rects)\n\n\nif __name__ == \"__main__\":\n    "
    "print(total_area([(1, 2), (3, 4)]))\n```",
    "Repeat this list exactly, one item a line, but with 'pears' changed to 'plums':\napples\n"
    "bananas\ncherries\ndates\nelderberries\nfigs\ngrapes\npears\nquinces\nraspberries\n"
    "strawberries\ntangerines",
    "Extract the fields name, email, city and order number from this message as JSON with those "
    "four keys:\n\nHello, my name is Maria Gonzalez and I ordered a blue kettle last week (order "
    "number 48213-KX). It arrived broken. I live in Valencia; you can reach me at "
    "maria.gonzalez@example.com. Thanks!",
    "Copy this paragraph, correcting only the spelling mistakes:\nThe quick brown fox jumpd over "
    "the lazy dog. Every morning the fox runs thru the forest, looking for somthing to eat, and "
    "every evening it returns to its den beside the old oak tree.",
]


def child(args: argparse.Namespace) -> dict:
  """One side of one workload, in this process: its tokens/s and speculation counts."""
  import jaxserve
  from jaxserve.config import EngineConfig, SamplingParams, SpeculativeConfig

  spec = SpeculativeConfig.from_json(args.speculative_config) if args.on else None
  copy = args.workload == "copy"
  cfg = EngineConfig(num_slots=1 if copy else args.slots, page_size=16,
                     max_model_len=args.max_model_len, num_pages=args.num_pages,
                     prefill_buckets=args.buckets, speculative=spec)
  llm = jaxserve.LLM(engine_config=cfg)
  llm.engine.warmup()
  if copy:
    prompts = COPY_PROMPTS[:2] if args.quick else COPY_PROMPTS
    sampling = SamplingParams(temperature=0, max_tokens=48 if args.quick else 256)
    start = time.perf_counter()
    outs = [llm.generate([p], sampling, chat=True)[0] for p in prompts]  # One at a time.
  else:
    work = [json.loads(line) for line in harness.WORKLOAD.read_text().splitlines()
            if line.strip()]
    work = work[:8] if args.quick else work
    params = [SamplingParams(temperature=0, ignore_eos=True,
                             max_tokens=min(w["max_tokens"], 32) if args.quick else w["max_tokens"])
              for w in work]
    start = time.perf_counter()
    outs = llm.runner.generate([(w["prompt_token_ids"], p) for w, p in zip(work, params)])
  wall = time.perf_counter() - start
  stats = llm.runner.scheduler.spec_stats
  ids = [list(o.token_ids) for o in outs]
  return {"workload": args.workload, "speculative": args.on, "wall_s": wall,
          "tokens": sum(map(len, ids)), "tokens_per_s": sum(map(len, ids)) / wall,
          "digest": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
          "draft_tokens": stats.num_draft_tokens, "accepted_tokens": stats.num_accepted_tokens,
          "acceptance_rate": stats.acceptance_rate, "accepted_per_pos": stats.accepted_per_pos,
          "steps": llm.runner.scheduler.num_steps}


def run_child(args: argparse.Namespace, workload: str, on: bool) -> dict:
  return harness.fresh("speculative", [
      "--child", "--workload", workload, "--speculative-config", args.speculative_config,
      "--slots", str(args.slots), "--max-model-len", str(args.max_model_len),
      "--num-pages", str(args.num_pages), "--buckets", ",".join(map(str, args.buckets))]
      + ["--on"] * on + ["--quick"] * args.quick)


def report(pairs: list[tuple[dict, dict]]) -> str:
  """One workload's rounds of (off, on): each round's tokens/s, the median ratio, and the
  outputs and counts (the same every round: greedy)."""
  ratios = [on["tokens_per_s"] / off["tokens_per_s"] for off, on in pairs]
  rounds = ", ".join(f"{off['tokens_per_s']:.1f} -> {on['tokens_per_s']:.1f} ({r:.2f}x)"
                     for (off, on), r in zip(pairs, ratios))
  off, on = pairs[0]
  identical = all(o["digest"] == off["digest"] for pair in pairs for o in pair)
  return (f"{on['workload']}: median {statistics.median(ratios):.2f}x over {len(pairs)} rounds "
          f"[{rounds}], identical output: {identical}, acceptance "
          f"{on['acceptance_rate']:.2f} ({on['accepted_tokens']}/{on['draft_tokens']}, per "
          f"position {on['accepted_per_pos']}), steps {off['steps']} -> {on['steps']}")


def main_speculative(argv=None) -> int:
  """Speculative decoding (n-gram prompt lookup, or a draft model) against none, each side in a
  fresh process.

    python -m scripts.bench speculative                     # both workloads, k = 6, 3 rounds
    python -m scripts.bench speculative --quick --rounds 1  # a few short requests: proves it runs
    python -m scripts.bench speculative --workloads copy \\
        --speculative-config '{"num_speculative_tokens": 4}'
    python -m scripts.bench speculative --draft smollm2-135m-instruct   # the draft-model method

  Two workloads, both greedy on the default model:
  - copy: single stream, one request at a time, prompts whose answers copy spans of them (edit
    this code, repeat this list with one change, extract these fields), chat template applied.
    Speculation should pay here: issue 25's target is 2x the tokens/s, with identical output.
  - peers: the 64-request workload of `peers` (scripts/workloads/peers_64.jsonl: word-list
    prompts, outputs that do not copy them, end-of-sequence ignored), all submitted at once to 16
    slots. Speculation should cost little here: the target is at least 0.95x.

  Each (workload, on/off) runs in its own process (model loading and warm-up not timed), in
  `--rounds` interleaved rounds (off then on, then on then off, ...: the machine drifts between
  processes by more than the 0.95x threshold, so one pair is not a reading); the report gives
  each round's tokens/s and ratio, the median ratio, whether the outputs are identical, and the
  acceptance rate (accepted proposals over proposed ones) with the accepted count at each
  proposal position.
  """
  p = harness.parser("speculative", main_speculative.__doc__)
  p.add_argument("--workloads", default="copy,peers", help="comma-separated: copy, peers")
  # k = 6: on CPU it beat 4 on the copy stream (2.17x against 1.87x, BENCHMARKS.md).
  p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 6}')
  p.add_argument("--rounds", type=int, default=3,
                 help="interleaved (off, on) rounds a workload; the ratio reported is their median")
  p.add_argument("--slots", type=int, default=16, help="the peers workload's slots")
  p.add_argument("--max-model-len", type=int, default=1024)
  p.add_argument("--num-pages", type=int, default=16 * 512 // 16 + 1)
  p.add_argument("--buckets", type=lambda s: tuple(int(b) for b in s.split(",")),
                 default=(64, 128, 256))
  p.add_argument("--draft", default=None, metavar="MODEL",
                 help="the draft-model method with MODEL (a name or path) as the draft, k from "
                 "--speculative-config (the default model as its own draft accepts everything: "
                 "it shows the method's overhead, not a speed-up)")
  p.add_argument("--quick", action="store_true",
                 help="a few short requests, one prefill bucket (64), max_model_len 512")
  p.add_argument("--json", type=pathlib.Path, default=None, help="write the runs here")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--workload", default="copy", help=argparse.SUPPRESS)
  p.add_argument("--on", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.quick and not args.child:  # One prefill bucket: a few programs to compile per process.
    args.buckets, args.max_model_len = (64,), 512
  if args.draft and not args.child:
    k = json.loads(args.speculative_config).get("num_speculative_tokens", 4)
    args.speculative_config = json.dumps({"method": "draft", "draft_model": args.draft,
                                          "num_speculative_tokens": k})
  if args.child:
    print(json.dumps(child(args)))
    return 0
  runs = []
  for workload in args.workloads.split(","):
    # Off first in even rounds, on first in odd ones.
    sides = harness.interleaved(("off", "on"), args.rounds,
                                lambda side: run_child(args, workload, side == "on"),
                                reverse_odd=True)
    pairs = list(zip(sides["off"], sides["on"]))
    runs += [run for pair in pairs for run in pair]
    print(report(pairs), flush=True)
  if args.json:
    args.json.write_text(json.dumps(runs, indent=1))
  return 0


# ---- step


class CountingEngine:
  """The engine as the runner sees it, counting the calls the runner makes."""

  def __init__(self, engine):
    self._engine, self.info, self.calls = engine, engine.info, 0

  def __getattr__(self, name):
    attr = getattr(self._engine, name)
    if name in ("prefill", "decode", "step"):
      def counted(*args, **kwargs):
        self.calls += 1
        return attr(*args, **kwargs)
      return counted
    return attr


def workload(args) -> None:
  """The offline run: wall time, engine calls per runner iteration, time to first token."""
  from jaxserve.config import EngineConfig, SamplingParams
  from jaxserve.llm import LLM

  work = [json.loads(line) for line in harness.WORKLOAD.read_text().splitlines()]
  work = work[:args.requests]
  cfg = EngineConfig(num_slots=args.slots, page_size=16, max_model_len=512,
                     num_pages=args.slots * 32 + 1, prefill_buckets=(64, 128, 256),
                     compilation_cache_dir=None)
  llm = LLM(None, engine_config=cfg)
  counting = CountingEngine(llm.runner.engine)
  llm.runner.engine = counting
  iterations = [0]
  step = llm.runner.step

  def counted_step():
    iterations[0] += 1
    return step()
  llm.runner.step = counted_step
  params = [SamplingParams(temperature=0, max_tokens=min(r["max_tokens"], args.max_tokens),
                           ignore_eos=True)
            for r in work]
  load = os.getloadavg()[0]
  t0 = time.monotonic()
  done = llm.generate([r["prompt_token_ids"] for r in work], params)
  wall = time.monotonic() - t0
  ttft = sorted(c.timings.first_token - t0 for c in done)
  print(json.dumps(dict(
      wall_s=wall, iterations=iterations[0], engine_calls=counting.calls,
      calls_per_iteration=counting.calls / iterations[0], ttft_mean_s=statistics.fmean(ttft),
      ttft_p90_s=ttft[int(0.9 * (len(ttft) - 1))], load_avg=[load, os.getloadavg()[0]],
      tokens=[list(c.token_ids) for c in done])))


def decode_steps(args) -> None:
  """Median ms of one decode-only engine call at each slot count, context 128 tokens."""
  import numpy as np

  from jaxserve.batching.plan import PrefillChunk
  from jaxserve.config import EngineConfig, SamplingParams
  from jaxserve.engine.engine import Engine
  from jaxserve.loading import checkpoint

  model, _ = checkpoint.load_model(None)
  out = {}
  for slots in args.slots_list:
    pages = 8
    cfg = EngineConfig(num_slots=slots, page_size=16, num_pages=slots * pages + 1,
                       max_model_len=128, prefill_buckets=(128,), compilation_cache_dir=None)
    engine = Engine(model, cfg)
    tables = np.arange(1, slots * pages + 1, dtype=np.int32).reshape(slots, pages)
    greedy = SamplingParams(temperature=0)
    for s in range(slots):
      ids = [100 + s] * 100
      engine.prefill(PrefillChunk("r", s, ids, 0, tables[s], True, greedy, 0, ids, ()))
    # The untimed first call compiles.
    times = harness.timed(lambda: engine.decode(range(slots), tables).result(), args.steps)
    out[str(slots)] = 1e3 * statistics.median(times)
  print(json.dumps(dict(decode_ms=out, load_avg=os.getloadavg()[0])))


def run_in(tree: pathlib.Path, mode: str, args) -> dict:
  return harness.fresh("step", [
      "--tree", str(tree), "--mode", mode, "--requests", str(args.requests),
      "--slots", str(args.slots), "--max-tokens", str(args.max_tokens),
      "--slots-list", ",".join(map(str, args.slots_list)), "--steps", str(args.steps)],
      env={"JAX_PLATFORMS": "cpu"})


def main_step(argv=None) -> None:
  """One engine call per iteration against the design before it: the 64-request workload through
  the offline API, and decode step time at 1, 16 and 64 slots, each design in its own process.

    python -m scripts.bench step --old /path/to/worktree/of/the/old/commit [--requests 64]

  Each measurement runs in a fresh process that puts one source tree (this one, or --old) first
  on sys.path before it imports jaxserve, so both run this command but their own jaxserve. The
  engine API both share (`prefill(chunk)`, `decode(slots, tables)`, and the runner) is all the
  command touches; engine calls are counted where the runner makes them (`prefill`, `decode`, or
  `step`). Prints one JSON object per design and the new / old ratios. On a loaded machine only
  the ratios mean much: the load average is reported with them.
  """
  p = harness.parser("step", main_step.__doc__)
  p.add_argument("--old", type=pathlib.Path, help="a source tree of the design to compare with")
  p.add_argument("--mode", choices=("compare", "workload", "decode"), default="compare")
  p.add_argument("--tree", type=pathlib.Path, default=None,
                 help="(internal) the source tree whose jaxserve this process imports")
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--max-tokens", type=int, default=10**6, help="cap each request's max_tokens")
  p.add_argument("--slots-list", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
  p.add_argument("--steps", type=int, default=10)
  args = p.parse_args(argv)
  if args.tree:
    sys.path.insert(0, str(args.tree))
  if args.mode == "workload":
    return workload(args)
  if args.mode == "decode":
    return decode_steps(args)
  results = {}
  for name, tree in (("old", args.old), ("new", harness.ROOT)):
    results[name] = dict(run_in(tree, "workload", args), **run_in(tree, "decode", args))
  same = results["old"].pop("tokens") == results["new"].pop("tokens")
  ratio = lambda k: results["new"][k] / results["old"][k]
  results["same_tokens"] = same
  results["new_over_old"] = {k: ratio(k) for k in ("wall_s", "calls_per_iteration",
                                                    "ttft_mean_s", "ttft_p90_s")}
  results["new_over_old"]["decode_ms"] = {
      s: results["new"]["decode_ms"][s] / results["old"]["decode_ms"][s]
      for s in results["new"]["decode_ms"]}
  print(json.dumps(results, indent=1))


# ---- lora

LORA_CONFIGS = ("base", "lora-0", "lora-1", "lora-8", "merged")
RANK, NUM_ADAPTERS = 16, 8
PEFT_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
              "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
              "w_down": "mlp.down_proj"}


def write_adapters(cfg, root: pathlib.Path) -> list[pathlib.Path]:
  """NUM_ADAPTERS random PEFT adapters for `cfg` (rank RANK, every target), under `root`."""
  import numpy as np
  from safetensors.numpy import save_file

  from jaxserve.config.lora import target_dims

  paths = []
  for k in range(NUM_ADAPTERS):
    rng = np.random.default_rng(k)
    tensors = {}
    for i in range(cfg.num_layers):
      for target, (I, O) in target_dims(cfg).items():
        key = f"base_model.model.model.layers.{i}.{PEFT_NAMES[target]}"
        tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((RANK, I)) / np.sqrt(I)).astype(
            np.float32)
        tensors[f"{key}.lora_B.weight"] = (0.02 * rng.standard_normal((O, RANK))).astype(
            np.float32)
    path = root / f"adapter-{k}"
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": RANK,
         "target_modules": [n.split(".")[1] for n in PEFT_NAMES.values()]}))
    paths.append(path)
  return paths


def merged(params: dict, adapter) -> dict:
  """The numpy weights (weights.to_params' layout) with `adapter`'s A B added in."""
  layers = dict(params["layers"])
  for target, (a, b) in adapter.weights.items():
    w = layers[target]
    layers[target] = (w.reshape(a.shape[0], a.shape[1], b.shape[2]) + a @ b).reshape(
        w.shape).astype(w.dtype)
  return {**params, "layers": layers}


def run_lora(name: str, slots: int, num_requests: int) -> dict:
  """One configuration's pass over the workload, in this process."""
  import dataclasses

  from jaxserve.batching.runner import Runner
  from jaxserve.config import EngineConfig, LoRARequest, SamplingParams
  from jaxserve.engine.engine import Engine
  from jaxserve.llm import lora_reader
  from jaxserve.loading import checkpoint

  cfg, params, tokenizer = checkpoint.read_source(checkpoint.resolve(None))
  config = EngineConfig(num_slots=slots, page_size=16, max_model_len=1024, num_pages=513,
                        prefill_buckets=(64, 128, 256))  # As `peers` runs jaxserve.
  lora_on = name.startswith("lora")
  if lora_on:
    config = dataclasses.replace(config, max_loras=NUM_ADAPTERS, max_lora_rank=RANK)
  with tempfile.TemporaryDirectory() as tmp:
    paths = write_adapters(cfg, pathlib.Path(tmp))
    read = lora_reader(cfg, config if lora_on else dataclasses.replace(config, max_lora_rank=RANK))
    if name == "merged":
      params = merged(params, read(paths[0]))
    engine = Engine(checkpoint.build_model(cfg, params), config, stop_ids=tokenizer.stop_ids)
    engine.warmup()
    runner = Runner(engine, tokenizer)
    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(paths)]
    if lora_on:
      for lora, path in zip(loras, paths):
        runner.add_lora(lora, read(path))
  work = [json.loads(line) for line in harness.WORKLOAD.read_text().splitlines() if line.strip()]
  work = work[:num_requests]
  per = {"base": None, "merged": None, "lora-0": None}
  use = lambda i: per.get(name, loras[0] if name == "lora-1" else loras[i % NUM_ADAPTERS])
  jobs = [(r["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                 ignore_eos=True), use(i))
          for i, r in enumerate(work)]
  steps = [0]
  step = engine.step
  engine.step = lambda *a, **k: (steps.__setitem__(0, steps[0] + 1), step(*a, **k))[1]
  start = time.perf_counter()
  done = runner.generate(jobs)
  wall = time.perf_counter() - start
  tokens = sum(len(c.token_ids) for c in done)
  return {"config": name, "wall_s": wall, "steps": steps[0], "step_ms": 1e3 * wall / steps[0],
          "tokens": tokens, "tokens_per_s": tokens / wall, "loadavg": os.getloadavg()[0]}


def lora_delta() -> int:
  """The delta x A B of SmolLM2's up projection (I 576, O 1536) for T tokens spread over 8
  adapters and the base, rank 16, three ways; median of 20 calls each, in this one process
  (the three are one program each: the comparison is within a process, not between engines)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxserve.model.lora import LoraRows, LoraWeights

  I, O, R, S = 576, 1536, RANK, NUM_ADAPTERS + 1
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal((S, I, R)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((S, R, O)), jnp.float32)

  def onehot(x, slots):
    layer = LoraWeights({"w": a}, {"w": b})  # One layer's slots: [Sl, ...].
    stacked = LoraWeights({"w": a[None]}, {"w": b[None]})
    return LoraRows.of(stacked, slots).at_layer(layer).delta("w", x)

  def gather(x, slots):
    return jnp.einsum("tr,tro->to", jnp.einsum("ti,tir->tr", x, a[slots]), b[slots])

  def ragged(x, slots):
    order = jnp.argsort(slots)
    sizes = jnp.bincount(slots, length=S).astype(jnp.int32)
    xa = jax.lax.ragged_dot(x[order], a, sizes)
    out = jax.lax.ragged_dot(xa, b, sizes)
    return jnp.zeros_like(out).at[order].set(out)

  print("| tokens | one-hot ms | gather ms | ragged_dot ms |")
  print("|---|---|---|---|")
  for T in (1, 16, 64, 512):
    x = jnp.asarray(rng.standard_normal((T, I)), jnp.float32)
    slots = jnp.asarray(np.arange(T) % S, jnp.int32)
    ref = onehot(x, slots)
    cells = []
    for fn in (onehot, gather, ragged):
      f = jax.jit(fn)
      assert np.allclose(f(x, slots), ref, rtol=1e-4, atol=1e-3), fn.__name__
      cells.append(statistics.median(harness.timed(lambda: f(x, slots).block_until_ready(), 20)))
    print(f"| {T} | " + " | ".join(f"{1e3 * c:.3f}" for c in cells) + " |")
  return 0


def main_lora(argv=None) -> int:
  """LoRA's cost (issue 37): the 64-request workload (scripts/workloads/peers_64.jsonl) on the
  default model, 16 slots, greedy, each configuration in its own fresh process, rounds
  interleaved:

    python -m scripts.bench lora --rounds 2
    python -m scripts.bench lora --requests 2 --configs base,lora-8   # proves it runs

  base     no LoRA (max_loras 0)
  lora-0   max_loras 8, rank 16, every request on the base model (slot 0's zeros)
  lora-1   every request under one adapter
  lora-8   the requests under 8 distinct adapters, round robin
  merged   adapter 1 merged into the weights (W + A B), no LoRA: what lora-1 computes, at the
           base model's cost

  Adapters are random, rank 16 on all seven projections, written as PEFT writes them. Reported:
  the workload's wall time, its engine steps and the mean step time, each against base's.
  """
  p = harness.parser("lora", main_lora.__doc__)
  p.add_argument("--delta", action="store_true",
                 help="instead: the delta of one projection alone, three ways (one-hot over the "
                 "slots, as model/lora.py; a gather of each token's A and B; jax.lax.ragged_dot "
                 "over the tokens sorted by slot), at 1 to 512 tokens")
  p.add_argument("--rounds", type=int, default=1)
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--configs", default=",".join(LORA_CONFIGS))
  p.add_argument("--requests", type=int, default=64, help="the workload's first N (smoke runs)")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # One configuration, here.
  args = p.parse_args(argv)
  if args.delta:
    return lora_delta()
  if args.child:
    print(json.dumps(run_lora(args.child, args.slots, args.requests)), flush=True)
    return 0
  flags = ["--slots", str(args.slots), "--requests", str(args.requests)]
  def one(name):
    run = harness.fresh("lora", ["--child", name, *flags])
    print(json.dumps(run), file=sys.stderr, flush=True)
    return run
  runs = harness.interleaved(args.configs.split(","), args.rounds, one, reverse_odd=True)
  pick = {name: harness.median_item(rs, lambda r: r["step_ms"]) for name, rs in runs.items()}
  base = pick.get("base")
  print(f"{args.rounds} rounds (the median round of each), {args.slots} slots, "
        f"{args.requests} requests")
  print("| config | wall s | steps | step ms | step vs base | tokens/s |")
  print("|---|---|---|---|---|---|")
  for name, r in pick.items():
    ratio = f"{r['step_ms'] / base['step_ms']:.2f}x" if base else "-"
    print(f"| {name} | {r['wall_s']:.1f} | {r['steps']} | {r['step_ms']:.1f} | {ratio} | "
          f"{r['tokens_per_s']:.0f} |")
  return 0


# ---- offload

@dataclasses.dataclass(frozen=True)
class Chat:
  """A multi-turn chat workload's shape, after vLLM's benchmarks/multi_turn scaled to a CPU: each
  conversation opens with a long message (notes pasted in to discuss), then short follow-ups;
  each turn's prompt is the conversation so far (its earlier prompts and answers, in the chat
  template) and the new message. `clients` users send at once, each the next ready turn, round
  robin over the conversations, as soon as an answer comes back: a conversation's prefix waits
  in the cache while the other conversations' turns pass through the pool."""

  conversations: int = 18  # 4x the pool and 4 clients: the running requests' pages fit in it.
  turns: int = 6
  clients: int = 4  # Requests in flight: also the engine's slots.
  opening_words: int = 60  # ~100 tokens with the system prompt and the template.
  follow_up_words: int = 10  # ~25 tokens with the template.
  answer_tokens: int = 12  # Every answer's length: greedy, end-of-sequence ignored.
  page_size: int = 16
  pool_ratio: float = 4.0  # The final prompts' pages over the device pool's usable pages.
  seed: int = 0


# A small chat that still runs every part (host saves and loads, and pool contention), compiling
# few programs (one prefill bucket): `offload --small`, the ablation's --quick, the tests.
SMALL_CHAT = Chat(conversations=8, turns=3, clients=2, opening_words=8, follow_up_words=4,
                  answer_tokens=4)


def chat_messages(tokenizer, chat: Chat) -> list[list[list[int]]]:
  """Per conversation, per turn, the ids the turn adds to the conversation: the chat template of
  the opening message (its system prompt included), then for each follow-up the end of the last
  answer, the message and the assistant's header. Ids, not re-encoded text, so every turn's
  prompt extends the last one's exactly, as a server's prefix cache needs."""
  from .peers import WORDS

  rng = random.Random(chat.seed)
  words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
  user = lambda text: {"role": "user", "content": text}
  mark = "ANSWERMARK"  # Where the last answer's ids go: the follow-up's ids are what comes after.
  out = []
  for c in range(chat.conversations):
    opening = f"My notes, part {c + 1}: {words(chat.opening_words)}. What stands out?"
    turns = [tokenizer.encode(tokenizer.apply_chat_template([user(opening)]), add_bos=False)]
    for _ in range(1, chat.turns):
      text = tokenizer.apply_chat_template([
          user("hi"), {"role": "assistant", "content": mark},
          user(f"Say more about {words(chat.follow_up_words)}?")])
      turns.append(tokenizer.encode(text.split(mark, 1)[1], add_bos=False))
    out.append(turns)
  return out


def chat_prompt_lens(messages, chat: Chat) -> list[int]:
  """Each conversation's last prompt's length: every message and every answer but the last."""
  return [sum(map(len, turns)) + (len(turns) - 1) * chat.answer_tokens for turns in messages]


def chat_pools(messages, chat: Chat) -> tuple[int, int, int]:
  """(num_pages, host pages, max_model_len) for the workload: a device pool (scratch page
  included) whose usable pages the final prompts need `pool_ratio` times over (never too small
  for the longest request), and a host tier that holds every conversation whole."""
  lens, page = chat_prompt_lens(messages, chat), chat.page_size
  longest = -(-(max(lens) + chat.answer_tokens) // page)
  usable = max(int(sum(-(-n // page) for n in lens) // chat.pool_ratio), longest)
  host = sum(-(-(n + chat.answer_tokens) // page) for n in lens)
  return 1 + usable, host, longest * page


def chat_pool_ratio(messages, chat: Chat) -> float:
  """The final prompts' pages over the device pool's usable pages (`chat_pools`')."""
  pages = sum(-(-n // chat.page_size) for n in chat_prompt_lens(messages, chat))
  return pages / (chat_pools(messages, chat)[0] - 1)


def chat_config(chat: Chat, messages, model_cfg, tier: str, **fields):
  """The EngineConfig the chat runs on: `chat.clients` slots, the pools `chat_pools` sizes
  (`tier` "host": with the host tier, else without), the default prefill buckets up to the
  first that holds the longest request; `fields` set the rest (the ablation's KV layout and
  dtype)."""
  from jaxserve.config import EngineConfig

  num_pages, host_pages, max_len = chat_pools(messages, chat)
  default = EngineConfig.prefill_buckets
  buckets = tuple(b for b in default if b < max_len) + tuple(b for b in default if b >= max_len)[:1]
  config = EngineConfig(num_slots=chat.clients, page_size=chat.page_size, num_pages=num_pages,
                        max_model_len=max_len, prefill_buckets=buckets, **fields)
  if tier == "host":
    config = dataclasses.replace(config, kv_offload_gib=host_gib(model_cfg, config, host_pages))
  return config


def host_gib(model_cfg, config, num_pages: int) -> float:
  """The kv_offload_gib that buys `num_pages` host pages for `config`'s cache."""
  import jax

  from jaxserve.engine import host_kv
  from jaxserve.model import kv_cache

  cache = jax.eval_shape(lambda: kv_cache.create(model_cfg, config))
  return (num_pages + 1) * host_kv.page_bytes(cache) / 2**30


def run_chat(runner, messages, chat: Chat) -> dict:
  """Runs the conversations through `runner`, `chat.clients` requests in flight: a turn is sent
  (its arrival stamped) once its conversation's last answer is back. Time to first token is each
  request's first token less its arrival. Returns the answers, each request's TTFT, the wall time
  and the scheduler's and page allocator's counters."""
  from jaxserve.config import SamplingParams

  sampling = SamplingParams(temperature=0, max_tokens=chat.answer_tokens, ignore_eos=True)
  pending = [(c, t) for t in range(len(messages[0])) for c in range(len(messages))]
  history = [[] for _ in messages]
  answers = [[] for _ in messages]
  in_flight, tokens, ttft = {}, {}, []
  start = time.perf_counter()
  while pending or in_flight:
    busy = {c for c, _ in in_flight.values()}
    for c, t in list(pending):  # The next turn of each idle conversation, in order.
      if len(in_flight) == chat.clients:
        break
      if c not in busy:
        busy.add(c)
        pending.remove((c, t))
        history[c] += messages[c][t]
        req = runner.new_request(history[c], sampling)
        runner.submit(req)
        in_flight[req.request_id], tokens[req.request_id] = (c, req), []
    for out in runner.step():
      tokens[out.request_id] += out.token_ids
      if out.finished:
        c, req = in_flight.pop(out.request_id)
        ttft.append(req.timings.time_to_first_token)
        answers[c].append(tokens.pop(out.request_id))
        history[c] += answers[c][-1]
        if len(ttft) % len(messages) == 0:
          print(f"{len(ttft)} of {len(pending) + len(in_flight) + len(ttft)} requests, "
                f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
  wall = time.perf_counter() - start
  s, pages = runner.scheduler, runner.scheduler.pages
  host_kv = getattr(runner.engine, "host_kv", None)
  return {"wall_s": wall, "requests": len(ttft), "ttft_s": ttft,
          "prefill_tokens": s.num_prefill_tokens, "cached_tokens": s.num_cached_tokens,
          "decode_tokens": s.num_decode_tokens, "preemptions": s.num_preemptions,
          "query_tokens": pages.num_query_tokens, "hit_tokens": pages.num_hit_tokens,
          "host_hit_tokens": pages.num_host_hit_tokens, "evictions": pages.num_evictions,
          "host_pages_used": pages.host.num_used if pages.host else 0,
          "pages_saved": host_kv.num_saved if host_kv else 0,
          "pages_loaded": host_kv.num_loaded if host_kv else 0, "answers": answers}


def chat_summary(r: dict) -> dict:
  """The figures the reports give for one run_chat result."""
  q = max(1, r["query_tokens"])
  return {"prefill_tokens": r["prefill_tokens"],
          "device_hit_rate": (r["hit_tokens"] - r["host_hit_tokens"]) / q,
          "host_hit_rate": r["host_hit_tokens"] / q, "saved_tokens": r["host_hit_tokens"],
          "ttft_mean_s": statistics.fmean(r["ttft_s"]),
          "ttft_median_s": statistics.median(r["ttft_s"]), "wall_s": r["wall_s"]}


OFFLOAD_TIERS = ("none", "host")


def run_offload(tier: str, chat: Chat, model: str | None) -> dict:
  """One tier's pass over the chat workload, in this process."""
  from jaxserve.batching.runner import Runner
  from jaxserve.engine.engine import Engine
  from jaxserve.loading import checkpoint

  transformer, tokenizer = checkpoint.load_model(model)
  messages = chat_messages(tokenizer, chat)
  config = chat_config(chat, messages, transformer.cfg, tier)
  engine = Engine(transformer, config, stop_ids=tokenizer.stop_ids)
  start = time.perf_counter()
  engine.warmup()  # Every program, the copies' too: no compile lands in a TTFT.
  warmup = time.perf_counter() - start
  result = run_chat(Runner(engine, tokenizer), messages, chat)
  lens = chat_prompt_lens(messages, chat)
  return {"tier": tier, "warmup_s": warmup, "num_pages": config.num_pages,
          "host_pages": 0 if engine.host_kv is None else engine.host_kv.num_slots,
          "final_prompt_pages": sum(-(-n // chat.page_size) for n in lens),
          "pool_ratio": chat_pool_ratio(messages, chat),
          "final_prompt_tokens": [min(lens), max(lens)], "load_avg": os.getloadavg()[0],
          **result}


def main_offload(argv=None) -> int:
  """The prefix cache's host tier (EngineConfig.kv_offload_gib) on a multi-turn chat whose
  prefixes need 4x the device pool: `none` (evicted pages are dropped) and `host` (saved to host
  memory, copied back on a hit), each in its own fresh process, on the default model:

    python -m scripts.bench offload
    python -m scripts.bench offload --small --model PATH   # SMALL_CHAT: proves it runs

  The workload (`Chat`): 18 conversations of 6 turns, a ~100-token opening (system prompt
  included) and ~25-token follow-ups in the chat template, 12-token greedy answers, so the last
  prompts are ~290 tokens; 4 clients (the engine's 4 slots) each send the next ready turn, round
  robin over the conversations, as an answer comes back. The device pool is a quarter of the
  final prompts' pages, so a conversation's prefix is evicted before its next turn; the host tier
  holds them all. The rest is the engine's defaults (pages of 16 tokens, prefill buckets 32 to
  512, a 512-token prefill budget a step), and both tiers warm up first, so no compile lands in
  a TTFT. Reported per tier:
  prefill tokens computed, prefix hit rate on the device and from host memory, prompt tokens the
  host tier saved recomputing, mean and median time to first token (first token less arrival),
  wall time; then none / host for prefill tokens, TTFT and wall time, and whether the greedy
  answers are identical. Only the ratios mean much on a loaded machine.
  """
  p = harness.parser("offload", main_offload.__doc__)
  for field in dataclasses.fields(Chat):
    p.add_argument(_flag(field.name), type=float if field.type == "float" else int,
                   default=field.default)
  p.add_argument("--small", action="store_true", help="SMALL_CHAT's shape for the flags not given")
  p.add_argument("--model", default=None, help="model path or name (default: the default model)")
  p.add_argument("--tiers", default=",".join(OFFLOAD_TIERS),
                 help="the tiers to run in order, each in a fresh process (the ratios need both)")
  p.add_argument("--child", choices=OFFLOAD_TIERS, default=None, help=argparse.SUPPRESS)
  argv = sys.argv[1:] if argv is None else argv
  if "--small" in argv:
    p.set_defaults(**dataclasses.asdict(SMALL_CHAT))
  args = p.parse_args(argv)
  chat = Chat(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Chat)})
  if args.child:
    print(json.dumps(run_offload(args.child, chat, args.model)), flush=True)
    return 0
  flags = chat_flags(chat) + (["--model", args.model] if args.model else [])
  runs = {}
  for tier in args.tiers.split(","):
    runs[tier] = harness.fresh("offload", ["--child", tier, *flags])
    print(json.dumps({k: v for k, v in runs[tier].items() if k not in ("answers", "ttft_s")}),
          file=sys.stderr, flush=True)
  print(offload_report(chat, runs))
  return 0


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def chat_flags(chat: Chat) -> list[str]:
  """The command's flags that give `chat`."""
  return [x for f in dataclasses.fields(Chat) for x in (_flag(f.name), str(getattr(chat, f.name)))]


def offload_report(chat: Chat, runs: dict[str, dict]) -> str:
  """The markdown table of the tiers' runs, the none / host ratios, and the answers' check."""
  first = next(iter(runs.values()))
  lines = [f"{chat.conversations} conversations x {chat.turns} turns, {chat.clients} clients, "
           f"{chat.answer_tokens}-token answers, final prompts "
           f"{first['final_prompt_tokens'][0]}-{first['final_prompt_tokens'][1]} tokens; their "
           f"pages / the device pool's usable pages: {first['final_prompt_pages']} / "
           f"{first['num_pages'] - 1} = {first['pool_ratio']:.2f}; host tier "
           f"{max(r['host_pages'] for r in runs.values())} pages; load average at each end: "
           + ", ".join(f"{t} {r['load_avg']:.1f}" for t, r in runs.items()),
           "", "| tier | prefill tokens | hit rate device / host | tokens saved | TTFT mean s | "
           "TTFT median s | wall s | preemptions | host pages used |", "|---|---|---|---|---|---|"
           "---|---|---|"]
  for tier, r in runs.items():
    m = chat_summary(r)
    lines.append(f"| {tier} | {m['prefill_tokens']} | {m['device_hit_rate']:.3f} / "
                 f"{m['host_hit_rate']:.3f} | {m['saved_tokens']} | {m['ttft_mean_s']:.3f} | "
                 f"{m['ttft_median_s']:.3f} | {m['wall_s']:.1f} | {r['preemptions']} | "
                 f"{r['host_pages_used']} |")
  if {"none", "host"} <= runs.keys():
    none, host = chat_summary(runs["none"]), chat_summary(runs["host"])
    same = runs["none"]["answers"] == runs["host"]["answers"]
    ratio = lambda k: f"{none[k] / host[k]:.2f}x"
    lines += ["", f"none / host: prefill tokens {ratio('prefill_tokens')}, mean TTFT "
              f"{ratio('ttft_mean_s')}, median TTFT {ratio('ttft_median_s')}, wall "
              f"{ratio('wall_s')}",
              f"greedy answers identical: {'yes' if same else 'NO'}"]
  return "\n".join(lines)


COMMANDS = {"quant": main_quant, "speculative": main_speculative, "step": main_step,
            "lora": main_lora, "offload": main_offload}

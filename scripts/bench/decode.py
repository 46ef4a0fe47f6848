"""A step's time on its own, against what bounds it: `python -m scripts.bench decode | prefill`
(each command's --help says what it measures and how; `moe` is scripts/bench/moe.py, `device`
scripts/bench/device.py).

  decode   decode step time against the memory-bandwidth / FLOPs floor, prefill tokens/s,
           sample() alone, cold vs warm start-up; --compare models, each in a fresh process
  prefill  long prompts against short ones as `LLM()` chunks them, against the FLOPs floor
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxserve
from jaxserve.batching.plan import PrefillChunk, StepPlan
from jaxserve.config import (
  EngineConfig,
  ModelConfig,
  Quantization,
  SamplingParams,
)
from jaxserve.engine import sample as sample_lib
from jaxserve.engine.engine import Engine
from jaxserve.engine.sampling_state import SamplingRow
from jaxserve.engine.step import DecodeState
from jaxserve.loading import checkpoint

from . import harness

# ---- decode


def copy_bandwidth(num_bytes: int = 1 << 29, repeats: int = 5) -> float:
  """Bytes per second this machine moves copying a large float32 array (read + write both
  count): the better of numpy's copy and an XLA elementwise pass."""
  src = np.ones(num_bytes // 4, np.float32)
  dst = np.empty_like(src)
  numpy_best = min(harness.timed(lambda: np.copyto(dst, src), repeats, warmup=False))
  x = jnp.asarray(src)
  scale = jax.jit(lambda a: a * 1.0001)  # A multiply, so XLA cannot alias the buffer away.
  xla_best = min(harness.timed(lambda: scale(x).block_until_ready(), repeats))
  return 2 * num_bytes / min(numpy_best, xla_best)


def gemm_rate(n: int = 1024, repeats: int = 5) -> float:
  """FLOP/s of one n x n x n float32 matmul compiled by XLA (what the step's matmuls run on)."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
  mm = jax.jit(lambda x: x @ x)
  return 2 * n ** 3 / min(harness.timed(lambda: mm(a).block_until_ready(), repeats))


def step_flops(model, batch: int, context: int) -> int:
  """FLOPs of one decode step: 2 per matmul weight per slot (every layer's, and the output head;
  the embedding lookup does none), plus attention's scores and weighted sum over `context`."""
  cfg = model.cfg
  weights = sum(v.size for path, v in jax.tree_util.tree_leaves_with_path(nnx.state(model.layers))
                if v.ndim > 2 and not _is_scale(path))
  weights += cfg.vocab_size * cfg.dim  # The output head.
  attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
  return batch * (2 * weights + attention)


def _is_scale(path) -> bool:
  """Whether a parameter's path ends in a quantized weight's scale or minimum (model/quant.py)."""
  return any(getattr(k, "key", None) in ("scale", "minimum") for k in path)


def decode_ms(model, batch: int, context: int, steps: int, **config) -> float:
  """Median ms per decode step with `batch` slots each holding `context` tokens: every step
  starts each slot at position `context` (the engine reads positions from its device state), so
  it attends to `context` cached positions plus the one it writes, as `step_bytes` counts. The
  cached KV is the pool's zeros: its values change no step time. `config`: EngineConfig
  fields to set."""
  engine, tables = decode_engine(model, batch, context + 1, **config)
  slots = tuple(range(batch))

  def reset():
    engine.state = at_position(engine.state, context)
    jax.block_until_ready(engine.state)
  times = harness.timed(lambda: engine.step(StepPlan(decode_slots=slots, page_tables=tables))
                        .result(), steps, setup=reset)
  return 1000 * float(np.median(times))


def decode_engine(model, batch: int, positions: int, **config) -> tuple[Engine, np.ndarray]:
  """An engine of `batch` slots and page tables [batch, pages] giving each slot pages of 16 of
  its own for `positions` positions (also for scripts/profile_decode.py).
  window_pages=False: these tables are the one pool's (no window tables for local layers)."""
  pages = -(-positions // 16)
  config = EngineConfig(num_slots=batch, page_size=16, num_pages=batch * pages + 1,
                        max_model_len=max(pages * 16, 128), prefill_buckets=(32,),
                        compilation_cache_dir=None, window_pages=False, **config)
  tables = np.arange(1, batch * pages + 1, dtype=np.int32).reshape(batch, pages)
  return Engine(model, config), tables


def prefill_engine(model, length: int, **config) -> tuple[Engine, PrefillChunk]:
  """An engine of one slot whose one prefill bucket is `length`, and a `length`-token chunk that
  ends its prompt (greedy)."""
  pages = -(-length // 16)
  config = EngineConfig(num_slots=1, page_size=16, num_pages=pages + 1, max_model_len=pages * 16,
                        prefill_buckets=(length,), compilation_cache_dir=None,
                        window_pages=False, **config)
  chunk = PrefillChunk("p", 0, list(range(100, 100 + length)), 0, list(range(1, pages + 1)), True,
                       SamplingParams(temperature=0), 0, (), ())
  return Engine(model, config), chunk


def at_position(state: DecodeState, position: int) -> DecodeState:
  """`state` with every slot's next token at `position`, placed as `state` is."""
  positions = np.full(state.positions.shape, position, np.int32)
  return jax.device_put(dataclasses.replace(state, positions=positions),
                        jax.tree.map(lambda x: x.sharding, state))


def prefill_tokens_per_s(model, length: int, repeats: int = 3, **config) -> float:
  engine, chunk = prefill_engine(model, length, **config)
  return length / min(harness.timed(lambda: engine.step(StepPlan(prefills=(chunk,))).result(),
                                    repeats))


def step_bytes(model, batch: int, context: int) -> int:
  """Bytes one decode step must read: every parameter (the embedding once, as the output head;
  its lookup reads only `batch` rows) plus each slot's K and V for `context` positions."""
  cfg = model.cfg
  params = sum(x.nbytes for x in jax.tree.leaves(jax.tree.map(lambda v: v, model.layers)))
  embed = model.embed  # A Param, or a quantized weight's module (values, scales).
  params += (sum(x.nbytes for x in jax.tree.leaves(nnx.state(embed)))
             if isinstance(embed, nnx.Module) else embed[...].nbytes)
  params += model.final_norm[...].nbytes
  kv = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
  return params + kv


UNROLL = {"scan": False, "unrolled": True}  # --layers: EngineConfig.unroll_layers
SAMPLING_KINDS = {"greedy": SamplingParams(temperature=0),
                  "top-k/top-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
                  "temperature": SamplingParams(temperature=1.0)}


def sampling_ms(module, batch: int, vocab: int, params: SamplingParams, repeats: int = 10) -> float:
  """Median ms of `module.sample` alone on [batch, vocab] logits shaped like a model's (a few
  tokens well above a normal bulk), every row with `params`."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(batch, vocab)).astype(np.float32) * 2
  top = rng.integers(0, vocab, (batch, 8))
  np.put_along_axis(logits, top, rng.uniform(8, 14, (batch, 8)).astype(np.float32), 1)
  rows = [SamplingRow.from_params(params, i, (), (), vocab).as_state() for i in range(batch)]
  state = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *rows)
  fn = jax.jit(module.sample)
  args = (jnp.asarray(logits), state, jnp.arange(batch, dtype=jnp.int32) + 100,
          jnp.asarray([0], jnp.int32))
  times = harness.timed(lambda: fn(*args).tokens.block_until_ready(), repeats)
  return 1000 * float(np.median(times))


def load_sample_module(path: str):
  name = f"baseline_sample_{abs(hash(path))}"
  spec = importlib.util.spec_from_file_location(name, path)
  module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
  spec.loader.exec_module(module)
  return module


def startup_seconds() -> tuple[float, float]:
  """(cold, warm): seconds to load the default model and compile every bucket, in a fresh
  process, first with an empty persistent compilation cache, then with the one it filled."""
  code = ("import time; t = time.perf_counter(); import jaxserve;"
          "jaxserve.LLM(engine_config=jaxserve.EngineConfig(compilation_cache_dir={!r}));"
          "print(time.perf_counter() - t)")
  with tempfile.TemporaryDirectory() as cache:
    run = lambda: float(subprocess.run([sys.executable, "-c", code.format(cache)], check=True,
                                       capture_output=True, text=True).stdout.split()[-1])
    return run(), run()


def measure(args) -> dict:
  """One model's figures, in this process."""
  model, _ = checkpoint.load_model(args.model, quantization=Quantization(args.quantization))
  rows = []
  for batch in (int(b) for b in args.batches.split(",")):
    ms = decode_ms(model, batch, args.context, args.steps)
    rows.append({"batch": batch, "ms": ms, "bytes": step_bytes(model, batch, args.context)})
  return {"model": args.model or "default", "rows": rows,
          "prefill_tokens_per_s": prefill_tokens_per_s(model, args.prefill)}


def compare(args) -> None:
  """Each model in a fresh process (`--json`), then one table with ratios to the first."""
  results = []
  for name in args.compare.split(","):
    load = os.getloadavg()[0]
    out = harness.fresh("decode", ["--json", "--model", name, "--batches", args.batches,
                                   "--context", str(args.context), "--steps", str(args.steps),
                                   "--prefill", str(args.prefill),
                                   "--quantization", args.quantization])
    results.append({**out, "load": load})
  base = results[0]
  print("| model | load avg at start | " + " | ".join(
      f"batch {r['batch']} ms/step (x first)" for r in base["rows"])
        + " | prefill tokens/s (x first) |")
  print("|---" * (3 + len(base["rows"])) + "|")
  for r in results:
    steps = [f"{row['ms']:.1f} ({row['ms'] / b['ms']:.2f}x)"
             for row, b in zip(r["rows"], base["rows"])]
    prefill = r["prefill_tokens_per_s"]
    print(f"| {r['model']} | {r['load']:.1f} | " + " | ".join(steps) +
          f" | {prefill:.0f} ({prefill / base['prefill_tokens_per_s']:.2f}x) |")


def print_sampling(steps: dict, vocab: int, baseline: str | None) -> None:
  """sample() alone per batch and kind of row, as ms and as a share of that batch's step."""
  versions = {"this": sample_lib} | ({"baseline": load_sample_module(baseline)} if baseline else {})
  print("\n| sample() | batch | " + " | ".join(f"{v} ms (share of step)" for v in versions) + " |")
  print("|---" * (2 + len(versions)) + "|")
  for kind, params in SAMPLING_KINDS.items():
    for batch, step in steps.items():
      times = [sampling_ms(m, batch, vocab, params) for m in versions.values()]
      cells = [f"{ms:.2f}" + (f" ({ms / step:.1%})" if step else "") for ms in times]
      print(f"| {kind} | {batch} | " + " | ".join(cells) + " |")


def main_decode(argv=None) -> None:
  """Decode step time, prefill throughput and the memory-bandwidth roofline, on the default model.

    python -m scripts.bench decode [--model NAME] [--batches 1,8,32] [--context 256] [--startup]
        [--layers scan|unrolled] [--quantization auto|none|gguf|int8]
    python -m scripts.bench decode --compare smollm2-135m-instruct,gemma-3-270m [--batches 1,8]
    python -m scripts.bench decode --batches 16,64 --sampling [--sampling-baseline OLD_SAMPLE_PY]
        [--sampling-only]

  `--compare` runs each model in its own fresh process, one after the other in the same run (no
  model's compiled programs or memory linger into the next one's), then prints them side by side
  with the ratios to the first model: on a loaded machine the ratios are the figures to keep.

  Decode is memory-bound at few slots and compute-bound at many: each step reads every weight
  once plus each slot's KV cache, and does 2 FLOPs per weight per slot plus its attention. The
  floor is max(bytes / copy bandwidth, FLOPs / GEMM rate), both rates measured on this machine in
  this same run (a large array copied by XLA; a 1024^3 float32 matmul by XLA), so the ratio holds
  even when the machine is slower or busier than usual.
  `--sampling` also times `sample()` alone on the same batches (greedy rows, top-k/top-p rows,
  plain temperature rows) and prints its share of the step; `--sampling-baseline` times another
  version of jaxserve/engine/sample.py (e.g. `git show main:jaxserve/engine/sample.py >
  /tmp/old.py`) in the same run, for a before/after on a loaded machine.
  `--startup` also times a cold start (empty compilation cache) against a warm one, in
  subprocesses.
  """
  parser = harness.parser("decode", main_decode.__doc__)
  parser.add_argument("--model", default=None,
                      help="a packaged name or a path (default: the default model)")
  parser.add_argument("--compare", default=None,
                      help="comma-separated models, each in a fresh process")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON line of this model's figures")
  parser.add_argument("--batches", default="1,8,32")
  parser.add_argument("--context", type=int, default=256, help="tokens already cached per slot")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--prefill", type=int, default=512, help="prompt length for prefill tokens/s")
  parser.add_argument("--startup", action="store_true", help="also time cold and warm start-up")
  parser.add_argument("--quantization", choices=("auto", "none", "gguf", "int8"), default="auto",
                      help="how the weights are stored (EngineConfig.quantization; auto, the "
                           "default, is gguf on a CPU with kernels_cpu built)")
  parser.add_argument("--layers", choices=("scan", "unrolled"), default="scan",
                      help="EngineConfig.unroll_layers False (the default) or True")
  parser.add_argument("--sampling", action="store_true",
                      help="also time sample() alone, and its share")
  parser.add_argument("--sampling-baseline", default=None,
                      help="another sample.py to time beside it")
  parser.add_argument("--sampling-only", action="store_true",
                      help="time sample() alone, no decode steps")
  args = parser.parse_args(argv)
  if args.compare:
    compare(args)
    return
  if args.json:
    print(json.dumps(measure(args)))
    return

  model, _ = checkpoint.load_model(args.model, quantization=Quantization(args.quantization))
  if args.sampling_only:
    print_sampling({int(b): None for b in args.batches.split(",")}, model.cfg.vocab_size,
                   args.sampling_baseline)
    return
  bandwidth, rate = copy_bandwidth(), gemm_rate()
  print(f"{jax.devices()[0].device_kind}: copy bandwidth {bandwidth / 1e9:.1f} GB/s, "
        f"GEMM {rate / 1e9:.0f} GFLOP/s\n")
  print("| batch | ms/step | tokens/s | bytes/step (MB) | bytes floor ms | GFLOP/step "
        "| FLOPs floor ms | x floor |")
  print("|---|---|---|---|---|---|---|---|")
  steps, layers = {}, {"unroll_layers": UNROLL[args.layers]}
  for batch in (int(b) for b in args.batches.split(",")):
    ms = steps[batch] = decode_ms(model, batch, args.context, args.steps, **layers)
    nbytes, flops = step_bytes(model, batch, args.context), step_flops(model, batch, args.context)
    by_bytes, by_flops = 1000 * nbytes / bandwidth, 1000 * flops / rate
    print(f"| {batch} | {ms:.1f} | {1000 * batch / ms:.0f} | {nbytes / 1e6:.0f} | {by_bytes:.1f} | "
          f"{flops / 1e9:.1f} | {by_flops:.1f} | {ms / max(by_bytes, by_flops):.2f} |")
  if args.sampling:
    print_sampling(steps, model.cfg.vocab_size, args.sampling_baseline)
  tokens_per_s = prefill_tokens_per_s(model, args.prefill, **layers)
  print(f"\nprefill, {args.prefill}-token prompt: {tokens_per_s:.0f} tokens/s")
  if args.startup:
    cold, warm = startup_seconds()
    print(f"start-up (load + compile all buckets): cold {cold:.1f} s, warm {warm:.1f} s "
          f"(warm/cold {warm / cold:.2f})")


# ---- prefill


def prefill_flops(cfg: ModelConfig, n: int) -> int:
  """FLOPs of prefilling an n-token prompt and its one sampled token's head."""
  D, N, K, H, F = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_dim
  per_layer = D * N * H * 2 + 2 * D * K * H + 3 * D * F  # q, o; k, v; gate, up, down
  attention = 4 * N * H * n * (n + 1) // 2
  return cfg.num_layers * (2 * per_layer * n + attention) + 2 * cfg.vocab_size * D


def prefill_seconds(llm: jaxserve.LLM, length: int, rng: np.random.Generator) -> float:
  """Seconds of one fresh `length`-token prompt through LLM.generate, one greedy token out."""
  ids = rng.integers(100, llm.model.cfg.vocab_size - 100, length).tolist()
  start = time.perf_counter()
  out, = llm.generate([ids], jaxserve.SamplingParams(temperature=0, max_tokens=1,
                                                     ignore_eos=True))
  elapsed = time.perf_counter() - start
  assert len(out.token_ids) == 1
  return elapsed


def chunk_step_ms(model, starts: list[int], n: int = 512) -> None:
  """Prints the best of 3 times of one n-token prefill chunk step whose sequence already holds
  `start` positions (zeros: their values change no time), on an engine of one slot."""
  config = jaxserve.EngineConfig(num_slots=1, num_pages=520, max_model_len=8192,
                                 prefill_buckets=(n,), compilation_cache_dir=None,
                                 window_pages=False)
  engine = Engine(model, config)
  for start in starts:
    pages = list(range(1, -(-(start + n) // 16) + 1))
    chunk = PrefillChunk("p", 0, list(range(100, 100 + n)), start, pages, True,
                         jaxserve.SamplingParams(temperature=0), 0, (), ())
    best = min(harness.timed(lambda: engine.step(StepPlan(prefills=(chunk,))).result(), 3))
    print(f"{n}-token chunk at {start}: {1000 * best:.0f} ms", flush=True)


def main_prefill(argv=None) -> None:
  """Prefill of long prompts against short ones, as `LLM()` chunks them, and the FLOPs floor.

    python -m scripts.bench prefill [--lengths 500,6000] [--repeats 2] [--model NAME]
    python -m scripts.bench prefill --chunk-at 0,2048,5632   # one 512-token chunk step at each

  Each prompt (random token ids, a fresh one every run, so the prefix cache never hits) goes
  through `LLM.generate` with max_tokens=1 on an engine of the default settings but for a context
  that holds it (`--max-model-len`, `--num-pages`): the scheduler chunks it into steps of the
  largest prefill bucket as it would any request. Warm-up compiles every program first; the time
  is the median of `--repeats` runs after one untimed run at that length.

  The floor is the prompt's FLOPs over the GEMM rate measured in this same run (a 1024^3 float32
  matmul by XLA, as `decode`): 2 per matmul weight per token, the output head once, and
  attention's 4 * N * H per (query, key) pair it really attends (causal: n (n + 1) / 2 pairs per
  layer). The figure to keep is the ratio of the long prompt's tokens/s to the short one's.
  """
  parser = harness.parser("prefill", main_prefill.__doc__)
  parser.add_argument("--model", default=None)
  parser.add_argument("--lengths", default="500,6000")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--max-model-len", type=int, default=8192)
  parser.add_argument("--num-pages", type=int, default=1024)
  parser.add_argument("--chunk-at", default=None,
                      help="comma-separated starts: time one 512-token chunk step at each")
  args = parser.parse_args(argv)
  if args.chunk_at:
    chunk_step_ms(checkpoint.load_model(args.model)[0], [int(s) for s in args.chunk_at.split(",")])
    return
  lengths = [int(n) for n in args.lengths.split(",")]
  config = jaxserve.EngineConfig(max_model_len=args.max_model_len, num_pages=args.num_pages)
  llm = jaxserve.LLM(args.model, engine_config=config)
  rate = gemm_rate()
  rng = np.random.default_rng(0)
  print(f"GEMM {rate / 1e9:.0f} GFLOP/s; buckets {config.prefill_buckets}\n")
  print("| prompt tokens | s | tokens/s | GFLOP | FLOPs floor s | x floor |")
  print("|---|---|---|---|---|---|")
  speed = {}
  for n in lengths:
    prefill_seconds(llm, n, rng)  # Untimed: the first run at a length settles caches.
    s = statistics.median(prefill_seconds(llm, n, rng) for _ in range(args.repeats))
    flops = prefill_flops(llm.model.cfg, n)
    speed[n] = n / s
    print(f"| {n} | {s:.2f} | {n / s:.0f} | {flops / 1e9:.0f} | {flops / rate:.2f} | "
          f"{s * rate / flops:.2f} |")
  print(f"\ntokens/s of {lengths[-1]} tokens / of {lengths[0]}: "
        f"{speed[lengths[-1]] / speed[lengths[0]]:.2f}")


COMMANDS = {"decode": main_decode, "prefill": main_prefill}

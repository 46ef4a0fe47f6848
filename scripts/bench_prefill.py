"""Prefill of long prompts against short ones, as `LLM()` chunks them, and the FLOPs floor.

  python scripts/bench_prefill.py [--lengths 500,6000] [--repeats 2] [--model NAME]
  python scripts/bench_prefill.py --chunk-at 0,2048,5632   # one 512-token chunk step at each

Each prompt (random token ids, a fresh one every run, so the prefix cache never hits) goes through
`LLM.generate` with max_tokens=1 on an engine of the default settings but for a context that holds
it (`--max-model-len`, `--num-pages`): the scheduler chunks it into steps of the largest prefill
bucket as it would any request. Warm-up compiles every program first; the time is the median of
`--repeats` runs after one untimed run at that length.

The floor is the prompt's FLOPs over the GEMM rate measured in this same run (a 1024^3 float32
matmul by XLA, as bench_decode.py): 2 per matmul weight per token, the output head once, and
attention's 4 * N * H per (query, key) pair it really attends (causal: n (n + 1) / 2 pairs per
layer). The figure to keep is the ratio of the long prompt's tokens/s to the short one's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import numpy as np
from bench_decode import gemm_rate

import jaxserve
from jaxserve.batching.plan import PrefillChunk, StepPlan
from jaxserve.config import ModelConfig
from jaxserve.engine.engine import Engine


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
    engine.step(StepPlan(prefills=(chunk,))).result()
    times = []
    for _ in range(3):
      t = time.perf_counter()
      engine.step(StepPlan(prefills=(chunk,))).result()
      times.append(time.perf_counter() - t)
    print(f"{n}-token chunk at {start}: {1000 * min(times):.0f} ms", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default=None)
  parser.add_argument("--lengths", default="500,6000")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--max-model-len", type=int, default=8192)
  parser.add_argument("--num-pages", type=int, default=1024)
  parser.add_argument("--chunk-at", default=None,
                      help="comma-separated starts: time one 512-token chunk step at each")
  args = parser.parse_args()
  if args.chunk_at:
    from jaxserve.loading import checkpoint
    chunk_step_ms(checkpoint.load_model(args.model)[0], [int(s) for s in args.chunk_at.split(",")])
    return
  lengths = [int(n) for n in args.lengths.split(",")]
  config = jaxserve.EngineConfig(max_model_len=args.max_model_len, num_pages=args.num_pages)
  llm = jaxserve.LLM(args.model, engine_config=config)
  rate = gemm_rate()
  rng = np.random.default_rng(0)
  print(f"jax {jax.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
        f"GEMM {rate / 1e9:.0f} GFLOP/s; buckets {config.prefill_buckets}\n")
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


if __name__ == "__main__":
  main()

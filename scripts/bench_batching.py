"""Offline throughput of the real default model: continuous vs static batching, in one run.

  python scripts/bench_batching.py [--requests 48] [--slots 8] [--seed 0]

A mixed workload (prompt lengths 16-192, output lengths 8-160, end-of-sequence ignored so both
modes generate the same tokens) runs through one engine, first with static batching (a group is
admitted together and the next waits for its longest member), then with continuous batching.
Both runners share the same compiled engine, so the ratio compares scheduling alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np

from jaxserve.batching.runner import Runner
from jaxserve.config import EngineConfig, SamplingParams, SchedulerConfig
from jaxserve.llm import LLM


def workload(num: int, seed: int, vocab: int):
  rng = np.random.default_rng(seed)
  prompts = [list(rng.integers(100, vocab - 100, int(rng.integers(16, 193)))) for _ in range(num)]
  params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=int(rng.integers(8, 161)))
            for _ in range(num)]
  return list(zip(prompts, params))


def run(llm: LLM, config: SchedulerConfig, work) -> tuple[float, int, int]:
  """(wall seconds, generated tokens, engine steps)."""
  runner = Runner(llm.engine, llm.tokenizer, config)
  start = time.perf_counter()
  outs = runner.generate(work)
  return (time.perf_counter() - start, sum(len(o.token_ids) for o in outs),
          runner.scheduler.num_steps)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--requests", type=int, default=48)
  parser.add_argument("--slots", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  engine = EngineConfig(num_slots=args.slots, page_size=16, num_pages=args.slots * 24 + 1,
                        max_model_len=384, prefill_buckets=(64, 128, 256))
  llm = LLM(None, engine_config=engine)
  work = workload(args.requests, args.seed, llm.tokenizer.vocab_size)
  base = SchedulerConfig(max_num_batched_tokens=256)
  static = run(llm, dataclasses.replace(base, static_batching=True), work)
  continuous = run(llm, base, work)
  print(f"{args.requests} requests, {args.slots} slots, load average {os.getloadavg()[0]:.1f}\n")
  print("| mode | wall s | generated tokens | tokens/s | engine steps |")
  print("|---|---|---|---|---|")
  for name, (wall, tokens, steps) in (("static", static), ("continuous", continuous)):
    print(f"| {name} | {wall:.1f} | {tokens} | {tokens / wall:.1f} | {steps} |")
  print(f"\ncontinuous / static throughput: "
        f"{(continuous[1] / continuous[0]) / (static[1] / static[0]):.2f}x")


if __name__ == "__main__":
  main()

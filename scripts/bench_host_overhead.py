"""Host overhead per step: the Runner and Scheduler at 64 busy slots with a zero-cost engine.

Everything measured is host work: planning, page bookkeeping, reading tokens back, stop checks,
detokenizing and building outputs. Target: under 1 ms per step. Both wall time and this thread's
CPU time are reported: on a loaded machine the wall time's tail is other processes.

  python scripts/bench_host_overhead.py              # a null tokenizer: scheduler + runner only
  python scripts/bench_host_overhead.py --tokenizer  # SmolLM2's tokenizer and the detokenizer too
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Sequence

import numpy as np

from jaxserve.batching.plan import EngineInfo, StepPlan
from jaxserve.batching.runner import Runner
from jaxserve.config import EngineConfig, SamplingParams, SchedulerConfig


class _Done:

  def __init__(self, tokens: np.ndarray):
    self._tokens = tokens

  def result(self) -> np.ndarray:
    return self._tokens


class ZeroEngine:
  """plan.Engine that does no work: tokens come from a few precomputed arrays. Its limits are the
  default EngineConfig's (prefill buckets, prompts per step), so the scheduler plans as it would
  for the real engine."""

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


def bench(num_slots: int, num_requests: int, tokenizer, stop: Sequence[str]) -> dict[str, float]:
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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--slots", type=int, default=64)
  parser.add_argument("--requests", type=int, default=256)
  parser.add_argument("--tokenizer", action="store_true",
                      help="detokenize with SmolLM2's tokenizer (and check a stop string)")
  args = parser.parse_args()
  tokenizer, stop = NullTokenizer(), ()
  if args.tokenizer:
    from jaxserve.loading import pull  # pylint: disable=g-import-not-at-top
    from jaxserve.text.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
    tokenizer, stop = Tokenizer.from_gguf(pull.gguf_path(pull.SMOLLM2)), ("\n\nUser:",)
  r = bench(args.slots, args.requests, tokenizer, stop)
  print(f"{args.slots} slots, {args.requests} requests, "
        f"{'SmolLM2 tokenizer + stop string' if args.tokenizer else 'null tokenizer'}: "
        f"{r['steps']} steps, {r['busy_steps']} with every slot decoding")
  for name in ("wall", "cpu"):
    mean, p50, p99, overall = r[name]
    print(f"  {name:4s} ms/step, all slots busy: mean {mean:.3f}, p50 {p50:.3f}, p99 {p99:.3f}; "
          f"over all steps: mean {overall:.3f}")


if __name__ == "__main__":
  main()

"""Continuous vs static batching on a mock model: device steps taken, and a slot-occupancy picture.

The real Runner and Scheduler drive an engine that does no work (every token is 1, no KV), so the
step counts are the scheduler's alone. Each request stops at its max_tokens.

  python scripts/simulate_batching.py --out slot_occupancy.png
"""

from __future__ import annotations

import argparse
import random
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


class NullEngine:
  """plan.Engine doing no work; records which request each slot served in each step. Its limits
  are the default EngineConfig's (prefill buckets, prompts per step)."""

  def __init__(self, num_slots: int, num_pages: int = 4096, page_size: int = 16,
               max_model_len: int = 2048, vocab_size: int = 49152):
    config = EngineConfig(num_slots=num_slots, page_size=page_size, num_pages=num_pages,
                          max_model_len=max_model_len)
    self.num_slots = num_slots
    self.info = EngineInfo(num_slots, page_size, num_pages, max_model_len,
                           config.prefill_buckets[-1], True, vocab_size,
                           config.prefill_buckets, config.dtype.value,
                           config.max_prefill_seqs)
    self.occupancy: list[dict[int, str]] = []  # Per device step: slot -> request id.
    self._owner: dict[int, str] = {}
    self._step: dict[int, str] = {}

  def step(self, plan: StepPlan, bitmask: np.ndarray | None = None) -> _Done:
    """Token 1 for each decode slot, then for each chunk that ends its prompt."""
    for chunk in plan.prefills:
      self._owner[chunk.slot] = self._step[chunk.slot] = chunk.request_id
    for slot in plan.decode_slots:
      self._step[slot] = self._owner[slot]
    n = len(plan.decode_slots) + sum(ch.is_last for ch in plan.prefills)
    return _Done(np.ones(n, np.int32))


  def end_step(self) -> None:
    if self._step:
      self.occupancy.append(self._step)
      self._step = {}


class NullTokenizer:
  stop_ids = frozenset()
  eos_id = None

  def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return ""


def workload(num_requests: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
  """Prompts of 16-256 tokens; output lengths long-tailed (lognormal, median ~90, 8..1024)."""
  rng = random.Random(seed)
  requests = []
  for i in range(num_requests):
    prompt = [1000 * i + j for j in range(rng.randint(16, 256))]  # Distinct: no prefix hits.
    max_tokens = min(1024, max(8, int(rng.lognormvariate(4.5, 0.9))))
    requests.append((prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
  return requests


def simulate(requests, num_slots: int, static: bool) -> NullEngine:
  engine = NullEngine(num_slots)
  runner = Runner(engine, NullTokenizer(), SchedulerConfig(static_batching=static))
  for prompt, sampling in requests:
    runner.add_request(prompt, sampling)
  while runner.has_unfinished:
    runner.step()
    engine.end_step()
  return engine


def occupancy_matrix(engine: NullEngine) -> np.ndarray:
  """[slots, steps] request index + 1, 0 where the slot is idle."""
  index: dict[str, int] = {}
  grid = np.zeros((engine.num_slots, len(engine.occupancy)), np.int32)
  for t, step in enumerate(engine.occupancy):
    for slot, rid in step.items():
      grid[slot, t] = index.setdefault(rid, len(index)) + 1
  return grid


def plot(results: dict[tuple[int, bool], NullEngine], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  slot_counts = sorted({s for s, _ in results})
  fig, axes = plt.subplots(len(slot_counts), 2, figsize=(14, 2 + 1.6 * len(slot_counts)),
                           squeeze=False)
  cmap = matplotlib.colormaps["tab20"].resampled(20)
  for row, slots in enumerate(slot_counts):
    width = max(len(results[slots, s].occupancy) for s in (False, True))
    for col, static in enumerate((False, True)):
      grid = occupancy_matrix(results[slots, static])
      colors = np.ones(grid.shape + (3,))  # Idle: white.
      busy = grid > 0
      colors[busy] = cmap((grid[busy] - 1) % 20)[:, :3]
      ax = axes[row, col]
      ax.imshow(colors, aspect="auto", interpolation="nearest", extent=(0, grid.shape[1], slots, 0))
      ax.set_xlim(0, width)
      ax.set_title(f"{'static' if static else 'continuous'} batching, {slots} slots: "
                   f"{grid.shape[1]} steps, {busy.mean():.0%} busy", fontsize=10)
      ax.set_xlabel("step")
      ax.set_ylabel("slot")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--requests", type=int, default=64)
  parser.add_argument("--slots", type=int, nargs="+", default=[4, 16])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="slot_occupancy.png", help="PNG path ('' to skip)")
  args = parser.parse_args()
  requests = workload(args.requests, args.seed)
  outputs = [s.max_tokens for _, s in requests]
  print(f"{args.requests} requests: output tokens total {sum(outputs)}, min {min(outputs)}, "
        f"median {int(np.median(outputs))}, max {max(outputs)}")
  results = {}
  for slots in args.slots:
    for static in (False, True):
      results[slots, static] = simulate(requests, slots, static)
    cont, stat = (len(results[slots, s].occupancy) for s in (False, True))
    print(f"{slots:3d} slots: continuous {cont} steps, static {stat} steps "
          f"({stat / cont:.2f}x); lower bound {-(-sum(outputs) // slots)} decode steps")
  if args.out:
    plot(results, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()

"""`python -m scripts.bench step --old TREE`: this tree's engine against another source tree's, each
in a fresh process: one engine call per iteration against the design before it. Nothing here
imports jaxserve at the top: the tree measured goes first on sys.path before the first import.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time

from . import harness


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

  from jaxserve.batching.plan import PrefillChunk, StepPlan
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
      chunk = PrefillChunk("r", s, ids, 0, tables[s], True, greedy, 0, ids, ())
      engine.step(StepPlan(prefills=(chunk,))).result()
    plan = StepPlan(decode_slots=tuple(range(slots)), page_tables=tables)
    # The untimed first call compiles.
    times = harness.timed(lambda: engine.step(plan).result(), args.steps)
    out[str(slots)] = 1e3 * statistics.median(times)
  print(json.dumps(dict(decode_ms=out, load_avg=os.getloadavg()[0])))


def _medians(runs: list[dict]) -> dict:
  """One design's rounds: the median of each figure (decode_ms per slot count), the rest of the
  first round's (tokens, iterations)."""
  out = dict(runs[0])
  for k in ("wall_s", "calls_per_iteration", "ttft_mean_s", "ttft_p90_s"):
    out[k] = statistics.median(r[k] for r in runs)
  out["decode_ms"] = {s: statistics.median(r["decode_ms"][s] for r in runs)
                      for s in runs[0]["decode_ms"]}
  out["rounds_wall_s"] = [r["wall_s"] for r in runs]
  return out


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
        [--rounds 3]

  Each measurement runs in a fresh process that puts one source tree (this one, or --old) first
  on sys.path before it imports jaxserve, so both run this command but their own jaxserve. The
  engine API both share (`step(plan)` and the runner) is all the command touches; engine calls
  are counted where the runner makes them. With --rounds the designs alternate, round by round,
  and each figure is the median of its rounds. Prints one JSON object per design and the new /
  old ratios. On a loaded machine only
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
  p.add_argument("--rounds", type=int, default=1,
                 help="interleaved rounds of both designs; medians are compared")
  args = p.parse_args(argv)
  if args.tree:
    sys.path.insert(0, str(args.tree))
  if args.mode == "workload":
    return workload(args)
  if args.mode == "decode":
    return decode_steps(args)
  trees = {"old": args.old, "new": harness.ROOT}
  runs = harness.interleaved(list(trees), args.rounds, lambda name: dict(
      run_in(trees[name], "workload", args), **run_in(trees[name], "decode", args)))
  results = {name: _medians(rs) for name, rs in runs.items()}
  same = all(r["tokens"] == runs["old"][0]["tokens"] for rs in runs.values() for r in rs)
  for r in results.values():
    r.pop("tokens")
  ratio = lambda k: results["new"][k] / results["old"][k]
  results["same_tokens"] = same
  results["new_over_old"] = {k: ratio(k) for k in ("wall_s", "calls_per_iteration",
                                                    "ttft_mean_s", "ttft_p90_s")}
  results["new_over_old"]["decode_ms"] = {
      s: results["new"]["decode_ms"][s] / results["old"]["decode_ms"][s]
      for s in results["new"]["decode_ms"]}
  print(json.dumps(results, indent=1))


COMMANDS = {"step": main_step}

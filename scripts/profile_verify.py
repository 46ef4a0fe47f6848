"""Where a verifying step's time goes against a plain decode step's, on XLA:CPU, per part.

  python scripts/profile_verify.py [--batches 1,16] [--context 320] [--steps 8]

For each batch of slots (k = 4, n-gram speculation, greedy, `--context` cached positions each):
the plain step decodes every slot; the verifying step is what the peers and copy workloads run
(bench_speculative.py): up to max_prefill_seqs slots each verify a chunk of k + 1 tokens (the
slot's token and k proposals), the others decode. Each step's wall time (median of `--steps`
runs, each to its result on the host) and, under `jax.profiler.trace`, its op times summed by
part (profile_decode.py's parts) are printed side by side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_xprof_traceme=true").strip()

import numpy as np  # noqa: E402
from bench_decode import decode_engine  # noqa: E402
from profile_decode import plan_op_times, start_slots  # noqa: E402

from jaxserve.batching.plan import PrefillChunk, StepPlan  # noqa: E402
from jaxserve.config import SamplingParams, SpeculativeConfig  # noqa: E402
from jaxserve.loading import checkpoint  # noqa: E402

GREEDY = SamplingParams(temperature=0)


def plans(engine, tables: np.ndarray, context: int, k: int) -> dict[str, StepPlan]:
  """The plain step (every slot decodes) and the verifying one (the first max_prefill_seqs
  slots verify k proposals each, the rest decode). The verified chunks' first token and start
  are read from the slots' decode state, so the plan's are placeholders."""
  slots = list(range(len(tables)))
  verifying = slots[:engine.config.max_prefill_seqs]
  chunks = tuple(PrefillChunk(f"r{s}", s, [1] + [100 + i for i in range(k)], context,
                              list(tables[s]), True, GREEDY, s, (), (), num_drafts=k)
                 for s in verifying)
  return {"decode": StepPlan(decode_slots=tuple(slots), page_tables=tables),
          "verify": StepPlan(prefills=chunks, decode_slots=tuple(slots[len(verifying):]),
                             page_tables=tables)}


def time_step(engine, plan: StepPlan, steps: int) -> float:
  """Median wall ms of one step, to its result on the host (compiled beforehand)."""
  engine.step(plan).result()
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    engine.step(plan).result()
    times.append((time.perf_counter() - start) * 1000)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default=None)
  parser.add_argument("--batches", default="1,16")
  parser.add_argument("--context", type=int, default=320)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
  args = parser.parse_args()
  model, _ = checkpoint.load_model(args.model)
  spec = SpeculativeConfig(num_speculative_tokens=args.k)
  for batch in (int(b) for b in args.batches.split(",")):
    # Each verifying step moves its slots up to k + 1 positions: room for all of them.
    engine, tables = decode_engine(model, batch, args.context + 3 * args.steps * (args.k + 2),
                                   speculative=spec)
    start_slots(engine, tables, args.context, GREEDY)
    steps = plans(engine, tables, args.context, args.k)
    wall = {name: time_step(engine, plan, args.steps) for name, plan in steps.items()}
    ops = {name: plan_op_times(engine, plan, args.steps) for name, plan in steps.items()}
    print(f"\nbatch {batch}, k = {args.k}, context {args.context}: decode {wall['decode']:.1f} "
          f"ms, verify {wall['verify']:.1f} ms ({wall['verify'] / wall['decode']:.2f}x) wall; "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| part | decode ms | verify ms |\n|---|---|---|")
    names = sorted(set(ops["decode"]) | set(ops["verify"]), key=lambda n: -ops["verify"][n])
    for name in names + ["(sum of ops)"]:
      d, v = ((sum(ops[s].values()) for s in ("decode", "verify")) if name == "(sum of ops)"
              else (ops["decode"][name], ops["verify"][name]))
      print(f"| {name} | {d:.2f} | {v:.2f} |")


if __name__ == "__main__":
  main()

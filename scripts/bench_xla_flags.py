"""XLA:CPU compiler options on the decode step (16 and 64 slots) and a 256-token prefill.

  python scripts/bench_xla_flags.py [--batches 16,64] [--prefill 256] [--rounds 3]

Each configuration compiles the engine's own step (`Engine._step`) for a decode-only plan (every
slot at position --context) and a prefill-only plan of one prompt with its options
(`Lowered.compile(compiler_options)`: the same XLA debug options as XLA_FLAGS, set per program),
all in this one process; the rounds then time every configuration in turn, so a machine whose
load drifts (other jobs) slows all of them alike and the ratios to the default stay meaningful.
A configuration the compiler rejects is reported with its error. Not here: oneDNN dot fusions
(`--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot`), which abort the
process while compiling the decode step ("partition compile failed"). `--configs` picks a subset.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from bench_decode import at_position, decode_engine, prefill_engine

from jaxserve.batching.plan import StepPlan
from jaxserve.engine.engine import Engine
from jaxserve.engine.step_args import StepArgs
from jaxserve.loading import checkpoint

_NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}
_ALL = "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE"
CONFIGS = {
    "default (YNN fusions)": {},
    "no YNN fusions": _NO_YNN,
    "YNN dot+eltwise+reduce": {"xla_cpu_experimental_ynn_fusion_type": _ALL},
    "no YNN, XNN dot+eltwise+reduce": {**_NO_YNN, "xla_cpu_experimental_xnn_fusion_type": _ALL},
    "no YNN, XNN graph fusion greedy": {**_NO_YNN, "xla_cpu_experimental_xnn_graph_fusion_mode":
                                        "XNN_GRAPH_FUSION_MODE_GREEDY"},
    "no YNN, xnnpack off": {**_NO_YNN, "xla_cpu_use_xnnpack": False},
    "single-threaded Eigen": {"xla_cpu_multi_thread_eigen": False},
}


class Program:
  """The engine's step compiled under each configuration for one StepArgs, called with the cache
  and decode state threaded through (the step donates and returns both). `reset` (optional)
  gives the state each call starts from, so every call of every configuration does the same work."""

  def __init__(self, engine: Engine, args: StepArgs, reset=None):
    self.engine, self.args, self.reset = engine, args, reset
    lowered = engine._step.lower(*self._inputs())
    self.compiled, self.errors = {}, {}
    for name, options in CONFIGS.items():
      try:
        self.compiled[name] = lowered.compile(options)
      except Exception as e:  # noqa: BLE001 (the compiler's verdict is the result)
        self.errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    self.run(next(iter(self.compiled)))

  def _inputs(self):
    e = self.engine
    return (e.params, e.cache, e.state, self.args, e.stop_ids)

  def run(self, name: str) -> float:
    if self.reset is not None:
      self.engine.state = self.reset(self.engine.state)
    start = time.perf_counter()
    self.engine.cache, self.engine.state, out = self.compiled[name](*self._inputs())
    out.block_until_ready()
    return time.perf_counter() - start


def decode_program(model, batch: int, context: int) -> Program:
  """A decode step of every slot, each at position `context` (so it reads `context` cached
  positions and writes one more) on every call."""
  engine, tables = decode_engine(model, batch, context + 1)
  args, _ = engine.step_args(StepPlan(decode_slots=tuple(range(batch)), page_tables=tables))
  return Program(engine, args, reset=lambda state: at_position(state, context))


def prefill_program(model, length: int) -> Program:
  """A prefill-only step of one `length`-token prompt that ends (samples its first token)."""
  engine, chunk = prefill_engine(model, length)
  args, _ = engine.step_args(StepPlan(prefills=(chunk,)))
  return Program(engine, args)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default=None)
  parser.add_argument("--batches", default="16,64")
  parser.add_argument("--context", type=int, default=128)
  parser.add_argument("--prefill", type=int, default=256)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=3, help="calls per configuration per round")
  parser.add_argument("--configs", default=None,
                      help="comma-separated indices into CONFIGS (default all)")
  args = parser.parse_args()
  if args.configs:
    keep = [list(CONFIGS)[int(i)] for i in args.configs.split(",")]
    for name in [c for c in CONFIGS if c not in keep]:
      del CONFIGS[name]
  model, _ = checkpoint.load_model(args.model)
  programs = {f"decode {b} slots": decode_program(model, int(b), args.context)
              for b in args.batches.split(",") if b}
  programs[f"prefill {args.prefill} tokens"] = prefill_program(model, args.prefill)
  times = {(p, c): [] for p in programs for c in CONFIGS}
  load = [os.getloadavg()[0]]
  for _ in range(args.rounds):
    for p, program in programs.items():
      for c in program.compiled:
        times[p, c] += [program.run(c) for _ in range(args.steps)]
    load.append(os.getloadavg()[0])
  print(f"load average {min(load):.1f}-{max(load):.1f}; ms per call, median of {args.rounds} "
        f"rounds x {args.steps} calls (x default)\n")
  print("| configuration | " + " | ".join(programs) + " |")
  print("|---" * (1 + len(programs)) + "|")
  for c in CONFIGS:
    cells = []
    for p, program in programs.items():
      if c in program.errors:
        cells.append(f"fails: {program.errors[c]}")
        continue
      ms, base = 1000 * np.median(times[p, c]), 1000 * np.median(times[p, next(iter(CONFIGS))])
      cells.append(f"{ms:.1f} ({ms / base:.2f}x)")
    print(f"| {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()

"""Where a decode step's time goes on XLA:CPU: per-op times from a profiler trace, by part; with
--verify, a verifying step's beside a plain decode step's.

  python scripts/profile_decode.py [--batches 16,64] [--quantization none|gguf|int8]
  python scripts/profile_decode.py --verify [--batches 1,16] [--context 320] [--steps 8] [-k 4]

Each batch's decode step (128 cached tokens per slot, as `python -m scripts.bench decode`) runs
under `jax.profiler.trace`; XLA:CPU then records one event per executed op (thunk), since this
script adds --xla_cpu_enable_xprof_traceme=true to XLA_FLAGS before jax loads. The events are
matched to the compiled HLO's instructions, whose metadata names the JAX operation and source
line they came from, and summed by part: matmuls by shape, attention, sampling, the rest.
The shares are of the summed op time (ops of one step run one after another here), so they
hold on a loaded machine even when the absolute times do not.

--verify: for each batch of slots (k = 4, n-gram speculation, greedy, `--context` cached
positions each), the plain step decodes every slot; the verifying step is what the peers and
copy workloads run (`python -m scripts.bench speculative`): up to max_prefill_seqs slots each
verify a chunk of k + 1 tokens (the slot's token and k proposals), the others decode. Each
step's wall time (median of `--steps` runs, each to its result on the host) and its op times
summed by part are printed side by side.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile

if "xla_cpu_enable_xprof_traceme" not in os.environ.get("XLA_FLAGS", ""):
  # XLA:CPU records ops only then; read when jax loads (the imports below).
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_enable_xprof_traceme=true").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.batching.plan import PrefillChunk, StepPlan  # noqa: E402
from jaxserve.config import Quantization, SamplingParams, SpeculativeConfig  # noqa: E402
from jaxserve.engine.engine import Engine  # noqa: E402
from jaxserve.loading import checkpoint  # noqa: E402

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # The root: scripts.bench.
from scripts.bench import harness  # noqa: E402
from scripts.bench.decode import decode_engine  # noqa: E402

KINDS = {"greedy": SamplingParams(temperature=0),
         "top-k-top-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
         "temperature": SamplingParams(temperature=1.0)}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) (\w[\w\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")


def op_parts(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> the part of the step it belongs to, for a compiled module's text.

  A fusion that holds a dot is a matmul (named by the dot's output shape); any other op is
  placed by the innermost jaxserve source file on its stack (HLO metadata's stack frames)."""
  files, locations, frames = {}, {}, {}
  section = None
  computations, current = collections.defaultdict(list), None
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = line
      continue
    m = re.match(r"^(\d+) (.*)$", line)
    if section and m:
      key, value = int(m.group(1)), m.group(2)
      if section == "FileNames":
        files[key] = value.strip('"')
      elif section == "FileLocations":
        f, ln = re.search(r"file_name_id=(\d+).*? line=(\d+)", value).groups()
        locations[key] = (int(f), int(ln))
      elif section == "StackFrames":
        loc, parent = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", value).groups()
        frames[key] = (int(loc), int(parent))
      continue
    section = None
    c = _COMPUTATION.match(line)
    if c:
      current = c.group(1)
    elif current:
      computations[current].append(line)

  def source(frame_id: int) -> str:
    seen = set()
    while frame_id in frames and frame_id not in seen:
      seen.add(frame_id)
      loc, parent = frames[frame_id]
      f, ln = locations[loc]
      if "jaxserve/" in files[f]:
        return f"{files[f].split('jaxserve/')[-1]}:{ln}"
      frame_id = parent
    return ""

  parts = {}
  for lines in computations.values():
    for line in lines:
      m = _INSTRUCTION.match(line)
      if not m:
        continue
      name, _, opcode = m.groups()
      if opcode in ("conditional", "while", "call"):
        continue  # Containers: their ops are counted one by one.
      called = re.search(r"calls=%?([\w.\-]+)", line)
      dots = [d for d in computations.get(called.group(1), ()) if " dot(" in d] if called else []
      if opcode == "dot" or dots:
        out = _INSTRUCTION.match(dots[0] if dots else line).group(2).split("{")[0]
        parts[name] = f"matmul -> {out}"
        continue
      if opcode == "custom-call" and 'custom_call_target="jaxserve_qmatmul"' in line:
        out = _INSTRUCTION.match(line).group(2).split("{")[0]
        parts[name] = f"kernels_cpu matmul -> {out}"
        continue
      frame = re.search(r"stack_frame_id=(\d+)", line)
      src = source(int(frame.group(1))) if frame else ""
      parts[name] = _part_of_source(src, opcode)
  return parts


def _part_of_source(src: str, opcode: str) -> str:
  for prefix, part in (("engine/sample.py", "sampling (sample.py)"),
                       ("engine/gumbel.py", "sampling (gumbel.py)"),
                       ("engine/verify.py", "verification (verify.py)"),
                       ("engine/step.py", "step.py: decode-state reads and writes, page lookup"),
                       ("model/attention.py", "attention (attention.py)"),
                       ("model/kv_cache.py", "KV page gather and write (kv_cache.py)"),
                       ("model/kv_layouts.py", "KV page gather and write (kv_layouts.py)"),
                       ("model/quant.py", "quantized matmuls and dequantization (quant.py)"),
                       ("model/quant_linear.py", "quantized matmuls and dequantization (quant.py)"),
                       ("model/llama.py", "other layer ops (llama.py: norms, rope, activations)")):
    if src.startswith(prefix):
      return part
  return "other (copy)" if opcode == "copy" else "other"


def start_slots(engine: Engine, tables: np.ndarray, context: int, sampling: SamplingParams) -> None:
  """Every slot of `tables` ready to decode at position `context` with `sampling`'s rows: a
  one-token prompt chunk per slot at position context - 1 that ends its prompt (so the step loads
  the request's sampling row and leaves the slot's position at context), at most
  EngineConfig.max_prefill_seqs chunks per step. Positions before it hold no real KV (zeros):
  what is timed is the work of reading them, not their values."""
  chunks = [PrefillChunk(f"r{slot}", slot, [100 + slot], context - 1, list(tables[slot]), True,
                         sampling, slot, (), ()) for slot in range(len(tables))]
  per_step = engine.config.max_prefill_seqs
  for at in range(0, len(chunks), per_step):
    engine.step(StepPlan(prefills=tuple(chunks[at:at + per_step]))).result()


def profile(engine: Engine, tables: np.ndarray, context: int, steps: int,
            sampling: SamplingParams) -> collections.Counter:
  start_slots(engine, tables, context, sampling)
  plan = StepPlan(decode_slots=tuple(range(len(tables))), page_tables=tables)
  engine.step(plan).result()
  return plan_op_times(engine, plan, steps)


def plan_op_times(engine: Engine, plan: StepPlan, steps: int) -> collections.Counter:
  """ms per step of each part (op_parts) of the program `plan` runs, over `steps` runs, traced."""
  args, _ = engine.step_args(plan)
  jitted = engine._steps[plan.kind]
  parts = op_parts(jitted.lower(engine.params, engine.cache, engine.state, args,
                                engine.stop_ids).compile().as_text())
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(steps):
        engine.step(plan).result()
    (path,) = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    with gzip.open(path) as f:
      events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  times = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("name") in parts:
      times[parts[e["name"]]] += e["dur"] / 1000 / steps  # ms per step
  return times


def plans(engine, tables: np.ndarray, context: int, k: int) -> dict[str, StepPlan]:
  """The plain step (every slot decodes) and the verifying one (the first max_prefill_seqs
  slots verify k proposals each, the rest decode). The verified chunks' first token and start
  are read from the slots' decode state, so the plan's are placeholders."""
  slots = list(range(len(tables)))
  verifying = slots[:engine.config.max_prefill_seqs]
  chunks = tuple(PrefillChunk(f"r{s}", s, [1] + [100 + i for i in range(k)], context,
                              list(tables[s]), True, KINDS["greedy"], s, (), (),
                              num_drafts=k)
                 for s in verifying)
  return {"decode": StepPlan(decode_slots=tuple(slots), page_tables=tables),
          "verify": StepPlan(prefills=chunks, decode_slots=tuple(slots[len(verifying):]),
                             page_tables=tables)}


def time_step(engine, plan: StepPlan, steps: int) -> float:
  """Median wall ms of one step, to its result on the host (the untimed first call compiles)."""
  return 1000 * statistics.median(harness.timed(lambda: engine.step(plan).result(), steps))


def verify(model, args) -> None:
  spec = SpeculativeConfig(num_speculative_tokens=args.k)
  for batch in (int(b) for b in args.batches.split(",")):
    # Each verifying step moves its slots up to k + 1 positions: room for all of them.
    engine, tables = decode_engine(model, batch, args.context + 3 * args.steps * (args.k + 2),
                                   speculative=spec)
    start_slots(engine, tables, args.context, KINDS["greedy"])
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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default=None)
  parser.add_argument("--verify", action="store_true",
                      help="a verifying step (n-gram speculation) beside a plain decode step")
  parser.add_argument("--batches", help="default: 16,64; with --verify 1,16")
  parser.add_argument("--context", type=int, help="default: 128; with --verify 320")
  parser.add_argument("--steps", type=int, help="default: 5; with --verify 8")
  parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens (--verify)")
  parser.add_argument("--quantization", choices=("none", "gguf", "int8"), default="none",
                      help="how the weights are stored (gguf and int8 run kernels_cpu's matmul "
                      "when it is built)")
  parser.add_argument("--sampling", choices=sorted(KINDS), default="greedy",
                      help="every slot's sampling (--verify: greedy only)")
  args = parser.parse_args()
  if args.batches is None:
    args.batches = "1,16" if args.verify else "16,64"
  if args.context is None:
    args.context = 320 if args.verify else 128
  if args.steps is None:
    args.steps = 8 if args.verify else 5
  if args.context < 1:
    parser.error("--context must be at least 1 (the prompt chunk that loads the sampling rows)")
  if args.verify and args.sampling != "greedy":
    parser.error("--verify runs greedy rows only")
  model, _ = checkpoint.load_model(args.model, quantization=Quantization(args.quantization))
  if args.verify:
    verify(model, args)
    return
  for batch in (int(b) for b in args.batches.split(",")):
    # The prompt's `context` positions and the 1 + steps decoded after.
    engine, tables = decode_engine(model, batch, args.context + args.steps + 1)
    times = profile(engine, tables, args.context, args.steps, KINDS[args.sampling])
    total = sum(times.values())
    print(f"\nbatch {batch}, {args.sampling} rows: {total:.1f} ms of ops per step, load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| part | ms/step | share |\n|---|---|---|")
    for name, ms in times.most_common():
      print(f"| {name} | {ms:.2f} | {ms / total:.1%} |")


if __name__ == "__main__":
  main()

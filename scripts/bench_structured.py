"""Constrained decoding's cost: 64 requests with half of them JSON-schema constrained vs none,
grammar compile time per schema, and the host time per step spent filling masks.

  python scripts/bench_structured.py                 # the default model, 16 slots, 64 requests
  python scripts/bench_structured.py --requests 16   # quicker

Both workloads run on one engine, one after the other, with the same prompts and seeds; the
constrained half decodes every other step (batching/constrained.py), so its requests take about
twice the steps, while the free half keeps the overlap. Prints a markdown table and, with --json,
the numbers. Wall times on a machine shared with other work are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jaxserve
from jaxserve import Constraint, EngineConfig, SamplingParams
from jaxserve.text.constraint import ConstraintCompiler

SCHEMAS = {
    "flat": {"type": "object",
             "properties": {"name": {"type": "string", "maxLength": 16},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "role": {"enum": ["admin", "user", "guest"]},
        "home": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "pos": {"type": "object", "properties": {
                "x": {"type": "integer", "minimum": -9, "maximum": 9},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
                "required": ["x", "tags"]}}, "required": ["city", "pos"]},
        "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
        "required": ["id", "role", "home", "scores"]},
}


def compile_times(tokenizer, repeats: int = 5) -> dict[str, float]:
  """Milliseconds per compile of each schema, cache off (a fresh compiler holds none)."""
  out = {}
  for name, schema in SCHEMAS.items():
    times = []
    for _ in range(repeats):
      compiler = ConstraintCompiler(tokenizer, max_grammars=0)
      start = time.perf_counter()
      compiler.compile(Constraint.json_schema(schema))
      times.append(time.perf_counter() - start)
    out[name] = 1000 * statistics.median(times)
  return out


def run(llm, prompts, params) -> dict[str, float]:
  runner = llm.runner
  constraints, steps0 = runner.constraints, runner.scheduler.num_steps
  masks0, mask_s0 = constraints.num_masks, constraints.mask_seconds
  start = time.perf_counter()
  outs = llm.generate(prompts, params, chat=True)
  wall = time.perf_counter() - start
  tokens = sum(len(o.token_ids) for o in outs)
  steps = runner.scheduler.num_steps - steps0
  mask_s = constraints.mask_seconds - mask_s0
  return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": steps,
          "mask_rows": constraints.num_masks - masks0, "mask_ms_per_step": 1000 * mask_s / steps,
          "ms_per_step": 1000 * wall / steps}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--max-tokens", type=int, default=64)
  p.add_argument("--json", action="store_true")
  args = p.parse_args(argv)
  llm = jaxserve.LLM(engine_config=EngineConfig(num_slots=args.slots, max_model_len=512,
                                                prefill_buckets=(64, 128)))
  prompts = [f"Describe user number {i} of a website as JSON." for i in range(args.requests)]
  free = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens)
          for i in range(args.requests)]
  constraint = Constraint.json_schema(SCHEMAS["nested"])
  half = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens,
                         constraint=constraint if i % 2 else None) for i in range(args.requests)]
  # Warms the grammar cache and the llguidance tokenizer.
  llm.generate(prompts[:2], half[:2], chat=True)
  result = {"none": run(llm, prompts, free), "half": run(llm, prompts, half),
            "compile_ms": compile_times(llm.tokenizer)}
  result["half_over_none_tokens_per_s"] = (result["half"]["tokens_per_s"]
                                           / result["none"]["tokens_per_s"])
  if args.json:
    print(json.dumps(result, indent=2))
  print("| workload | tokens | steps | wall s | tokens/s | ms/step | mask rows | mask ms/step |")
  print("|---|---|---|---|---|---|---|---|")
  for name in ("none", "half"):
    r = result[name]
    print(f"| {name} constrained | {r['tokens']} | {r['steps']} | {r['wall_s']:.1f} | "
          f"{r['tokens_per_s']:.1f} | {r['ms_per_step']:.1f} | {r['mask_rows']} | "
          f"{r['mask_ms_per_step']:.2f} |")
  print(f"\nhalf / none tokens/s: {result['half_over_none_tokens_per_s']:.2f}")
  print("compile ms per schema (cache off): " +
        ", ".join(f"{k} {v:.2f}" for k, v in result["compile_ms"].items()))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

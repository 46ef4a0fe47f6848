"""`python -m scripts.bench speculative`: speculative decoding (n-gram or a draft model) against
none, each side in a fresh process, interleaved rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import statistics
import time

from . import harness

COPY_PROMPTS = [
    "Rename the function `area` to `rect_area` everywhere in this code and give back the whole "
    "code, nothing else:\n```python\ndef area(width, height):\n    \"\"\"The area of a "
    "rectangle.\"\"\"\n    return width * height\n\n\ndef total_area(rects):\n    return "
    "sum(area(w, h) for w, h in rects)\n\n\nif __name__ == \"__main__\":\n    "
    "print(total_area([(1, 2), (3, 4)]))\n```",
    "Repeat this list exactly, one item a line, but with 'pears' changed to 'plums':\napples\n"
    "bananas\ncherries\ndates\nelderberries\nfigs\ngrapes\npears\nquinces\nraspberries\n"
    "strawberries\ntangerines",
    "Extract the fields name, email, city and order number from this message as JSON with those "
    "four keys:\n\nHello, my name is Maria Gonzalez and I ordered a blue kettle last week (order "
    "number 48213-KX). It arrived broken. I live in Valencia; you can reach me at "
    "maria.gonzalez@example.com. Thanks!",
    "Copy this paragraph, correcting only the spelling mistakes:\nThe quick brown fox jumpd over "
    "the lazy dog. Every morning the fox runs thru the forest, looking for somthing to eat, and "
    "every evening it returns to its den beside the old oak tree.",
]

# Short asks whose answers copy their prompt: a list, code with a function renamed, a sentence
# repeated (issue 46: where k = 4 ran at 0.94x the tokens/s without speculation, float mode).
ASK_PROMPTS = [
    "Repeat this list exactly, one item a line:\nParis\nLondon\nMadrid\nRome\nBerlin\nVienna\n"
    "Prague\nWarsaw\nLisbon\nDublin\nOslo\nStockholm\nHelsinki\nAthens\nBudapest\nBrussels",
    "Rename the function `mean` to `average` everywhere in this code and give back the whole "
    "code, nothing else:\n```python\ndef mean(values):\n    \"\"\"The arithmetic mean of a list "
    "of numbers.\"\"\"\n    return sum(values) / len(values)\n\n\ndef variance(values):\n    m = "
    "mean(values)\n    return mean([(v - m) ** 2 for v in values])\n\n\nif __name__ == "
    "\"__main__\":\n    print(mean([1, 2, 3]), variance([1, 2, 3]))\n```",
    "Repeat this sentence five times, one a line: The committee will meet on Tuesday at noon in "
    "the main hall to review the budget.",
]


def child(args: argparse.Namespace) -> dict:
  """One side of one workload, in this process: its tokens/s and speculation counts."""
  import jaxserve
  from jaxserve.config import EngineConfig, SamplingParams, SpeculativeConfig

  spec = SpeculativeConfig.from_json(args.speculative_config) if args.on else None
  copy = args.workload in ("copy", "asks")  # Single streams.
  cfg = EngineConfig(num_slots=1 if copy else args.slots, page_size=16,
                     max_model_len=args.max_model_len, num_pages=args.num_pages,
                     prefill_buckets=args.buckets, speculative=spec,
                     cpu_activations=args.cpu_activations)
  llm = jaxserve.LLM(engine_config=cfg)
  llm.engine.warmup()
  if copy:
    prompts = COPY_PROMPTS if args.workload == "copy" else ASK_PROMPTS
    prompts = prompts[:2] if args.quick else prompts
    sampling = SamplingParams(temperature=0, max_tokens=48 if args.quick else 256)
    start, outs, walls = time.perf_counter(), [], []
    for p in prompts:  # One at a time.
      outs.append(llm.generate([p], sampling, chat=True)[0])
      walls.append(time.perf_counter() - start - sum(walls))
  else:
    work = [json.loads(line) for line in harness.WORKLOAD.read_text().splitlines()
            if line.strip()]
    work = work[:8] if args.quick else work
    params = [SamplingParams(temperature=0, ignore_eos=True,
                             max_tokens=min(w["max_tokens"], 32) if args.quick else w["max_tokens"])
              for w in work]
    start, walls = time.perf_counter(), []
    outs = llm.runner.generate([(w["prompt_token_ids"], p) for w, p in zip(work, params)])
  wall = time.perf_counter() - start
  stats = llm.runner.scheduler.spec_stats
  ids = [list(o.token_ids) for o in outs]
  return {"workload": args.workload, "speculative": args.on, "wall_s": wall,
          "tokens": sum(map(len, ids)), "tokens_per_s": sum(map(len, ids)) / wall,
          "digest": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
          "verified_runs": stats.num_drafts, "draft_tokens": stats.num_draft_tokens,
          "accepted_tokens": stats.num_accepted_tokens,
          "acceptance_rate": stats.acceptance_rate, "accepted_per_pos": stats.accepted_per_pos,
          "steps": llm.runner.scheduler.num_steps,
          # A single stream's prompts one by one: (tokens, tokens/s).
          "per_prompt": [(len(i), len(i) / w) for i, w in zip(ids, walls)]}


def run_child(args: argparse.Namespace, workload: str, on: bool) -> dict:
  return harness.fresh("speculative", [
      "--child", "--workload", workload, "--speculative-config", args.speculative_config,
      "--slots", str(args.slots), "--max-model-len", str(args.max_model_len),
      "--num-pages", str(args.num_pages), "--buckets", ",".join(map(str, args.buckets)),
      "--cpu-activations", args.cpu_activations]
      + ["--on"] * on + ["--quick"] * args.quick)


def report(pairs: list[tuple[dict, dict]]) -> str:
  """One workload's rounds of (off, on): each round's tokens/s, the median ratio, and the
  outputs and counts (the same every round: greedy)."""
  ratios = [on["tokens_per_s"] / off["tokens_per_s"] for off, on in pairs]
  rounds = ", ".join(f"{off['tokens_per_s']:.1f} -> {on['tokens_per_s']:.1f} ({r:.2f}x)"
                     for (off, on), r in zip(pairs, ratios))
  off, on = pairs[0]
  per_prompt = ", ".join(
      f"{n} tokens {statistics.median(b[1] / a[1] for a, b in prompt):.2f}x"
      for n, prompt in ((p[0][0][0], p) for p in zip(*[zip(f["per_prompt"], o["per_prompt"])
                                                        for f, o in pairs])))
  identical = all(o["digest"] == off["digest"] for pair in pairs for o in pair)
  return (f"{on['workload']}: median {statistics.median(ratios):.2f}x over {len(pairs)} rounds "
          f"[{rounds}], identical output: {identical}, acceptance "
          f"{on['acceptance_rate']:.2f} ({on['accepted_tokens']}/{on['draft_tokens']}, per "
          f"position {on['accepted_per_pos']}), steps {off['steps']} -> {on['steps']} "
          f"({on['verified_runs']} verifying)"
          + (f"; each prompt's median: {per_prompt}" if per_prompt else ""))


def main_speculative(argv=None) -> int:
  """Speculative decoding (n-gram prompt lookup, or a draft model) against none, each side in a
  fresh process.

    python -m scripts.bench speculative                     # copy and peers, k = 6, 3 rounds
    python -m scripts.bench speculative --quick --rounds 1  # a few short requests: proves it runs
    python -m scripts.bench speculative --workloads copy \\
        --speculative-config '{"num_speculative_tokens": 4}'
    python -m scripts.bench speculative --draft smollm2-135m-instruct   # the draft-model method

  Three workloads, all greedy on the default model:
  - copy: single stream, one request at a time, prompts whose answers copy spans of them (edit
    this code, repeat this list with one change, extract these fields), chat template applied.
    Speculation should pay here: issue 25's target is 2x the tokens/s, with identical output.
  - asks: the same single stream over short asks whose answers copy their prompt (copy a
    list, rename a function in code, repeat a sentence). Speculation must never be slower: a
    request pauses its proposals while they do not pay (batching/acceptance.py).
  - peers: the 64-request workload of `peers` (scripts/workloads/peers_64.jsonl: word-list
    prompts, outputs that do not copy them, end-of-sequence ignored), all submitted at once to 16
    slots. Speculation should cost little here: the target is at least 0.95x.

  Each (workload, on/off) runs in its own process (model loading and warm-up not timed), in
  `--rounds` interleaved rounds (off then on, then on then off, ...: the machine drifts between
  processes by more than the 0.95x threshold, so one pair is not a reading); the report gives
  each round's tokens/s and ratio, the median ratio, whether the outputs are identical, and the
  acceptance rate (accepted proposals over proposed ones) with the accepted count at each
  proposal position.
  """
  p = harness.parser("speculative", main_speculative.__doc__)
  p.add_argument("--workloads", default="copy,peers", help="comma-separated: copy, asks, peers")
  # k = 6: on CPU it beat 4 on the copy stream (2.17x against 1.87x, BENCHMARKS.md).
  p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 6}')
  p.add_argument("--rounds", type=int, default=3,
                 help="interleaved (off, on) rounds a workload; the ratio reported is their median")
  p.add_argument("--slots", type=int, default=16, help="the peers workload's slots")
  p.add_argument("--max-model-len", type=int, default=1024)
  p.add_argument("--num-pages", type=int, default=16 * 512 // 16 + 1)
  p.add_argument("--buckets", type=lambda s: tuple(int(b) for b in s.split(",")),
                 default=(64, 128, 256))
  p.add_argument("--draft", default=None, metavar="MODEL",
                 help="the draft-model method with MODEL (a name or path) as the draft, k from "
                 "--speculative-config (the default model as its own draft accepts everything: "
                 "it shows the method's overhead, not a speed-up)")
  p.add_argument("--cpu-activations", choices=("float", "int8"), default="float",
                 help="EngineConfig.cpu_activations, both sides (int8: the outputs identical "
                 "within the mode)")
  p.add_argument("--quick", action="store_true",
                 help="a few short requests, one prefill bucket (64), max_model_len 512")
  p.add_argument("--json", type=pathlib.Path, default=None, help="write the runs here")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--workload", default="copy", help=argparse.SUPPRESS)
  p.add_argument("--on", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.quick and not args.child:  # One prefill bucket: a few programs to compile per process.
    args.buckets, args.max_model_len = (64,), 512
  if args.draft and not args.child:
    k = json.loads(args.speculative_config).get("num_speculative_tokens", 4)
    args.speculative_config = json.dumps({"method": "draft", "draft_model": args.draft,
                                          "num_speculative_tokens": k})
  if args.child:
    print(json.dumps(child(args)))
    return 0
  runs = []
  for workload in args.workloads.split(","):
    # Off first in even rounds, on first in odd ones.
    sides = harness.interleaved(("off", "on"), args.rounds,
                                lambda side: run_child(args, workload, side == "on"),
                                reverse_odd=True)
    pairs = list(zip(sides["off"], sides["on"]))
    runs += [run for pair in pairs for run in pair]
    print(report(pairs), flush=True)
  if args.json:
    args.json.write_text(json.dumps(runs, indent=1))
  return 0


COMMANDS = {"speculative": main_speculative}

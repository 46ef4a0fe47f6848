"""Batch invariance on a real model: does a request's output depend on what else runs with it?

Every prompt runs first alone (one request in the engine, prefix caching off, its prompt prefilled
in one chunk): its tokens there are the reference. Then all prompts run again under each condition,
and each request's tokens are compared with its reference:

  batch       all prompts at once, greedy and seeded requests mixed, plus filler requests, so that
              the slots are full and requests join and leave around each other
  prefix      prefix caching on, after warm-up requests that share each prompt's first pages: the
              prompts' prefills read cached KV and compute only their suffix
  chunked     prefill in chunks of --chunk tokens (chunked prefill under a small token budget)
  preempted   a KV pool too small for the batch: requests are preempted and recomputed

Half the prompts are greedy, half sample (temperature 0.8, top-p 0.95) with a seed of their own.
Prints, per condition, the requests whose tokens are identical, the token agreement and where the
first divergences happen; `--json` writes it all. Exit status 1 if any request diverged.

  python scripts/check_determinism.py                        # SmolLM2, 32 prompts
  python scripts/check_determinism.py --prompts 8 --max-tokens 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence

from jaxserve.batching.runner import Runner
from jaxserve.config import EngineConfig, SamplingParams, SchedulerConfig
from jaxserve.engine.engine import Engine
from jaxserve.loading import checkpoint

CONDITIONS = ("batch", "prefix", "chunked", "preempted")
_TOPICS = ["the sea", "a lighthouse keeper", "prime numbers", "bread", "a lost key", "winter",
           "the moon", "a small robot", "trains", "honey bees", "a library", "the desert",
           "chess", "rain in the city", "an old map", "volcanoes"]
_SYSTEM = "You are a careful assistant. Answer in two or three plain sentences without lists."


@dataclasses.dataclass(frozen=True)
class Case:
  prompt_ids: tuple[int, ...]
  sampling: SamplingParams


def cases(tokenizer, num: int, max_tokens: int) -> list[Case]:
  """Chat prompts sharing a system prompt (a common prefix); odd ones sample with a seed."""
  out = []
  for i in range(num):
    topic = _TOPICS[i % len(_TOPICS)]
    text = tokenizer.apply_chat_template([
        {"role": "system", "content": _SYSTEM},
        {"role": "user", "content": f"Question {i}: tell me something true about {topic}."}])
    greedy = i % 2 == 0
    sampling = SamplingParams(temperature=0.0 if greedy else 0.8, top_p=1.0 if greedy else 0.95,
                              seed=None if greedy else 1000 + i, max_tokens=max_tokens,
                              ignore_eos=True)
    out.append(Case(tuple(tokenizer.encode(text, add_bos=False)), sampling))
  return out


def filler(case: Case, i: int) -> tuple[Sequence[int], SamplingParams]:
  """Another request to share the batch with: a different prompt tail and length, unseeded."""
  ids = list(case.prompt_ids[:-2]) + [case.prompt_ids[-1]] * (1 + i % 5)
  return ids, SamplingParams(temperature=1.0, max_tokens=4 + 7 * (i % 4), ignore_eos=True)


def run(engine: Engine, tokenizer, config: SchedulerConfig, batch: list, tagged: int) -> list:
  """Runs `batch` (its first `tagged` entries are the cases) in one runner; their token ids."""
  runner = Runner(engine, tokenizer, config)
  done = runner.generate(batch)
  runner_state = runner.scheduler
  assert runner_state.pages.num_free_pages == runner_state.pages.num_usable_pages
  return [(list(c.token_ids), c.num_cached_tokens) for c in done[:tagged]], runner_state


def compare(reference: list[list[int]], got: list[list[int]]) -> dict:
  first = [next((j for j, (a, b) in enumerate(zip(r, g)) if a != b), None)
           for r, g in zip(reference, got)]
  agree = sum(a == b for r, g in zip(reference, got) for a, b in zip(r, g))
  return {"requests": len(reference), "identical": sum(f is None for f in first),
          "token_agreement": agree / max(1, sum(map(len, reference))),
          "first_divergence": [f for f in first if f is not None]}


def check(model, tokenizer, engine_config: EngineConfig, num_prompts: int, max_tokens: int,
          chunk: int, small_pool: int) -> dict:
  """The report: per condition, how the cases compare with their runs alone."""
  engine = Engine(model, engine_config, stop_ids=tokenizer.stop_ids)
  engine.warmup()
  all_cases = cases(tokenizer, num_prompts, max_tokens)
  plain = SchedulerConfig(enable_prefix_caching=False)
  as_pairs = [(c.prompt_ids, c.sampling) for c in all_cases]
  alone = [run(engine, tokenizer, plain, [pair], 1)[0][0][0] for pair in as_pairs]
  fillers = [filler(c, i) for i, c in enumerate(all_cases)]
  report = {"prompts": num_prompts, "max_tokens": max_tokens, "conditions": {}}

  def record(name, got, extra):
    report["conditions"][name] = dict(compare(alone, [g for g, _ in got]), **extra)

  got, sched = run(engine, tokenizer, plain, as_pairs + fillers, num_prompts)
  record("batch", got, {"concurrent": 2 * num_prompts, "slots": engine.num_slots})
  warm = [(c.prompt_ids[:-4], SamplingParams(max_tokens=1)) for c in all_cases]
  runner = Runner(engine, tokenizer, SchedulerConfig(enable_prefix_caching=True))
  runner.generate(warm)
  got = [(list(c.token_ids), c.num_cached_tokens) for c in runner.generate(as_pairs)]
  record("prefix", got, {"cached_prompt_tokens": sum(n for _, n in got)})
  got, sched = run(engine, tokenizer, dataclasses.replace(plain, max_num_batched_tokens=chunk),
                   as_pairs + fillers, num_prompts)
  record("chunked", got, {"chunk_tokens": chunk})
  small = Engine(model, dataclasses.replace(engine_config, num_pages=small_pool),
                 stop_ids=tokenizer.stop_ids)
  small.warmup()
  got, sched = run(small, tokenizer, plain, as_pairs, num_prompts)
  record("preempted", got, {"num_pages": small_pool, "preemptions": sched.num_preemptions})
  return report


def format_report(report: dict) -> str:
  lines = [f"{report['prompts']} prompts x {report['max_tokens']} tokens, each compared with "
           "its run alone", "| condition | identical requests | token agreement | first divergence "
           "at | notes |", "|---|---|---|---|---|"]
  for name, c in report["conditions"].items():
    notes = ", ".join(f"{k} {v}" for k, v in c.items()
                      if k not in ("requests", "identical", "token_agreement", "first_divergence"))
    lines.append(f"| {name} | {c['identical']}/{c['requests']} | {c['token_agreement']:.2%} | "
                 f"{sorted(c['first_divergence']) or '-'} | {notes} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M-Instruct")
  p.add_argument("--prompts", type=int, default=32)
  p.add_argument("--max-tokens", type=int, default=32)
  p.add_argument("--slots", type=int, default=8)
  p.add_argument("--chunk", type=int, default=16, help="prefill chunk in the chunked condition")
  p.add_argument("--small-pool", type=int, default=48, help="KV pages in the preempted condition")
  p.add_argument("--json", default=None, help="write the report here too")
  args = p.parse_args(argv)
  model, tokenizer = checkpoint.load_model(args.model)
  config = EngineConfig(num_slots=args.slots, num_pages=1024, max_model_len=512,
                        prefill_buckets=(16, 32, 64, 128))
  report = check(model, tokenizer, config, args.prompts, args.max_tokens, args.chunk,
                 args.small_pool)
  print(format_report(report))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  diverged = any(c["identical"] < c["requests"] for c in report["conditions"].values())
  return 1 if diverged else 0


if __name__ == "__main__":
  sys.exit(main())

"""Replays greedy outputs through n-gram speculation's step rules, without the model: how many
steps a single stream takes, and its tokens/s ratio for a given verifying-step cost.

  python scripts/replay_ngram.py --dump copy.json          # the copy workload's tokens (runs it)
  python scripts/replay_ngram.py copy.json --k 3,4,6 --cost 1.42

Greedy outputs do not depend on speculation, so one run's tokens replay every setting. Each step
is planned while the one before is in flight, as the scheduler does (batching/speculative.py):
it proposes from the landed tokens plus a guess of the sample in flight (that run's proposals
when its own guess held, then one looked-up token), and a run accepts its proposals up to the
first that differs from the true tokens. A decode step costs 1, a verifying step `--cost`
(profile_verify.py measures it); the ratio is tokens over cost, against one token per step. A
model of the scheduler, not the scheduler: it counts prompts as one step and ignores max_tokens'
reservations (at k = 4 the real copy run took 272 steps where this counts 256: 252 and
its 4 prompts).
"""

from __future__ import annotations

import argparse
import json
import pathlib

from jaxserve.batching.speculative import propose_ngram
from jaxserve.config import SpeculativeConfig


def replay(prompt: list[int], out: list[int], spec: SpeculativeConfig) -> tuple[int, int]:
  """(decode steps, verifying steps) of one request, its prompt's step not counted."""
  seq, landed = prompt + out, len(prompt)
  flight = None  # The sample in flight: None (a decode or the prompt) or (drafts, guess held).
  decodes = verifies = 0
  while landed < len(seq):
    assumed = list(flight[0]) if flight and flight[1] else []
    guess = propose_ngram(seq[:landed] + assumed, spec, spec.num_speculative_tokens, 1)
    plan = (tuple(guess[1:]), assumed + guess[:1]) if len(guess) > 1 else None
    got = 1  # The sample in flight lands.
    if flight:
      while got <= len(flight[0]) and landed + got - 1 < len(seq) and \
          flight[0][got - 1] == seq[landed + got - 1]:
        got += 1
    came = seq[landed:landed + got]
    landed += got
    if landed >= len(seq):
      break
    flight = None if plan is None else (plan[0], came == plan[1])
    decodes, verifies = decodes + (plan is None), verifies + (plan is not None)
  return decodes, verifies


def dump(path: pathlib.Path) -> None:
  """Runs bench_speculative's copy prompts greedily (no speculation) and writes their tokens."""
  import bench_speculative

  import jaxserve
  from jaxserve.config import EngineConfig, SamplingParams
  llm = jaxserve.LLM(engine_config=EngineConfig(num_slots=1, max_model_len=1024,
                                                prefill_buckets=(64, 128, 256)))
  sampling = SamplingParams(temperature=0, max_tokens=256)
  outs = [llm.generate([p], sampling, chat=True)[0] for p in bench_speculative.COPY_PROMPTS]
  path.write_text(json.dumps([{"prompt": list(o.prompt_token_ids), "out": list(o.token_ids)}
                              for o in outs]))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("tokens", type=pathlib.Path, nargs="?", help="a --dump file")
  p.add_argument("--dump", type=pathlib.Path, help="write the copy workload's tokens here")
  p.add_argument("--k", default="4", help="comma-separated num_speculative_tokens")
  p.add_argument("--lookup", default="2-4", help="prompt_lookup_min-prompt_lookup_max")
  p.add_argument("--cost", type=float, default=1.42, help="a verifying step / a decode step")
  args = p.parse_args(argv)
  if args.dump:
    return dump(args.dump)
  runs = json.loads(args.tokens.read_text())
  lo, hi = map(int, args.lookup.split("-"))
  for k in map(int, args.k.split(",")):
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)
    steps = [replay(r["prompt"], r["out"], spec) for r in runs]
    decodes, verifies = sum(d for d, _ in steps), sum(v for _, v in steps)
    tokens = sum(len(r["out"]) for r in runs)
    ratio = tokens / (decodes + args.cost * verifies)
    print(f"k {k}, lookup {lo}-{hi}: {decodes} decode + {verifies} verifying steps for {tokens} "
          f"tokens; at {args.cost}x a verifying step: {ratio:.2f}x")


if __name__ == "__main__":
  main()

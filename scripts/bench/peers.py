"""The same work, side by side, in one run: jaxserve vs Hugging Face transformers and llama.cpp.

  python -m scripts.bench peers                      # jaxserve and transformers
  python -m scripts.bench peers --install-llama-cpp  # also llama.cpp (compiles it on first use)
  python -m scripts.bench peers --quick --systems jaxserve   # a few short requests, for tests
  python -m scripts.bench peers --single-stream --systems jaxserve,llama.cpp --fresh --rounds 3
      [--quantization gguf]   # one chat prompt, 128 greedy tokens; each system a fresh process

The workload (scripts/workloads/peers_64.jsonl, made by `make_workload`, rewritten by
`--write-workload`) is 64 requests whose prompts are token ids (16-256 of them, text drawn from a
word list with a seed and cut to length) and whose max_tokens are 16-256. Every system runs the
same ids, greedily, with end-of-sequence ignored, so each generates exactly sum(max_tokens) tokens:
- jaxserve: the offline API (continuous batching), `LLM.generate` over all 64 at once.
- transformers: `generate` in float32 on the weights of the same GGUF, static batches of 16 in
  workload order, left padded. A batch runs to its longest budget (min_new_tokens = max_new_tokens
  so EOS never ends it); each request is credited only its own max_tokens, so the extra tokens a
  static batch computes count as its cost, not its output ("decoded" in the JSON).
- llama.cpp (llama-cpp-python, same GGUF file, 2 threads), two ways: one request at a time
  (`Llama.generate`), and continuous batching of 16 sequences in one context through its low-level
  batch API (a prompt is prefilled alone when its sequence is admitted, then all running
  sequences decode one token per `llama_decode`), the way its server runs parallel slots.
Installed only with --install-llama-cpp; a system that cannot run is reported as skipped, with why.

Timed: from the first request's submission to the last token, model loading and warm-up excluded.
Time to first token counts from that start, since every request arrives at once. Throughput is
generated tokens (the workload's, the same for all) over wall time; prompt tokens/s likewise.
With `--rounds N` the systems run interleaved N times and the median round is reported, so a
load spike from other processes on the machine hits them alike; the load average is recorded.
`--fresh` runs each system of each round in its own new process (two engines in one process
disturb each other's thread pools). `--single-stream` replaces the workload with one request:
the chat-templated "What is a mortgage rate?" and 128 greedy tokens (what `jaxserve generate`
does first for a new user). `--quantization` is jaxserve's (`auto`: the `LLM()` default).
`--llama-cpp-repack auto` (the default) loads llama.cpp once in a throwaway process first and
turns its weight repacking off where that load crashes (peers_systems.py); the report says which
way it ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import random
import statistics
import sys
from typing import Any, Sequence

from . import harness
from .peers_systems import NO_REPACK, REPACK, Run, install_llama_cpp, load_systems, repack_mode

WORKLOAD = harness.WORKLOAD
WORDS = ("the a of and to in is that it for on with as was at by from this be are or have not but "
         "an they which one you all were her she there would their we him been has when who will "
         "more no if out so said what up its about into than them can only other new some could "
         "time these two may then do first any my now such like our over man me even most made "
         "after also did many before must through back years where much your way well down should "
         "because each just those people how too little state good very make world still own see "
         "men work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three river "
         "garden engine paper winter music number").split()
SYSTEMS = ("jaxserve", "transformers", "llama.cpp", "llama.cpp-parallel")


def make_workload(tokenizer: Any, seed: int = 0, num_requests: int = 64,
                  prompt_lens: tuple[int, int] = (16, 256),
                  max_tokens: tuple[int, int] = (16, 256)) -> list[dict]:
  """Requests as generate_batch.py lines: word-list text encoded and cut to a drawn length."""
  rng = random.Random(seed)
  work = []
  for i in range(num_requests):
    n = rng.randint(*prompt_lens)
    words = [rng.choice(WORDS) for _ in range(n)]  # At least one token per word: n ids or more.
    ids = tokenizer.encode(" ".join(words).capitalize() + ".", add_bos=False)[:n]
    work.append({"id": f"peer-{i:02d}", "prompt_token_ids": ids,
                 "max_tokens": rng.randint(*max_tokens), "ignore_eos": True, "temperature": 0})
  return work


def single_stream(tokenizer: Any, max_tokens: int = 128) -> list[dict]:
  """One chat request, as a new user's first `jaxserve generate`."""
  text = tokenizer.apply_chat_template([{"role": "user", "content": "What is a mortgage rate?"}])
  return [{"id": "single", "prompt_token_ids": tokenizer.encode(text, add_bos=False),
           "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}]


def read_workload(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_workload(path: pathlib.Path, work: Sequence[dict]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r) + "\n" for r in work))


def agreement(run: Run, reference: Run) -> float:
  """Mean fraction of each request's tokens, from the start, identical to the reference's."""
  def prefix(a, b):
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
  return statistics.fmean(prefix(a, b) / len(b) for a, b in zip(run.outputs, reference.outputs))


def summarize(runs: dict[str, list[Run]], skipped: dict[str, str]) -> dict:
  """Per system the median-wall run of the rounds, with ratios against jaxserve's."""
  report = {"systems": {}, "skipped": skipped}
  medians = {name: harness.median_item(rs, key=lambda r: r.wall_s) for name, rs in runs.items()}
  ours = medians.get("jaxserve")
  for name, r in medians.items():
    row = {k: v for k, v in dataclasses.asdict(r).items() if k != "outputs"}
    row.update(generated_tokens_per_s=r.generated_tokens_per_s,
               prompt_tokens_per_s=r.prompt_tokens_per_s,
               rounds_wall_s=[x.wall_s for x in runs[name]])
    if ours is not None and name != "jaxserve":
      row.update(jaxserve_speedup=r.wall_s / ours.wall_s,
                 jaxserve_ttft_ratio=ours.mean_ttft_s / r.mean_ttft_s,
                 token_agreement_with_jaxserve=agreement(r, ours))
    report["systems"][name] = row
  return report


def markdown(report: dict) -> str:
  lines = ["| system | wall s | generated tok/s | prompt tok/s | mean TTFT s | jaxserve speedup "
           "(peer wall / jaxserve wall) | jaxserve TTFT / peer TTFT | tokens equal to jaxserve's |",
           "|---|---|---|---|---|---|---|---|"]
  for name, r in report["systems"].items():
    extra = ("—", "—", "—") if name == "jaxserve" else (
        f"{r['jaxserve_speedup']:.2f}x", f"{r['jaxserve_ttft_ratio']:.2f}",
        f"{r['token_agreement_with_jaxserve']:.0%}") if "jaxserve_speedup" in r else ("n/a",) * 3
    lines.append(f"| {name} | {r['wall_s']:.1f} | {r['generated_tokens_per_s']:.1f} | "
                 f"{r['prompt_tokens_per_s']:.1f} | {r['mean_ttft_s']:.2f} | "
                 + " | ".join(extra) + " |")
  lines += [f"| {name} | skipped: {why} | | | | | | |" for name, why in report["skipped"].items()]
  if "llama.cpp weights" in report:
    lines += ["", f"llama.cpp weights: {report['llama.cpp weights']}"]
  return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
  p = harness.parser("peers", __doc__)
  p.add_argument("--systems", default="jaxserve,transformers,llama.cpp,llama.cpp-parallel",
                 help=f"comma-separated, from {', '.join(SYSTEMS)}")
  p.add_argument("--workload", type=pathlib.Path, default=WORKLOAD)
  p.add_argument("--write-workload", action="store_true",
                 help="regenerate --workload from --seed, then exit")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--quick", action="store_true",
                 help="4 short requests made on the fly (for tests)")
  p.add_argument("--rounds", type=int, default=1,
                 help="interleaved passes; the median is reported")
  p.add_argument("--jaxserve-model", default=None,
                 help="jaxserve's model (default: the default model, like the peers); "
                 "for tests only")
  p.add_argument("--slots", type=int, default=16,
                 help="jaxserve's slots and llama.cpp's parallel sequences")
  p.add_argument("--buckets", type=lambda s: tuple(int(b) for b in s.split(",")),
                 default=(64, 128, 256))
  p.add_argument("--max-model-len", type=int, default=1024)
  p.add_argument("--num-pages", type=int, default=16 * 512 // 16 + 1,
                 help="16 x 512 tokens, + scratch")
  p.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
  p.add_argument("--hf-batch", type=int, default=16, help="transformers' static batch size")
  p.add_argument("--install-llama-cpp", action="store_true",
                 help="pip install llama-cpp-python if missing")
  p.add_argument("--install-timeout", type=float, default=1800.0)
  p.add_argument("--json", type=pathlib.Path, default=None, help="write the report here")
  p.add_argument("--markdown", type=pathlib.Path, default=None, help="write the table here")
  p.add_argument("--quantization", default="auto", help="jaxserve's --quantization")
  p.add_argument("--single-stream", action="store_true",
                 help="one chat prompt and 128 greedy tokens instead of the workload")
  p.add_argument("--fresh", action="store_true",
                 help="each system of each round in its own new process")
  p.add_argument("--llama-cpp-repack", choices=("auto", REPACK, NO_REPACK), default="auto",
                 help="llama.cpp's weight repacking at load (use_extra_bufts); auto: on unless a "
                 "throwaway load with it dies, as on the Xeon with AMX")
  p.add_argument("--child", action="store_true",
                 help="(internal, with --fresh) print this process's runs as JSON")
  return p


def fresh_rounds(argv: Sequence[str], names: Sequence[str], args: argparse.Namespace):
  """run_rounds with every system of every round in a new process of this command."""
  drop = {"--fresh"}
  own = ("--systems", "--rounds", "--json", "--markdown", "--llama-cpp-repack")
  base, skip = [], False
  for a in argv:  # This invocation's flags, less the ones each child gets its own of.
    if skip:
      skip = False
    elif a in own:
      skip = True
    elif a not in drop and not a.startswith(tuple(f"{o}=" for o in own)):
      base.append(a)
  base += ["--llama-cpp-repack", args.llama_cpp_repack, "--rounds", "1", "--child"]
  skipped = {}

  def run(name: str) -> list[Run]:
    child = harness.fresh("peers", [*base, "--systems", name])
    skipped.update(child["skipped"])
    return [Run(**{**r, "loadavg": tuple(r["loadavg"])}) for r in child["runs"]]
  runs = {n: [r for rs in per_round for r in rs]
          for n, per_round in harness.interleaved(names, args.rounds, run).items()}
  return {n: rs for n, rs in runs.items() if rs}, skipped


def choose_repack(args: argparse.Namespace, llama: bool) -> str | None:
  """Settles --llama-cpp-repack auto (before any timed run, so children get it as a value)."""
  if not llama or args.child:
    return None
  if args.llama_cpp_repack != "auto":
    return "as asked"
  try:
    args.llama_cpp_repack, why = repack_mode(args.gguf)
  except Exception as e:  # Not installed or the file missing: the systems report it themselves.
    args.llama_cpp_repack, why = REPACK, f"not probed ({type(e).__name__})"
  print(f"llama.cpp: repacking {args.llama_cpp_repack}: {why}", file=sys.stderr, flush=True)
  return why


def run_rounds(systems: Sequence, work: Sequence[dict], rounds: int) -> dict[str, list[Run]]:
  """Every system once per round, interleaved, so a load spike hits them alike."""
  by_name = {s.name: s for s in systems}

  def run(name: str) -> Run:
    r = by_name[name].run(work)
    print(f"  {r.wall_s:.1f} s, {r.generated_tokens_per_s:.1f} generated tokens/s, mean TTFT "
          f"{r.mean_ttft_s:.2f} s (load average {r.loadavg[1]:.2f} after)", file=sys.stderr,
          flush=True)
    return r
  return harness.interleaved(list(by_name), rounds, run)


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  from jaxserve.loading import pull
  from jaxserve.text.tokenizer import Tokenizer

  args.gguf = pull.gguf_path(pull.DEFAULT_MODEL)
  names = [n for n in args.systems.split(",") if n]
  if unknown := set(names) - set(SYSTEMS):
    raise SystemExit(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
  if args.single_stream:
    work = single_stream(Tokenizer.from_gguf(args.gguf))
  elif args.write_workload or args.quick:
    shape = dict(num_requests=4, prompt_lens=(8, 32), max_tokens=(4, 16)) if args.quick else {}
    work = make_workload(Tokenizer.from_gguf(args.gguf), args.seed, **shape)
    if args.write_workload:
      write_workload(args.workload, work)
      print(f"wrote {len(work)} requests to {args.workload}")
      return 0
  else:
    work = read_workload(args.workload)
  install_error, llama = None, any(n.startswith("llama.cpp") for n in names)
  if args.install_llama_cpp and llama:
    install_error = install_llama_cpp(args.install_timeout)
  repack_why = choose_repack(args, llama and not install_error)
  if args.fresh:
    runs, skipped = fresh_rounds(sys.argv[1:] if argv is None else argv, names, args)
  else:
    systems, skipped = load_systems(names, args)
    if install_error:
      skipped.update({n: install_error for n in skipped if n.startswith("llama.cpp")})
    try:
      runs = run_rounds(systems, work, args.rounds)
    finally:
      for s in systems:
        getattr(s, "close", lambda: None)()
  if args.child:
    print(json.dumps({"runs": [dataclasses.asdict(r) for rs in runs.values() for r in rs],
                      "skipped": skipped}))
    return 0
  report = summarize(runs, skipped)
  report["workload"] = {"path": None if args.quick else str(args.workload), "requests": len(work),
                        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in work),
                        "generated_tokens": sum(r["max_tokens"] for r in work)}
  report["machine"] = {**harness.machine(), "rounds": args.rounds, "fresh_processes": args.fresh}
  if repack_why:
    report["llama.cpp weights"] = f"repacking {args.llama_cpp_repack}: {repack_why}"
  table = markdown(report)
  print(table)
  if args.json:
    args.json.write_text(json.dumps(report, indent=2))
  if args.markdown:
    args.markdown.write_text(table + "\n")
  return 0


COMMANDS = {"peers": main}

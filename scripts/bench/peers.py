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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

from . import harness

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


@dataclasses.dataclass
class Run:
  """One system's pass over the workload."""

  system: str
  wall_s: float
  generated_tokens: int  # The workload's: sum of max_tokens.
  prompt_tokens: int
  mean_ttft_s: float
  decoded_tokens: int  # What the system computed (a static batch runs to its longest budget).
  loadavg: tuple[float, float, float]  # 1-minute load average before and after, 5 after.
  outputs: list[list[int]] = dataclasses.field(repr=False, default_factory=list)

  @property
  def generated_tokens_per_s(self) -> float:
    return self.generated_tokens / self.wall_s

  @property
  def prompt_tokens_per_s(self) -> float:
    return self.prompt_tokens / self.wall_s


def timed(system: str, work: Sequence[dict], go) -> Run:
  """Runs go() -> (outputs, first-token times, decoded tokens) and measures it."""
  load_before = os.getloadavg()[0]
  t0 = time.monotonic()
  outputs, firsts, decoded = go()
  wall = time.monotonic() - t0
  for r, out in zip(work, outputs):
    if len(out) != r["max_tokens"]:
      raise RuntimeError(f"{system}: {r['id']} got {len(out)} tokens, wanted {r['max_tokens']}")
  after = os.getloadavg()
  return Run(system, wall, sum(r["max_tokens"] for r in work),
             sum(len(r["prompt_token_ids"]) for r in work),
             statistics.fmean(f - t0 for f in firsts), decoded, (load_before, after[0], after[1]),
             outputs)


class JaxServe:
  name = "jaxserve"

  def __init__(self, args: argparse.Namespace):
    from jaxserve.config import EngineConfig
    from jaxserve.llm import LLM

    cfg = EngineConfig(num_slots=args.slots, page_size=16, max_model_len=args.max_model_len,
                       num_pages=args.num_pages, prefill_buckets=args.buckets,
                       quantization=args.quantization)
    self.llm = LLM(args.jaxserve_model, engine_config=cfg)

  def run(self, work: Sequence[dict]) -> Run:
    from jaxserve.config import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in work]

    def go():
      done = self.llm.generate([r["prompt_token_ids"] for r in work], params)
      outputs = [list(c.token_ids) for c in done]
      return outputs, [c.timings.first_token for c in done], sum(map(len, outputs))
    return timed(self.name, work, go)


class Transformers:
  name = "transformers"

  def __init__(self, args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    self.torch, self.batch_size = torch, args.hf_batch
    self.model = AutoModelForCausalLM.from_pretrained(
        str(args.gguf.parent), gguf_file=args.gguf.name, dtype=torch.float32).eval()
    self.pad = self.model.generation_config.pad_token_id or 0
    self._generate([[1, 2, 3]], 2, lambda: None)  # Warm-up: first-call allocations.

  def _generate(self, prompts: Sequence[Sequence[int]], new: int, on_first) -> Any:
    torch = self.torch
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)  # [B, T], left padded.
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
      ids[row, width - len(p):] = torch.tensor(p)
      mask[row, width - len(p):] = 1
    with torch.inference_mode():
      out = self.model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                do_sample=False, pad_token_id=self.pad,
                                streamer=_FirstToken(on_first))
    return out[:, width:]  # [B, new]

  def run(self, work: Sequence[dict]) -> Run:
    def go():
      outputs, firsts, decoded = [], [], 0
      for start in range(0, len(work), self.batch_size):
        batch = work[start:start + self.batch_size]
        new = max(r["max_tokens"] for r in batch)
        first = []
        out = self._generate([r["prompt_token_ids"] for r in batch], new,
                             lambda: first.append(time.monotonic()))
        outputs += [out[row, :r["max_tokens"]].tolist() for row, r in enumerate(batch)]
        firsts += first[:1] * len(batch)
        decoded += new * len(batch)
      return outputs, firsts, decoded
    return timed(self.name, work, go)


class _FirstToken:
  """A transformers streamer (put/end): calls `on_first` when the first new tokens arrive."""

  def __init__(self, on_first):
    self.on_first, self.num_puts = on_first, 0

  def put(self, value):
    self.num_puts += 1
    if self.num_puts == 2:  # The first put is the prompt.
      self.on_first()

  def end(self):
    pass


def import_llama_cpp():
  import llama_cpp  # Raises ImportError when it is not installed: the system is skipped.
  return llama_cpp


class LlamaCpp:
  """One request at a time, through the high-level `Llama.generate` (which never stops at EOS)."""

  name = "llama.cpp"

  def __init__(self, args: argparse.Namespace):
    self.llm = import_llama_cpp().Llama(
        model_path=str(args.gguf), n_ctx=args.max_model_len, n_batch=512, n_threads=args.threads,
        n_threads_batch=args.threads, verbose=False)
    self._generate([1, 2, 3], 2)  # Warm-up.

  def _generate(self, prompt: Sequence[int], n: int, first: list | None = None) -> list[int]:
    out = []
    for token in self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
      if not out and first is not None:
        first.append(time.monotonic())
      out.append(token)
      if len(out) == n:
        return out
    return out

  def close(self) -> None:
    self.llm.close()

  def run(self, work: Sequence[dict]) -> Run:
    def go():
      firsts = []
      outputs = [self._generate(r["prompt_token_ids"], r["max_tokens"], firsts) for r in work]
      return outputs, firsts, sum(map(len, outputs))
    return timed(self.name, work, go)


class LlamaCppParallel:
  """Continuous batching of `--slots` sequences in one llama.cpp context (its low-level API).

  Each step is one `llama_decode` of a batch: every running sequence's last token, then the whole
  prompts of newly admitted ones while the batch has room (as llama.cpp's server fills its batch).
  Greedy: the argmax of each sequence's logits row.
  """

  name = "llama.cpp-parallel"

  def __init__(self, args: argparse.Namespace):
    lib = self.lib = import_llama_cpp()
    lib.llama_backend_init()
    # llama-cpp-python's own log callback prints what this logger's level lets through.
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    self.model = lib.llama_model_load_from_file(str(args.gguf).encode(),
                                                lib.llama_model_default_params())
    p = lib.llama_context_default_params()
    p.n_ctx = args.slots * args.max_model_len  # Split evenly between the sequences.
    p.n_batch = p.n_ubatch = self.batch_size = 512
    p.n_seq_max, p.n_threads, p.n_threads_batch = args.slots, args.threads, args.threads
    self.ctx = lib.llama_init_from_model(self.model, p)
    if not self.model or not self.ctx:
      raise RuntimeError(f"llama.cpp could not load {args.gguf}")
    self.num_slots = args.slots
    self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
    self.batch = lib.llama_batch_init(self.batch_size, 0, 1)
    self._serve([{"prompt_token_ids": [1, 2, 3], "max_tokens": 2}], [0.0])  # Warm-up.

  def run(self, work: Sequence[dict]) -> Run:
    def go():
      firsts = [0.0] * len(work)
      outputs = self._serve(work, firsts)
      return outputs, firsts, sum(map(len, outputs))
    return timed(self.name, work, go)

  def _serve(self, work: Sequence[dict], firsts: list[float]) -> list[list[int]]:
    """Output ids per request; fills `firsts` with each one's first-token time."""
    lib, mem = self.lib, self.lib.llama_get_memory(self.ctx)
    outputs = [[] for _ in work]
    queue, free = list(range(len(work)))[::-1], list(range(self.num_slots))[::-1]
    running = {}  # slot -> [request index, position of the next token]
    while queue or running:
      rows = [(outputs[i][-1], pos, slot, True) for slot, (i, pos) in running.items()]
      while (queue and free
             and len(rows) + len(work[queue[-1]]["prompt_token_ids"]) <= self.batch_size):
        i, slot = queue.pop(), free.pop()
        lib.llama_memory_seq_rm(mem, slot, -1, -1)
        ids = work[i]["prompt_token_ids"]
        rows += [(t, pos, slot, pos == len(ids) - 1) for pos, t in enumerate(ids)]
        running[slot] = [i, len(ids) - 1]  # Bumped below with the others.
      self._decode(rows)
      now = time.monotonic()
      for j, (_, _, slot, logits) in enumerate(rows):
        if not logits:
          continue
        i = running[slot][0]
        running[slot][1] += 1
        outputs[i].append(self._argmax(j))
        firsts[i] = firsts[i] or now
        if len(outputs[i]) == work[i]["max_tokens"]:
          del running[slot]
          free.append(slot)
    return outputs

  def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
    b = self.batch
    for j, (token, pos, slot, logits) in enumerate(rows):
      b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = token, pos, 1, logits
      b.seq_id[j][0] = slot
    b.n_tokens = len(rows)
    if self.lib.llama_decode(self.ctx, b) != 0:
      raise RuntimeError("llama_decode failed")

  def close(self) -> None:
    """Frees the C objects now: left to interpreter teardown, llama.cpp may crash there."""
    self.lib.llama_batch_free(self.batch)
    self.lib.llama_free(self.ctx)
    self.lib.llama_model_free(self.model)

  def _argmax(self, row: int) -> int:
    import numpy as np
    logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, row),
                                   shape=(self.vocab,))
    return int(logits.argmax())


def install_llama_cpp(timeout_s: float) -> str | None:
  """pip-installs llama-cpp-python (a source build: minutes). None on success, else why not."""
  try:
    import_llama_cpp()
    return None
  except ImportError:
    pass
  print(f"installing llama-cpp-python (compiles llama.cpp; up to {timeout_s:.0f} s)",
        file=sys.stderr)
  try:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "llama-cpp-python"],
                          capture_output=True, text=True, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return f"pip install llama-cpp-python took over {timeout_s:.0f} s"
  if done.returncode:
    return "pip install llama-cpp-python failed: " + done.stderr.strip()[-500:]
  return None


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
  p.add_argument("--child", action="store_true",
                 help="(internal, with --fresh) print this process's runs as JSON")
  return p


def fresh_rounds(argv: Sequence[str], names: Sequence[str], rounds: int):
  """run_rounds with every system of every round in a new process of this command."""
  drop = {"--fresh"}
  base, skip = [], False
  for a in argv:  # This invocation's flags, less the ones each child gets its own of.
    if skip:
      skip = False
    elif a in ("--systems", "--rounds", "--json", "--markdown"):
      skip = True
    elif a not in drop and not a.startswith(("--systems=", "--rounds=", "--json=",
                                             "--markdown=")):
      base.append(a)
  skipped = {}

  def run(name: str) -> list[Run]:
    child = harness.fresh("peers", [*base, "--systems", name, "--rounds", "1", "--child"])
    skipped.update(child["skipped"])
    return [Run(**{**r, "loadavg": tuple(r["loadavg"])}) for r in child["runs"]]
  runs = {n: [r for rs in per_round for r in rs]
          for n, per_round in harness.interleaved(names, rounds, run).items()}
  return {n: rs for n, rs in runs.items() if rs}, skipped


def load_systems(names: Sequence[str], args: argparse.Namespace) -> tuple[list, dict[str, str]]:
  classes = {c.name: c for c in (JaxServe, Transformers, LlamaCpp, LlamaCppParallel)}
  systems, skipped = [], {}
  for name in names:
    try:
      systems.append(classes[name](args))
    except ImportError as e:  # Not installed: reported, never faked.
      skipped[name] = f"not installed ({e})" + ("" if args.install_llama_cpp else
                                                "; pass --install-llama-cpp")
    except Exception as e:  # A peer that fails to load is skipped with the reason.
      skipped[name] = f"failed to load: {type(e).__name__}: {e}"
  return systems, skipped


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
  install_error = None
  if args.install_llama_cpp and any(n.startswith("llama.cpp") for n in names):
    install_error = install_llama_cpp(args.install_timeout)
  if args.fresh:
    runs, skipped = fresh_rounds(sys.argv[1:] if argv is None else argv, names, args.rounds)
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
  table = markdown(report)
  print(table)
  if args.json:
    args.json.write_text(json.dumps(report, indent=2))
  if args.markdown:
    args.markdown.write_text(table + "\n")
  return 0


COMMANDS = {"peers": main}

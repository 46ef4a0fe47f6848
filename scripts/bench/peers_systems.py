"""The systems `python -m scripts.bench peers` runs: each loads once, then runs the work given.

llama.cpp repacks quantized weights at load into layouts for the CPU's extensions ("extra buffer
types"). On the Xeon with AMX that repack of Q4_1 dies with a segfault in llama-cpp-python 0.3.36
(seen 2026-12-04: exit -11 while loading the default model). `repack_mode` finds out, before any
timed run, by loading the file in a throwaway process: if that process dies by a signal, llama.cpp
is loaded with `use_extra_bufts = False` (weights as the file has them), and the report says so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence


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
    lib = import_llama_cpp()
    with _model_params(lib, args.llama_cpp_repack):
      self.llm = lib.Llama(
          model_path=str(args.gguf), n_ctx=args.max_model_len, n_batch=512,
          n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
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
    with _model_params(lib, args.llama_cpp_repack) as params:
      self.model = lib.llama_model_load_from_file(str(args.gguf).encode(), params())
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


REPACK, NO_REPACK = "on", "off"  # --llama-cpp-repack: llama.cpp's default, or use_extra_bufts off.
PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
next(iter(llm.generate([1, 2, 3], temp=0.0)))
"""


def repack_mode(gguf: os.PathLike, timeout_s: float = 300.0) -> tuple[str, str]:
  """(how to load llama.cpp on this CPU, why): a throwaway load with the default repack first."""
  done = subprocess.run([sys.executable, "-c", PROBE, str(gguf)], capture_output=True, text=True,
                        timeout=timeout_s)
  if done.returncode > 0:  # Failed, not crashed (not installed, say): nothing learned.
    raise RuntimeError(f"the probe failed: {done.stderr.strip()[-300:]}")
  if done.returncode == 0:
    return REPACK, "its default load ran on this CPU"
  name = signal.Signals(-done.returncode).name
  return NO_REPACK, (f"its default load (weights repacked for this CPU) died with {name} "
                     f"(exit {done.returncode}) in a throwaway process")


@contextlib.contextmanager
def _model_params(lib, mode: str):
  """While open, llama.cpp's default model parameters carry `mode` (the high-level Llama takes
  no argument for it)."""
  default = lib.llama_cpp.llama_model_default_params

  def params():
    p = default()
    p.use_extra_bufts = mode == REPACK
    return p
  lib.llama_cpp.llama_model_default_params = params
  try:
    yield params
  finally:
    lib.llama_cpp.llama_model_default_params = default


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



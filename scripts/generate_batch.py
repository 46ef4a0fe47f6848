"""Offline batch generation: a JSONL file of prompts in, a JSONL file of completions out.

  python scripts/generate_batch.py prompts.jsonl out.jsonl --slots 16 --max-tokens 128

Each input line is one request: `id`, then `prompt` (text; `--chat` wraps it in the chat
template), `messages` (a chat, always templated) or `prompt_token_ids`, and optionally any
SamplingParams field (`max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `ignore_eos`, ...)
overriding the command line's defaults, `constraint` included, as one-key JSON:
{"json_schema": {...}}, {"json_object": true}, {"regex": "..."}, {"choice": [...]} or
{"grammar": "..."} (structured output). A line without an `id` is named `line-<n>`.

Each output line: id, line (the input line number), text, finish_reason, prompt_tokens,
completion_tokens, cached_tokens and timings (queue_s, ttft_s, e2e_s, counted from submission:
every request is submitted at the start, so they include the wait for a slot); with `--token-ids`,
token_ids; for a request with `logprobs` > 0 (the line's field, or `--logprobs`), logprobs: one
{token_id, logprob, top: [{token_id, logprob}, ...]} per output token, its top `logprobs`
alternatives most likely first (as the gRPC API's TokenLogprob). A malformed line,
an unknown field, a bad sampling value or a request too long for the engine gets a line with
`error` instead, and the run goes on.

Ordering and resume. The two wishes pull apart: results finish out of order, yet nothing already
generated may be lost to an interruption. So each finished request is appended to the output and
flushed at once, in completion order; when the run completes, the file is rewritten in input order
(into a temporary file, then renamed over the output, so a crash there loses nothing either).
Re-running with the same output skips every id (or, for lines with no parsable id, every line
number) already in it, error lines included (delete those lines to retry them), and the final
rewrite puts old and new records in input order together. Processing in input-order windows
instead would keep the file sorted throughout, but would idle slots at every window's end, which
is the cost continuous batching exists to avoid.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import sys
import time
from typing import Any, TextIO

from jaxserve.batching.request import Completion, FinishReason, Request, RequestOutput
from jaxserve.cli import flags
from jaxserve.cli import main as cli
from jaxserve.config import Constraint, SamplingParams, SchedulerConfig
from jaxserve.llm import LLM

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
KNOWN_FIELDS = frozenset({"id", *PROMPT_FIELDS}) | SAMPLING_FIELDS


@dataclasses.dataclass(frozen=True)
class Spec:
  """One valid input line, not yet tokenized."""

  line: int  # 1-based line number in the input file.
  request_id: Any  # The user's id (a string or an int).
  prompt_field: str  # Which of PROMPT_FIELDS holds the prompt.
  prompt: Any
  overrides: dict  # SamplingParams fields from the line.


def parse_line(text: str, line: int) -> Spec:
  """Raises ValueError naming what is wrong with the line."""
  try:
    d = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"not valid JSON: {e}") from None
  if not isinstance(d, dict):
    raise ValueError(f"a line must be a JSON object, got {type(d).__name__}")
  unknown = sorted(set(d) - KNOWN_FIELDS)
  if unknown:
    raise ValueError(f"unknown field(s) {unknown}; known: id, {', '.join(PROMPT_FIELDS)}, "
                     "and SamplingParams fields")
  rid = d.get("id", f"line-{line}")
  if not isinstance(rid, (str, int)) or isinstance(rid, bool):
    raise ValueError(f"id must be a string or an integer, got {rid!r}")
  given = [f for f in PROMPT_FIELDS if f in d]
  if len(given) != 1:
    raise ValueError(f"a line needs exactly one of {', '.join(PROMPT_FIELDS)}, "
                     f"got {given or 'none'}")
  return Spec(line, rid, given[0], d[given[0]], {k: d[k] for k in d if k in SAMPLING_FIELDS})


def line_id(text: str) -> Any:
  """The id of a line that may be malformed (None when it has no usable one)."""
  try:
    d = json.loads(text)
  except json.JSONDecodeError:
    return None
  rid = d.get("id") if isinstance(d, dict) else None
  return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


def prompt_ids(llm: LLM, spec: Spec, chat: bool) -> list[int]:
  if spec.prompt_field == "prompt_token_ids":
    ids = spec.prompt
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            and 0 <= i < llm.tokenizer.vocab_size for i in ids):
      raise ValueError(f"prompt_token_ids must be a list of ids in [0, {llm.tokenizer.vocab_size})")
    return ids
  if spec.prompt_field == "messages":
    if not isinstance(spec.prompt, list):
      raise ValueError("messages must be a list of {role, content} objects")
    text = llm.tokenizer.apply_chat_template(spec.prompt)
    return llm.tokenizer.encode(text, add_bos=False)  # The template writes its own BOS.
  if not isinstance(spec.prompt, str):
    raise ValueError("prompt must be a string")
  return llm.encode(spec.prompt, chat=chat)


def build_request(llm: LLM, spec: Spec, defaults: SamplingParams, chat: bool) -> Request:
  """Raises ValueError (a bad sampling value, a template error, a request too long to run)."""
  stop_ids = spec.overrides.get("stop_token_ids", [])
  if not isinstance(stop_ids, list) or not all(type(i) is int for i in stop_ids):
    raise ValueError(f"stop_token_ids must be a list of integers, got {stop_ids!r}")
  overrides = dict(spec.overrides)
  if "constraint" in overrides:
    overrides["constraint"] = Constraint.from_json(overrides["constraint"])
  try:
    sampling = dataclasses.replace(defaults, **overrides)  # Re-validates every field.
  except TypeError as e:  # A value of a type the field cannot even be built from.
    raise ValueError(f"bad sampling field: {e}") from None
  return llm.runner.new_request(prompt_ids(llm, spec, chat), sampling, request_id=f"{spec.line}")


def result_record(spec: Spec, c: Completion, with_ids: bool) -> dict:
  t = c.timings
  record = {"id": spec.request_id, "line": spec.line, "text": c.text,
            "finish_reason": c.finish_reason.value if c.finish_reason else None,
            "prompt_tokens": len(c.prompt_token_ids), "completion_tokens": len(c.token_ids),
            "cached_tokens": c.num_cached_tokens,
            "timings": {"queue_s": t.queue_time, "ttft_s": t.time_to_first_token,
                        "e2e_s": None if t.finish is None else t.finish - t.arrival}}
  if c.finish_reason is FinishReason.ABORT:
    record["error"] = "aborted"
  if with_ids:
    record["token_ids"] = list(c.token_ids)
  if c.logprobs is not None:
    record["logprobs"] = [
        {"token_id": t, "logprob": lp.logprob,
         "top": [{"token_id": i, "logprob": p} for i, p in zip(lp.top_ids, lp.top_logprobs)]}
        for t, lp in zip(c.token_ids, c.logprobs)]
  return record


class Output:
  """The output file: what is already in it, appending (flushed per record), the final sort."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    self.done_ids, self.done_lines = set(), set()
    for r in self._records():
      if r.get("id") is not None:
        self.done_ids.add(_key(r["id"]))
      elif "line" in r:
        self.done_lines.add(r["line"])
    self._file: TextIO | None = None

  def is_done(self, rid: Any, line: int) -> bool:
    return _key(rid) in self.done_ids if rid is not None else line in self.done_lines

  def write(self, record: dict) -> None:
    if self._file is None:
      ends_cleanly = not self.path.exists() or self.path.read_bytes()[-1:] in (b"", b"\n")
      self._file = open(self.path, "a", encoding="utf-8")
      if not ends_cleanly:  # An interrupted write left half a line: end it; sort() drops it.
        self._file.write("\n")
    self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
    self._file.flush()

  def sort(self, input_order: dict) -> None:
    """Rewrites the file in input order (by id, else by line number); unreadable lines go."""
    if self._file is not None:
      self._file.close()
      self._file = None
    records = self._records()
    records.sort(key=lambda r: (input_order.get(_key(r.get("id")), r.get("line", 0)),
                                r.get("line", 0)))
    tmp = self.path.with_name(self.path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                   encoding="utf-8")
    os.replace(tmp, self.path)

  def _records(self) -> list[dict]:
    if not self.path.exists():
      return []
    records = []
    for text in self.path.read_text(encoding="utf-8").splitlines():
      try:
        r = json.loads(text)
      except json.JSONDecodeError:
        continue  # Half a line from an interrupted run.
      if isinstance(r, dict):
        records.append(r)
    return records


def _key(rid: Any) -> str:
  return json.dumps(rid)  # 7 and "7" stay distinct ids.


class Progress:
  """One stderr line: requests done, generated tokens and tokens/s, at most every `interval` s."""

  def __init__(self, total: int, stream: TextIO | None = None, interval: float = 1.0):
    self.total, self.stream, self.interval = total, stream or sys.stderr, interval
    self.start = self._last = time.perf_counter()
    self.num_done = self.num_tokens = 0
    self._end = "\r" if self.stream.isatty() else "\n"  # Logs get lines, terminals one live line.

  def update(self, num_done: int = 0, num_tokens: int = 0, force: bool = False) -> None:
    self.num_done += num_done
    self.num_tokens += num_tokens
    now = time.perf_counter()
    if force or now - self._last >= self.interval:
      self._last = now
      rate = self.num_tokens / max(now - self.start, 1e-9)
      print(f"[{self.num_done}/{self.total} requests] {self.num_tokens} tokens, "
            f"{rate:.1f} tokens/s",
            end=self._end, file=self.stream, flush=True)

  def close(self) -> None:
    self.update(force=True)
    if self._end == "\r":
      print(file=self.stream)


def plan(input_path: pathlib.Path, output: Output) -> tuple[list, dict, int]:
  """(work: Specs and ready error records, input order: id key -> line, number skipped)."""
  work, order, seen, num_skipped = [], {}, set(), 0
  with open(input_path, encoding="utf-8") as f:
    for line, text in enumerate(f, start=1):
      if not text.strip():
        continue
      try:
        item = parse_line(text, line)
        rid = item.request_id
      except ValueError as e:
        rid = line_id(text)
        item = {"id": rid, "line": line, "error": str(e)}
      if rid is not None:
        order.setdefault(_key(rid), line)
      if output.is_done(rid, line):
        num_skipped += 1
      elif isinstance(item, Spec) and _key(rid) in seen:
        work.append({"id": rid, "line": line,
                     "error": f"duplicate id {rid!r}: an earlier line has it"})
      else:
        work.append(item)
      seen.add(_key(rid))
  return work, order, num_skipped


def generate(llm: LLM, work: list, output: Output, defaults: SamplingParams, chat: bool,
             with_ids: bool, progress: Progress) -> list[dict]:
  """Runs the work through the continuous-batching runner; returns the records written."""
  runner, written = llm.runner, []
  live: dict[str, tuple[Spec, Request, list[RequestOutput]]] = {}
  queue = collections.deque(work)

  def emit(record: dict, num_tokens: int = 0) -> None:
    output.write(record)
    written.append(record)
    progress.update(1, num_tokens)

  while queue or runner.has_unfinished:
    while queue and len(runner.scheduler.waiting) < runner.scheduler.config.max_queue_len:
      item = queue.popleft()
      if isinstance(item, dict):
        emit(item)
        continue
      try:
        req = build_request(llm, item, defaults, chat)
      except ValueError as e:
        emit({"id": item.request_id, "line": item.line, "error": str(e)})
        continue
      runner.submit(req)
      live[req.request_id] = (item, req, [])
    for out in runner.step():
      spec, req, outputs = live[out.request_id]
      outputs.append(out)
      if out.finished:
        del live[out.request_id]
        emit(result_record(spec, req.completion(outputs), with_ids), len(out.token_ids))
      else:
        progress.update(0, len(out.token_ids))
  return written


def summarize(records: list[dict], wall_s: float, num_skipped: int) -> dict:
  ok = [r for r in records if "error" not in r]
  ttfts = [r["timings"]["ttft_s"] for r in ok if r["timings"]["ttft_s"] is not None]
  generated = sum(r["completion_tokens"] for r in ok)
  return {"requests": len(ok), "errors": len(records) - len(ok), "skipped": num_skipped,
          "wall_s": wall_s, "generated_tokens": generated,
          "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
          "tokens_per_s": generated / wall_s if wall_s > 0 else 0.0,
          "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None}


def format_summary(s: dict) -> str:
  ttft = "n/a" if s["mean_ttft_s"] is None else f"{s['mean_ttft_s'] * 1000:.0f} ms"
  return (f"{s['requests']} requests, {s['errors']} errors, {s['skipped']} skipped (already done) "
          f"in {s['wall_s']:.1f} s; {s['generated_tokens']} generated tokens "
          f"({s['tokens_per_s']:.1f} tokens/s), {s['prompt_tokens']} prompt tokens; "
          f"mean time to first token {ttft}")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("input", type=pathlib.Path, help="JSONL, one request per line")
  p.add_argument("output", type=pathlib.Path, help="JSONL results; an existing file is resumed")
  flags.add_engine_flags(p)  # --model --dtype --slots --page-size --num-pages --memory-fraction ...
  flags.add_sampling_flags(p)  # The defaults a line's own fields override.
  p.add_argument("--max-batched-tokens", type=int, default=512, help="prefill tokens per step")
  p.add_argument("--ignore-eos", action="store_true",
                 help="generate max_tokens whatever the model says")
  p.add_argument("--chat", action="store_true", help="wrap `prompt` text in the chat template")
  p.add_argument("--token-ids", action="store_true", help="write the output token ids too")
  p.add_argument("--logprobs", type=int, default=0,
                 help="write each output token's logprob and this many top alternatives "
                 "(0: none; a line's own `logprobs` overrides it)")
  p.add_argument("--progress-interval", type=float, default=1.0,
                 help="seconds between progress lines")
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  output = Output(args.output)
  work, order, num_skipped = plan(args.input, output)
  if work:
    try:
      defaults = dataclasses.replace(flags.sampling_params(args), ignore_eos=args.ignore_eos,
                                     logprobs=args.logprobs)
      llm = LLM(args.model, engine_config=cli.engine_config(args),
                scheduler_config=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens))
    except (ValueError, FileNotFoundError) as e:
      print(f"generate_batch: error: {e}", file=sys.stderr)
      return 2
    progress = Progress(len(work), interval=args.progress_interval)
    try:
      records = generate(llm, work, output, defaults, args.chat, args.token_ids, progress)
    except KeyboardInterrupt:
      print(f"\ninterrupted after {progress.num_done} requests; what finished is in {args.output}: "
            "run the same command again to resume", file=sys.stderr)
      return 130
    progress.close()
    wall = time.perf_counter() - progress.start
  else:
    records, wall = [], 0.0
  output.sort(order)
  print(format_summary(summarize(records, wall, num_skipped)), file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())

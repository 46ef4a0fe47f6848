"""Load test: N concurrent streaming gRPC clients against `jaxserve serve`, with faults injected.

  python scripts/load_test.py [--clients 256] [--rounds 3] [--cancel-frac 0.1] [--deadline-frac 0.1]
      [--stall-frac 0.02] [--json out.json] [--model M --slots 16 --num-pages 64 ...]
  python scripts/load_test.py --target 127.0.0.1:50051 --metrics-url http://127.0.0.1:8000/metrics

Without --target it starts `jaxserve serve` on free loopback ports; flags it does not know
(--model, --slots, --num-pages, ...) go to that command, so a small --num-pages forces preemption.
Each round sends --clients requests at once over a few channels: prompts from --workload cut to
--max-prompt-tokens, greedy or seeded so that a prompt's tokens repeat. Some requests are faulty:
  cancel    the client cancels after a random number of messages (none: after a random delay)
  deadline  a short per-call timeout
  stall     the client reads one message, then stops reading until every other request of the
            round has ended; its channel has a small HTTP/2 window, so the server's writes block
Each check below, broken, makes the exit code 1:
  - every request ends within --timeout-s (else HUNG) with its complete output (finish reason
    STOP or LENGTH on the last message only; tokens = usage = max_tokens for LENGTH, else
    INCONSISTENT) or a status code; a stream that ends OK without a finish reason is DROPPED;
    INTERNAL and UNKNOWN are server bugs
  - a prompt and its sampling give the same tokens every time they complete (else MISMATCH)
  - after each round the server is idle (nothing running or waiting, KV usage 0: every page free)
    within --idle-timeout-s
  - the server's resident memory grows by at most --max-rss-growth from round 2 to the last
    (round 1 warms caches up); with --target, read from its process_resident_memory_bytes
  - the server it started drains and exits 0 on SIGTERM
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import enum
import json
import os
import pathlib
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Callable

import grpc
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.api.proto import jaxserve_pb2_grpc

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.append(str(_HERE.parent))  # The repository's root, for scripts.bench.
from scripts.bench.serving import load_workload, to_request  # noqa: E402


class Fault(enum.Enum):
  NONE = "none"
  CANCEL = "cancel"
  DEADLINE = "deadline"
  STALL = "stall"


class Outcome(enum.Enum):
  COMPLETED = "completed"
  CANCELLED = "cancelled"  # By us.
  DEADLINE = "deadline"  # DEADLINE_EXCEEDED.
  STATUS = "status"  # Another status code (Result.code).
  ABORTED = "aborted"  # The server ended the stream with finish reason ABORT.
  DROPPED = "dropped"  # The stream ended OK without a finish reason.
  INCONSISTENT = "inconsistent"
  MISMATCH = "mismatch"
  HUNG = "hung"


FAILURES = (Outcome.DROPPED, Outcome.INCONSISTENT, Outcome.MISMATCH, Outcome.HUNG)
BUG_CODES = ("INTERNAL", "UNKNOWN")
IDLE = {"jaxserve:num_requests_running": 0.0, "jaxserve:num_requests_waiting": 0.0,
        "jaxserve:kv_cache_usage_perc": 0.0}
_DONE = (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


@dataclasses.dataclass(frozen=True)
class Spec:
  key: int  # Index into the prompt pool: same key, same request, same tokens.
  request: pb.GenerateRequest
  fault: Fault = Fault.NONE
  cancel_after: int = 0  # Messages read before cancelling.
  delay: float = 0.0  # Seconds before cancelling, when cancel_after is 0.
  timeout: float | None = None


@dataclasses.dataclass
class Result:
  spec: Spec
  outcome: Outcome = Outcome.HUNG
  code: str = ""
  tokens: list[int] = dataclasses.field(default_factory=list)
  end: float = 0.0  # time.monotonic() when it ended.
  resumed: float = 0.0  # A stalled client: when it read again.


def prompt_pool(args) -> list[pb.GenerateRequest]:
  """A request per workload line: even ones greedy to max_tokens, odd ones seeded samples that
  may stop at end of turn. Prompts are cut short so that the engine runs many at once."""
  rng = random.Random(args.seed)
  pool = []
  for i, item in enumerate(load_workload(args.workload, None)):
    item = dict(item, max_tokens=rng.randint(args.min_tokens, args.max_tokens))
    if "prompt_token_ids" in item:
      item["prompt_token_ids"] = item["prompt_token_ids"][:args.max_prompt_tokens]
    req = to_request(item)  # Greedy, ignoring end of sequence, a message per token.
    if i % 2:
      req.temperature, req.seed, req.ignore_eos = 1.0, i, False
    pool.append(req)
  return pool


def round_specs(pool: list[pb.GenerateRequest], args, rng: random.Random) -> list[Spec]:
  n = args.clients
  fracs = ((Fault.CANCEL, args.cancel_frac), (Fault.DEADLINE, args.deadline_frac),
           (Fault.STALL, args.stall_frac))
  faults = [f for f, frac in fracs for _ in range(round(frac * n))]
  faults = (faults + [Fault.NONE] * n)[:n]
  rng.shuffle(faults)
  specs = []
  for fault in faults:
    key = rng.randrange(len(pool))
    req = pool[key]
    if fault is Fault.STALL:  # Logprobs make each message bigger, so the window fills sooner.
      req = pb.GenerateRequest(logprobs=20)
      req.MergeFrom(pool[key])
    timeout = rng.uniform(args.deadline_min_s, args.deadline_max_s)
    cancel_after = rng.choice((0, rng.randrange(req.max_tokens)))  # Half before the first token.
    specs.append(Spec(key, req, fault, cancel_after, rng.uniform(0, 0.2),
                      timeout if fault is Fault.DEADLINE else None))
  return specs


def check_output(msgs: list[pb.GenerateResponse], req: pb.GenerateRequest) -> Outcome:
  """The outcome of a stream that ended with status OK."""
  if not msgs or msgs[-1].finish_reason == pb.FINISH_REASON_UNSPECIFIED:
    return Outcome.DROPPED
  last, n = msgs[-1], sum(len(m.token_ids) for m in msgs)
  if last.finish_reason == pb.FINISH_REASON_ABORT:
    return Outcome.ABORTED
  ok = (last.finish_reason in _DONE and n == last.usage.completion_tokens
        and not any(m.finish_reason for m in msgs[:-1]) and len({m.request_id for m in msgs}) == 1)
  if last.finish_reason == pb.FINISH_REASON_LENGTH:
    ok = ok and n == req.max_tokens  # The prompts are cut short: the context never runs out.
  else:
    ok = ok and n <= req.max_tokens and not req.ignore_eos
  return Outcome.COMPLETED if ok else Outcome.INCONSISTENT


async def run_request(stub, spec: Spec, others_done: asyncio.Event) -> Result:
  result, msgs = Result(spec), []
  call = stub.Generate(spec.request, timeout=spec.timeout)
  try:
    while True:
      if spec.fault is Fault.CANCEL and len(msgs) == spec.cancel_after:
        await asyncio.sleep(0 if msgs else spec.delay)
        if call.cancel():  # False: it ended first; read how.
          result.outcome, result.code = Outcome.CANCELLED, (await call.code()).name
          break
      if spec.fault is Fault.STALL and len(msgs) == 1 and not result.resumed:
        await others_done.wait()
        result.resumed = time.monotonic()
      msg = await call.read()
      if msg is grpc.aio.EOF:
        result.outcome = check_output(msgs, spec.request)
        break
      msgs.append(msg)
  except grpc.aio.AioRpcError as e:
    result.code = e.code().name
    result.outcome = (Outcome.DEADLINE if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                      else Outcome.STATUS)
  result.tokens = [t for m in msgs for t in m.token_ids]
  result.end = time.monotonic()
  return result


async def run_round(address: str, specs: list[Spec], args,
                    on_others_done: Callable[[], None] | None = None) -> tuple[list[Result], float]:
  """Sends every spec at once; a request still open after --timeout-s is HUNG."""
  channels = [grpc.aio.insecure_channel(address) for _ in range(args.channels)]
  # A small stream window, and no growing it, so a stalled stream pushes back on the server.
  stall = grpc.aio.insecure_channel(address, options=[
      ("grpc.http2.lookahead_bytes", args.stall_window_bytes), ("grpc.http2.bdp_probe", 0)])
  stubs = [jaxserve_pb2_grpc.JaxserveStub(c) for c in channels]
  others_done = asyncio.Event()
  start = time.monotonic()
  try:
    tasks = [asyncio.create_task(run_request(
        jaxserve_pb2_grpc.JaxserveStub(stall) if s.fault is Fault.STALL else stubs[i % len(stubs)],
        s, others_done)) for i, s in enumerate(specs)]
    others = [t for t, s in zip(tasks, specs) if s.fault is not Fault.STALL]

    async def release_stalled():
      if others:
        await asyncio.wait(others)
      if on_others_done is not None:
        await asyncio.to_thread(on_others_done)
      others_done.set()

    releaser = asyncio.create_task(release_stalled())
    done, pending = await asyncio.wait(tasks, timeout=args.timeout_s)
    for task in [*pending, releaser]:
      task.cancel()
    results = [t.result() if t in done else Result(s) for t, s in zip(tasks, specs)]
  finally:
    for channel in [*channels, stall]:
      await channel.close()
  return results, time.monotonic() - start


def check_repeats(results: list[Result], reference: dict[int, list[int]]) -> None:
  """Marks a completed output that differs from an earlier one of the same prompt MISMATCH."""
  for r in results:
    if r.outcome is Outcome.COMPLETED:
      if reference.setdefault(r.spec.key, r.tokens) != r.tokens:
        r.outcome = Outcome.MISMATCH


def scrape(url: str) -> dict[str, float]:
  text = urllib.request.urlopen(url, timeout=10).read().decode()
  return {s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items())): s.value
          for family in text_string_to_metric_families(text) for s in family.samples}


def wait_idle(url: str, timeout: float) -> tuple[float | None, dict[str, float]]:
  """(seconds until idle, or None if it never was; the last scrape)."""
  start = time.monotonic()
  while True:
    metrics = scrape(url)
    if all(metrics.get(k) == v for k, v in IDLE.items()):
      return time.monotonic() - start, metrics
    if time.monotonic() - start > timeout:
      return None, metrics
    time.sleep(0.05)


def rss_bytes(pid: int | None, metrics: dict[str, float]) -> float | None:
  """The server's resident memory: /proc when it is our child, else its process metrics."""
  if pid is not None:
    with open(f"/proc/{pid}/status") as f:
      return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
  return metrics.get("process_resident_memory_bytes")


def summarize(index: int, results: list[Result], wall: float) -> dict:
  counts = collections.Counter(r.outcome.value for r in results)
  codes = collections.Counter(r.code for r in results if r.outcome is Outcome.STATUS)
  failures = [f"{r.spec.fault.value} request {i}: {r.outcome.value} {r.code}".strip()
              for i, r in enumerate(results)
              if r.outcome in FAILURES or (r.outcome is Outcome.STATUS and r.code in BUG_CODES)]
  return {"round": index, "requests": len(results), **{o.value: counts[o.value] for o in Outcome},
          "codes": dict(codes),
          "faults": dict(collections.Counter(r.spec.fault.value for r in results)),
          "output_tokens": sum(len(r.tokens) for r in results if r.outcome is Outcome.COMPLETED),
          "wall_s": round(wall, 2), "failures": failures}


def after_round(row: dict, before: dict, url: str | None, pid: int | None, args) -> dict:
  """Adds the server's side: time to idle, RSS, preemptions and finished requests this round."""
  if url is None:
    return before
  idle_s, metrics = wait_idle(url, args.idle_timeout_s)
  if idle_s is None:
    row["failures"].append(f"not idle after {args.idle_timeout_s} s: " +
                           ", ".join(f"{k}={metrics.get(k)}" for k in IDLE))
  delta = lambda name: metrics.get(name, 0.0) - before.get(name, 0.0)
  rss = rss_bytes(pid, metrics)
  row.update(idle_s=idle_s, rss_mib=None if rss is None else rss / 2**20,
             preemptions=delta("jaxserve:num_preemptions_total"),
             server_finished={k.rpartition("=")[2]: delta(k) for k in metrics
                              if k.startswith("jaxserve:request_success_total|")})
  return metrics


COLUMNS = ("round", "requests", "completed", "cancelled", "deadline", "status", "aborted", "hung",
           "dropped", "inconsistent", "mismatch", "wall_s", "idle_s", "rss_mib", "preemptions")


def print_row(row: dict) -> None:
  cell = lambda v: "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)
  if row["round"] == 1:
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
  print("| " + " | ".join(cell(row.get(c)) for c in COLUMNS) + " |", flush=True)
  for failure in row["failures"]:
    print(f"round {row['round']}: FAIL {failure}", file=sys.stderr)


def start_server(serve_args: list[str], log_path: str,
                 timeout: float) -> tuple[subprocess.Popen, str, str]:
  """`jaxserve serve` on free loopback ports; (process, gRPC address, metrics URL) once ready."""
  cmd = [sys.executable, "-m", "jaxserve.cli.main", "serve", "--grpc-port", "0", "--http-port", "0",
         *serve_args]
  print(f"starting {' '.join(cmd)} (log: {log_path})", file=sys.stderr)
  with open(log_path, "w") as log:  # The child keeps its own copy of the file.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
  lines = queue.Queue()
  threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout] + [lines.put("")],
                   daemon=True).start()
  ports, deadline = {}, time.monotonic() + timeout
  while True:
    try:
      line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
    except queue.Empty:
      line = ""
    ports.update((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", line))
    if line.startswith("jaxserve: ready"):
      return proc, f"127.0.0.1:{ports['grpc']}", f"http://127.0.0.1:{ports['http']}/metrics"
    if not line or "error" in line:  # It exited, failed, or took longer than `timeout`.
      proc.kill()
      raise RuntimeError(f"the server did not start: {line.strip()} (see {log_path})")


def run(args, address: str, url: str | None, pid: int | None) -> dict:
  pool, rng, reference = prompt_pool(args), random.Random(args.seed), {}
  metrics = scrape(url) if url else {}
  rows = []
  for index in range(1, args.rounds + 1):
    print(f"round {index}: {args.clients} clients", file=sys.stderr)
    results, wall = asyncio.run(run_round(address, round_specs(pool, args, rng), args))
    check_repeats(results, reference)
    row = summarize(index, results, wall)
    metrics = after_round(row, metrics, url, pid, args)
    print_row(row)
    rows.append(row)
  summary = {"rounds": rows, "failures": [f for row in rows for f in row["failures"]]}
  if len(rows) >= 2 and rows[1].get("rss_mib"):
    growth = rows[-1]["rss_mib"] / rows[1]["rss_mib"] - 1
    summary["rss_growth"] = growth
    if growth > args.max_rss_growth:
      summary["failures"].append(f"RSS grew {100 * growth:.1f}% from round 2 to round {len(rows)}")
  return summary


def parse_args(argv) -> tuple[argparse.Namespace, list[str]]:
  """(this script's flags, the rest: `jaxserve serve` flags)."""
  p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  flag = lambda name, default, doc="": p.add_argument(
      name, type=type(default), default=default, help=f"{doc} (default: %(default)s)".strip())
  p.add_argument("--target", default=None, help="host:port of a running server (else start one)")
  p.add_argument("--metrics-url", default=None, help="with --target: its /metrics")
  flag("--clients", 256, "requests at once, per round")
  flag("--rounds", 3)
  flag("--channels", 2, "gRPC connections the clients share")
  flag("--workload", str(_HERE / "workloads" / "peers_64.jsonl"))
  flag("--max-prompt-tokens", 64, "cut prompts to this; with --max-tokens, must fit the context")
  flag("--min-tokens", 4)
  flag("--max-tokens", 32)
  flag("--cancel-frac", 0.1)
  flag("--deadline-frac", 0.1)
  flag("--deadline-min-s", 0.05)
  flag("--deadline-max-s", 3.0)
  flag("--stall-frac", 0.02)
  flag("--stall-window-bytes", 256, "HTTP/2 stream window of the stalled clients' channel")
  flag("--timeout-s", 600.0, "a round's bound: requests open after it are HUNG")
  flag("--idle-timeout-s", 30.0)
  flag("--max-rss-growth", 0.05, "from round 2 to the last, as a fraction")
  flag("--startup-timeout-s", 900.0)
  flag("--server-log", os.path.join(tempfile.gettempdir(), "jaxserve_load_test.log"))
  flag("--seed", 0)
  p.add_argument("--json", default=None, help="write the rounds and failures here")
  return p.parse_known_args(argv)


def main(argv=None) -> int:
  args, serve_args = parse_args(argv)
  if args.target is not None and serve_args:
    raise SystemExit(f"unknown flags {serve_args} (server flags go without --target)")
  proc, address, url = None, args.target, args.metrics_url
  if args.target is None:
    proc, address, url = start_server(serve_args, args.server_log, args.startup_timeout_s)
  elif url is None:
    print("no --metrics-url: the idle and memory checks are off", file=sys.stderr)
  start = time.monotonic()
  try:
    summary = run(args, address, url, proc and proc.pid)
  finally:
    if proc is not None:
      proc.send_signal(signal.SIGTERM)  # Drains, then exits 0.
      exit_code = proc.wait(120)
  summary["wall_s"] = time.monotonic() - start
  growth = f"{100 * summary['rss_growth']:.1f}%" if "rss_growth" in summary else "n/a"
  if proc is not None and exit_code != 0:
    summary["failures"].append(f"the server exited {exit_code}")
  print(f"{sum(r['requests'] for r in summary['rounds'])} requests in {summary['wall_s']:.1f} s; "
        f"RSS growth from round 2: {growth}; "
        f"{len(summary['failures'])} failures")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "serve_args": serve_args, **summary}, f, indent=2)
  return 1 if summary["failures"] else 0


if __name__ == "__main__":
  sys.exit(main())

"""How every benchmark under scripts/bench/ times things, so no two do it their own way.

  parser(cmd, doc) a command's argparse parser, its docstring as the help
  machine_line()   the CPU model (/proc/cpuinfo's), cores, jax version and load average: the
                   first line of every command's output (a ratio is only read within one machine)
  timed(fn, n)     wall seconds of n calls of fn, after one untimed call (compiles, first-touch
                   allocations); `setup` runs untimed before each call
  fresh(cmd, argv) `python -m scripts.bench CMD ARGV` in a new process, the JSON of its last line:
                   one side of a comparison, with no other side's compiled programs, caches or
                   thread pools in its process
  interleaved(sides, rounds, run)  every side once a round, so the machine's drift over the run
                   (other jobs, thermal state) hits all sides alike; `reverse_odd` runs odd rounds
                   in reverse, so no side always goes first
  median_item(items, key)          the median round itself (the lower middle one of an even
                   count), so every figure of the reported round comes from one run
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Callable, Hashable, Sequence, TypeVar

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKLOAD = ROOT / "scripts" / "workloads" / "peers_64.jsonl"  # bench.peers' make_workload
Side = TypeVar("Side", bound=Hashable)
Item = TypeVar("Item")


def parser(command: str, doc: str) -> argparse.ArgumentParser:
  """A command's parser: `python -m scripts.bench COMMAND`, its entry point's docstring as help."""
  return argparse.ArgumentParser(prog=f"python -m scripts.bench {command}",
                                 description=inspect.cleandoc(doc),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


def cpu_model() -> str:
  """The CPU's model name (lscpu's), which changes between sessions here."""
  for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
    if line.startswith("model name"):
      return line.split(":", 1)[1].strip()
  return "unknown"


def machine() -> dict:
  """What a figure depends on besides the code: read from metadata, so jax is not imported."""
  try:
    jax_version = importlib.metadata.version("jax")
  except importlib.metadata.PackageNotFoundError:
    jax_version = "not installed"
  return {"cpu": cpu_model(), "cpus": os.cpu_count(), "jax": jax_version,
          "load_avg": os.getloadavg()}


def machine_line() -> str:
  m = machine()
  return (f"{m['cpu']}, {m['cpus']} cores, jax {m['jax']}, load average "
          + " ".join(f"{x:.1f}" for x in m["load_avg"]))


def timed(fn: Callable[[], object], repeats: int, *, warmup: bool = True,
          setup: Callable[[], object] | None = None) -> list[float]:
  """Wall seconds of each of `repeats` calls of fn (which must block until its result is ready:
  `.block_until_ready()`, `.result()`)."""
  if warmup:
    if setup:
      setup()
    fn()
  times = []
  for _ in range(repeats):
    if setup:
      setup()
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times


def fresh(command: str, argv: Sequence[str], env: dict[str, str] | None = None) -> dict:
  """Runs one benchmark command in a new Python process and returns the JSON object its last
  line of stdout holds; its stderr (progress, warnings) passes through. This tree's root goes
  first on the child's PYTHONPATH, so `scripts.bench` imports from any working directory."""
  path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
  cmd = [sys.executable, "-m", "scripts.bench", command, *argv]
  done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path, **(env or {})},
                        stdout=subprocess.PIPE, text=True, check=False)
  if done.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed with exit code {done.returncode}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def interleaved(sides: Sequence[Side], rounds: int, run: Callable[[Side], Item], *,
                reverse_odd: bool = False) -> dict[Side, list[Item]]:
  """{side: [run(side) of each round]}, the sides run in turn within each round."""
  results = {side: [] for side in sides}
  for r in range(rounds):
    for side in (sides[::-1] if reverse_odd and r % 2 else sides):
      print(f"round {r + 1}/{rounds}: {side} (load average {os.getloadavg()[0]:.2f})",
            file=sys.stderr, flush=True)
      results[side].append(run(side))
  return results


def median_item(items: Sequence[Item], key: Callable[[Item], float]) -> Item:
  return sorted(items, key=key)[(len(items) - 1) // 2]

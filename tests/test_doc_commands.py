"""The commands README.md and docs/ give, as a reader copies them: every `jaxserve` and `python`
line of a fenced block is found here; each `jaxserve` command parses with the flags it is
written with; the fast ones (RUN) run as written and succeed; every other one is listed in SLOW
with why it is not run here, so a command added to the docs must be placed in one of the two."""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from jaxserve.cli import main as cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Run as written, from the repository's root: each takes seconds.
RUN = {
    "jaxserve plan --model llama-2-7b --context 8192 --memory-gib 80",
    "jaxserve pull",
}
# Not run here, each with why; the `jaxserve` ones still parse. Matched by their start.
SLOW = {
    "python3 -m venv .venv": "sets up a fresh machine (CI runs the test command itself)",
    "python3 -m venv .venv-cuda": "installs the CUDA plugin (CI's second venv runs it)",
    "python -m venv .venv-clients": "installs the external clients' venv",
    "python -m pytest": "the test suite itself",
    "python scripts/ablate_cache_layout.py --quick": "tests/test_ablation.py runs it",
    "python scripts/ablate_cache_layout.py --out": "13.5 minutes",
    "python -m scripts.rl": "200 RL steps, over a minute (tests/test_rl_example.py runs 30)",
    "jaxserve serve": "a server runs until stopped (tests/test_server*.py start one)",
    "jaxserve client": "needs a running server",
    "jaxserve generate": "a model's compile and generation (tests/test_cli.py runs one)",
    "jaxserve pull gemma-3-270m": "downloads Gemma 3's four wheels",
    "jaxserve convert path/to/": "a placeholder path",
    "jaxserve plan --compile": "minutes of the TPU compiler (tests/test_targets.py)",
}


def commands() -> list[tuple[str, str]]:
  """(file, command) for each jaxserve/python line of a fenced block, its continuations joined
  and its trailing comment cut."""
  found = []
  for path in DOCS:
    for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), re.S):
      pending = ""
      for line in block.replace("\\\n", " ").splitlines():
        line = pending + " " + line.strip() if pending else line.strip().removeprefix("$ ")
        try:
          shlex.split(line)
        except ValueError:  # A quote open: the shell reads on into the next line.
          pending = line
          continue
        pending = ""
        line = re.sub(r"\s+#[^'\"]*$", "", line).rstrip(" &")
        if re.match(r"(jaxserve|python3?) ", line):
          found.append((path.name, re.sub(r"\s+", " ", line)))
  return found


def slow_reason(command: str) -> str | None:
  return next((why for start, why in SLOW.items() if command.startswith(start)), None)


def test_every_command_is_run_or_listed_as_slow():
  placed = [(f, c) for f, c in commands() if c not in RUN and slow_reason(c) is None]
  assert not placed, f"commands neither in RUN nor in SLOW: {placed}"
  assert RUN <= {c for _, c in commands()}, "a RUN command the docs no longer give"


@pytest.mark.parametrize("command", sorted({c for _, c in commands()
                                            if c.startswith("jaxserve ")}))
def test_every_jaxserve_command_parses(command):
  cli.build_parser().parse_args(shlex.split(command)[1:])


@pytest.mark.parametrize("command", sorted(RUN))
def test_the_fast_commands_run_as_written(command):
  argv = shlex.split(command)
  done = subprocess.run([sys.executable, "-m", "jaxserve.cli", *argv[1:]], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]

"""scripts/device_check.sh's summary.json: each step's exit code and seconds, the closing line of
its pytest run, and every JSON object its log printed (the probe's report, the benchmarks'
figures). Standard library only: it runs under the device machine's python3.

  python3 scripts/device/summary.py WORK_DIR MODE > summary.json
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

PYTEST_LINE = re.compile(r"^=*\s*\d+ (passed|failed|skipped|error|deselected)")


def figures(log: pathlib.Path) -> tuple[str | None, list]:
  """(pytest's closing line, the JSON objects printed one a line) of one step's log."""
  closing, objects = None, []
  for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
    if PYTEST_LINE.match(line):
      closing = line.strip("= ")
    elif line.startswith("{"):
      try:
        objects.append(json.loads(line))
      except json.JSONDecodeError:
        pass
  return closing, objects


def summary(work: pathlib.Path, mode: str) -> dict:
  lines = (work / "steps.jsonl").read_text().splitlines() if (work / "steps.jsonl").exists() else []
  steps = [json.loads(line) for line in lines]
  for step in steps:
    step["pytest"], step["json"] = figures(work / f"{step['step']}.log")
  setup = work / "setup.log"
  return {"mode": mode, "setup": setup.read_text().splitlines() if setup.exists() else [],
          "steps": steps}


if __name__ == "__main__":
  print(json.dumps(summary(pathlib.Path(sys.argv[1]), sys.argv[2]), indent=1))

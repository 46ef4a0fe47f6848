"""The scripts under scripts/ as modules, for the tests that call their functions."""

import importlib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name: str):
  """scripts/<name>.py as the module scripts.<name> (`bench.peers`: scripts/bench/peers.py),
  imported once: the repository's root goes on sys.path for the scripts namespace."""
  if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
  return importlib.import_module(f"scripts.{name}")

"""The scripts under scripts/ as modules, for the tests that call their functions."""

import importlib.util
import pathlib
import sys

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


def load(name: str):
  """scripts/<name>.py, imported once: registered in sys.modules first, since dataclasses look
  their module up there."""
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  return sys.modules[name]

"""Put first on PYTHONPATH by scripts/device_check.sh, and only when the machine's flax cannot
import `flax.nnx` on its jax (flax <= 0.12.9 on jax 0.11.2): jaxserve.compat.patch_flax_hijax
before anything imports flax. Then runs the image's own sitecustomize, if it has one."""

import importlib.machinery
import importlib.util
import os
import sys

try:
  from jaxserve import compat
  compat.patch_flax_hijax()
except Exception as e:  # noqa: BLE001 -- never stop the interpreter from starting.
  print(f"device_hooks: patch_flax_hijax failed: {e!r}", file=sys.stderr)

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
  _spec.loader.exec_module(importlib.util.module_from_spec(_spec))

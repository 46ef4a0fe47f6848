"""The jax APIs jaxserve leans on that are experimental or private, probed in one place, so one
run on a machine with another jax (the H200's 0.11.2; we pin 0.10.2) says at once what moved.

  python -m jaxserve.compat        # one JSON line: versions, devices, each probe "ok" or its error

docs/kernels.md ("jax 0.11") lists each API, what jax 0.11 changed in it, and where it is handled.
The one shim here, `patch_flax_hijax`, is for flax, not for us: flax <= 0.12.9's `flax.nnx` defines
three primitives on `jax.experimental.hijax.HiPrimitive` at import, a name jax 0.11.2 removed.
scripts/device/sitecustomize.py applies it before anything imports flax, and only there.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable

# jax.monitoring's event names (jax._src.dispatch's constants, private: named here once).
JAXPR_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# The persistent compilation cache's options (engine/engine.py: enable_compilation_cache).
CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_min_entry_size_bytes")


def patch_flax_hijax() -> bool:
  """Gives jax.experimental.hijax a stand-in `HiPrimitive` where jax has none (0.11.2), so that
  a flax that still subclasses it imports. The stand-in is a plain named primitive: flax binds
  those three only for `flax_hijax_variable=True` variables, which jaxserve never makes.
  Returns whether it patched."""
  from jax.experimental import hijax
  if hasattr(hijax, "HiPrimitive"):
    return False
  from jax.extend import core

  class HiPrimitive(core.Primitive):
    """Stand-in for the HiPrimitive jax 0.11.2 removed (see the module docstring)."""

  hijax.HiPrimitive = HiPrimitive
  return True


def _attr(module: str, *names: str) -> Callable[[], None]:
  def probe():
    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
      raise AttributeError(f"{module} has no {', '.join(missing)}")
  return probe


def _events() -> None:
  from jax._src import dispatch
  assert (dispatch.JAXPR_TRACE_EVENT, dispatch.BACKEND_COMPILE_EVENT) == (
      JAXPR_TRACE_EVENT, BACKEND_COMPILE_EVENT), "jax renamed its compile events"


def _cache_options() -> None:
  import jax
  missing = [name for name in CACHE_OPTIONS if not hasattr(jax.config, name)]
  assert not missing, f"no jax.config option {missing}"


def _memory_kinds() -> None:
  import jax
  kinds = jax.devices()[0].addressable_memories()
  names = {m.kind for m in kinds}
  assert "pinned_host" in names, f"no pinned_host memory: {sorted(names)}"


def _make_mesh() -> None:
  import jax
  from jax.sharding import AxisType
  jax.make_mesh((1,), ("model",), (AxisType.Auto,), devices=jax.devices()[:1])


PROBES: dict[str, Callable[[], None]] = {
    "pallas": _attr("jax.experimental.pallas", "pallas_call", "BlockSpec", "program_id", "when",
                    "cdiv", "ds", "ANY"),
    "pallas.triton": _attr("jax.experimental.pallas.triton", "CompilerParams"),
    "pallas.tpu": _attr("jax.experimental.pallas.tpu", "PrefetchScalarGridSpec", "VMEM",
                        "make_async_copy", "SemaphoreType", "CompilerParams", "ARBITRARY"),
    "ffi": _attr("jax.ffi", "ffi_call", "register_ffi_target", "pycapsule"),
    "sharding": _attr("jax.sharding", "AxisType", "Mesh", "NamedSharding", "PartitionSpec",
                      "AbstractMesh"),
    "shard_map": _attr("jax", "shard_map", "make_mesh"),
    "make_mesh": _make_mesh,
    "memory_kinds": _memory_kinds,
    "multihost_utils": _attr("jax.experimental.multihost_utils", "broadcast_one_to_all",
                             "process_allgather"),
    "topologies": _attr("jax.experimental.topologies", "get_topology_desc"),
    "extend.random": _attr("jax.extend.random", "threefry2x32_p"),
    "compile_events": _events,
    "compilation_cache": _cache_options,
    "flax.nnx": lambda: importlib.import_module("flax.nnx"),
}


def report() -> dict:
  import jax
  out = {"python": sys.version.split()[0], "jax": jax.__version__,
         "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
         "flax_hijax_patched": "Stand-in" in (getattr(importlib.import_module(
             "jax.experimental.hijax"), "HiPrimitive", None).__doc__ or ""),
         "probes": {}}
  for name, probe in PROBES.items():
    try:
      probe()
      out["probes"][name] = "ok"
    except Exception as e:  # noqa: BLE001 -- every probe's failure is the report.
      out["probes"][name] = f"{type(e).__name__}: {e}"
  for package in ("jaxlib", "flax", "transformers", "torch", "triton"):
    try:
      out[package] = importlib.import_module(package).__version__
    except Exception as e:  # noqa: BLE001
      out[package] = f"{type(e).__name__}: {e}"
  return out


if __name__ == "__main__":
  result = report()
  print(json.dumps(result))
  sys.exit(0 if all(v == "ok" for v in result["probes"].values()) else 1)

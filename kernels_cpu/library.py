"""The built kernel library: found beside this file, loaded and registered with XLA once."""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import os
from pathlib import Path

import jax

_log = logging.getLogger("jaxserve")

# setup.py builds kernels_cpu/_kernels<suffix>; JAXSERVE_CPU_KERNELS=off hides it (to measure
# XLA's path beside the kernels').
LIBRARY = "_kernels"
HIDE_ENV = "JAXSERVE_CPU_KERNELS"
# FFI target name -> the handler symbol in the library.
TARGETS = {"jaxserve_qmatmul": "JaxserveQMatmul",
           "jaxserve_ragged_attention": "JaxserveRaggedAttention"}
# The `isa` attribute's values (common.h's Isa): auto is the widest the CPU has. avx512vnni
# differs from avx512 only for int8 activations (avx512 runs them on the AVX2 products).
ISAS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3, "avx512vnni": 4}


def isa_code(isa: str) -> int:
  """The `isa` attribute's value of an instruction set's name, for the wrappers; ValueError for a
  name it does not know, or when the library is not built (check `available()` first)."""
  if isa not in ISAS:
    raise ValueError(f"isa must be one of {list(ISAS)}, got {isa!r}")
  if not available():
    raise ValueError("the CPU kernel library is not built (kernels_cpu.available() is False)")
  return ISAS[isa]


def library_path(folder: Path = Path(__file__).parent) -> Path | None:
  """The built library in `folder`, or None."""
  for suffix in importlib.machinery.EXTENSION_SUFFIXES:
    path = folder / f"{LIBRARY}{suffix}"
    if path.is_file():
      return path
  return None


@functools.cache
def available() -> bool:
  """True once the library is loaded and its targets registered; False (logged once) when it was
  not built or is hidden, and the callers keep XLA's path."""
  path = None if os.environ.get(HIDE_ENV) == "off" else library_path()
  if path is None:
    _log.warning("jaxserve: CPU kernels not built (no C++ compiler at install, or %s=off): "
                 "quantized weights run XLA's dequantize-then-dot path", HIDE_ENV)
    return False
  lib = ctypes.CDLL(str(path))
  for name, symbol in TARGETS.items():
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  return True


def supported_isas() -> list[str]:
  """The instruction sets this CPU runs (the sweep test runs each)."""
  flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
  out = ["scalar"]
  if "avx2" in flags and "fma" in flags:
    out.append("avx2")
  if "avx512f" in flags and "avx512bw" in flags:
    out.append("avx512")
  return out


def int8_isas() -> list[str]:
  """The int8 activation paths this CPU runs: scalar, AVX2's products (avx2; avx512 without VNNI
  runs them too) and VNNI's (avx512vnni), which auto picks where CPUID shows it."""
  flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
  return [*supported_isas()[:2], *(["avx512vnni"] if "avx512_vnni" in flags else [])]


def dispatched_isa() -> str | None:
  """The instruction set the library runs for isa="auto", as it reports it (its own CPUID
  check), or None when it is not available."""
  if not available():
    return None
  widest = ctypes.CDLL(str(library_path())).JaxserveWidestIsa
  widest.restype = ctypes.c_int64
  return {code: name for name, code in ISAS.items()}[widest()]


def measured_faster() -> bool:
  """Whether the kernels run a path that was measured faster than XLA's float one: AVX2 or
  AVX-512 (BENCHMARKS.md, "CPU kernels"); the scalar path, all a CPU without AVX2 runs, was
  not measured, so `--quantization auto` keeps float weights there."""
  return dispatched_isa() in ("avx2", "avx512")

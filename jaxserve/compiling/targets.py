"""Real TPU and GPU chips as compile-only devices on a machine that has neither.

XLA's TPU compiler (libtpu, from `pip install 'jax[tpu]'`) and GPU compiler (the CUDA plugin) both
run on a CPU-only host when handed an abstract device: `jax.experimental.topologies` builds one
from a topology name (TPU) or from an XLA `GpuTargetConfigProto` text (GPU, `gpu_specs/`).
`jax.jit(f).lower(args placed on it).compile()` then runs the whole compiler, Mosaic and Triton
kernels included, and `memory_analysis()` says what the program needs on that chip. Nothing is
allocated: the arguments are `jax.ShapeDtypeStruct`s.

  TARGETS          the chips (planning/chips.py: a host-side table, so `jaxserve plan` needs no jax)
  abstract_device  a compile-only device of a target
  lower            lowers one function for a device (or a mesh of them): its compile, to run later
  compile_report   compiles one function there: compiled or the compiler's error, and its memory
  compile_reports  compiles many: lowered one after another, compiled on a pool of threads
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib.util
import os
import pathlib
import time
from typing import Any, Callable, Sequence

import jax
from jax.experimental import topologies

from jaxserve.model import quant_linear
from jaxserve.planning.chips import TARGETS, Platform, Target

_SPECS = pathlib.Path(__file__).parent / "gpu_specs"

# A single-row top_k becomes a CUB radix sort on XLA:GPU, whose set-up calls the CUDA runtime
# while compiling (without a GPU: cudaErrorInvalidDevice, or "Error loading CUDA libraries" with
# no libcudart installed); the sort XLA emits itself needs no runtime.
_COMPILER_OPTIONS = {Platform.TPU: {}, Platform.CUDA: {"xla_gpu_enable_cub_radix_sort": False}}
_PLATFORM_OF_DEVICE = {"tpu": Platform.TPU, "gpu": Platform.CUDA}  # jax.Device.platform


def missing_compiler(target: Target) -> str | None:
  """Why this machine cannot compile for `target`, or None when it can."""
  if target.platform is Platform.TPU and importlib.util.find_spec("libtpu") is None:
    return "libtpu is not installed: pip install 'jax[tpu]==<this jax version>'"
  if target.platform is Platform.CUDA:
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
      return "the CUDA plugin is not installed (see docs/kernels.md: compile targets)"
    if jax.config.jax_platforms != "cpu":
      return ("set JAX_PLATFORMS=cpu (or jax_platforms='cpu') before jax starts: otherwise the "
              "CUDA plugin looks for a GPU and offers no compile-only devices")
  return None


def abstract_device(name: str) -> jax.Device:
  """A compile-only device of target `name`: one chip, alone in its sharding."""
  return abstract_devices(name)[0]


@functools.cache
def abstract_devices(name: str) -> tuple[jax.Device, ...]:
  """Every compile-only device of target `name`'s topology (4 chips for the TPUs, 1 GPU)."""
  target = TARGETS[name]
  why = missing_compiler(target)
  if why:
    raise RuntimeError(f"cannot compile for {name}: {why}")
  if target.platform is Platform.TPU:
    # libtpu takes a lock per machine, for processes that drive real chips; compiling drives none,
    # and without this a second process (another test run) would refuse to start.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology,
                                            **target.topology_options)
  else:
    topology = topologies.get_topology_desc(platform="cuda", topology=target.topology,
                                            target_config=(_SPECS / target.spec).read_text())
  return tuple(topology.devices)


def on_device(tree: Any, device: jax.Device) -> Any:
  """The arrays (or ShapeDtypeStructs) of `tree` as ShapeDtypeStructs placed on `device`."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def lower(fn: Callable, abstract_args: Sequence[Any], device: jax.Device | None, *,
          donate: Sequence[int] = (), shardings: Sequence[Any] | None = None,
          out_shardings: Any = None, keep_unused: bool = False) -> Callable[[], Any]:
  """Lowers `fn(*abstract_args)` for `device`; returns its compile (a call that gives the
  `jax.stages.Compiled`), to run on any thread.

  `abstract_args` are pytrees of arrays or ShapeDtypeStructs (placed on `device` here, or, for a
  program over a mesh of abstract devices or one reading host memory, on `shardings`: one pytree
  of shardings per argument, with `out_shardings` for the results); arguments `donate` are
  donated, as the engine donates its cache and state (`keep_unused`: an argument the program
  does not read is still taken, and donated)."""
  if shardings is None:
    args, jit_options = on_device(tuple(abstract_args), device), {}
  else:
    place = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    args = tuple(jax.tree.map(place, a, sh) for a, sh in zip(abstract_args, shardings))
    device = next(iter(jax.tree.leaves(shardings[0])[0].device_set))  # Sets the platform.
    jit_options = {"out_shardings": out_shardings}
  options = dict(_COMPILER_OPTIONS[_PLATFORM_OF_DEVICE[device.platform]])
  with quant_linear.lowering_for(device.platform):
    lowered = jax.jit(fn, donate_argnums=tuple(donate), keep_unused=keep_unused,
                      **jit_options).lower(*args)
  return functools.partial(lowered.compile, options)


def compile_report(fn: Callable, abstract_args: Sequence[Any], device: jax.Device | None, *,
                   donate: Sequence[int] = (), name: str | None = None,
                   shardings: Sequence[Any] | None = None, out_shardings: Any = None,
                   ) -> dict[str, Any]:
  """Compiles `fn(*abstract_args)` for `device` (see `lower`) and reports it: {name, compiled,
  error, argument_bytes, temp_bytes, output_bytes, alias_bytes, host_argument_bytes,
  host_output_bytes, seconds, lower_seconds}. The error is the compiler's message (None when it
  compiled), the byte counts come from `memory_analysis()` (None on failure; per device over a
  mesh; the first four in device memory, the host ones in host memory: a page copy's),
  `seconds` is the compile's wall time and `lower_seconds` the lowering's (tracing included)."""
  lowering = functools.partial(lower, fn, abstract_args, device, donate=donate,
                               shardings=shardings, out_shardings=out_shardings)
  return compile_reports([(name or getattr(fn, "__name__", "program"), lowering)])[0]


def compile_reports(lowerings: Sequence[tuple[str, Callable[[], Callable[[], Any]]]],
                    workers: int = 1) -> list[dict[str, Any]]:
  """The report of each (name, lowering): a call that lowers a program and returns its compile
  (a `lower` bound to its arguments). Lowering is Python, so it runs here, one after another;
  the compiles run on `workers` threads (XLA compiles without the GIL), each starting as soon
  as its program is lowered, so the next program lowers while the last ones compile."""
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    pending = []
    for name, lowering in lowerings:
      start = time.perf_counter()
      try:
        compile_fn = lowering()
      except Exception as e:  # A lowering error is the program's report too.
        pending.append(_report(name, e))
        continue
      lowered = time.perf_counter() - start
      pending.append(pool.submit(_compiled_report, name, compile_fn, lowered))
    return [p if isinstance(p, dict) else p.result() for p in pending]


def _compiled_report(name: str, compile_fn: Callable[[], Any], lowered: float) -> dict[str, Any]:
  start = time.perf_counter()
  try:
    memory = compile_fn().memory_analysis()
  except Exception as e:  # The compiler's verdict is the report: RESOURCE_EXHAUSTED, VMEM, ...
    memory = e
  return _report(name, memory, time.perf_counter() - start, lowered)


def _report(name: str, memory_or_error, seconds: float = 0.0, lowered: float = 0.0
            ) -> dict[str, Any]:
  report = {"name": name, "compiled": False, "error": None, "argument_bytes": None,
            "temp_bytes": None, "output_bytes": None, "alias_bytes": None,
            "host_argument_bytes": None, "host_output_bytes": None,
            "seconds": round(seconds, 1), "lower_seconds": round(lowered, 1)}
  if isinstance(memory_or_error, Exception):
    e = memory_or_error
    return {**report, "error": f"{type(e).__name__}: {e}"}
  m = memory_or_error
  return {**report, "compiled": True, "argument_bytes": m.argument_size_in_bytes,
          "temp_bytes": m.temp_size_in_bytes, "output_bytes": m.output_size_in_bytes,
          "alias_bytes": m.alias_size_in_bytes,
          "host_argument_bytes": m.host_argument_size_in_bytes,
          "host_output_bytes": m.host_output_size_in_bytes}

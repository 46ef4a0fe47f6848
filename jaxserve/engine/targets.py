"""Real TPU and GPU chips as compile-only devices on a machine that has neither.

XLA's TPU compiler (libtpu, from `pip install 'jax[tpu]'`) and GPU compiler (the CUDA plugin) both
run on a CPU-only host when handed an abstract device: `jax.experimental.topologies` builds one
from a topology name (TPU) or from an XLA `GpuTargetConfigProto` text (GPU, `gpu_specs/`).
`jax.jit(f).lower(args placed on it).compile()` then runs the whole compiler, Mosaic and Triton
kernels included, and `memory_analysis()` says what the program needs on that chip. Nothing is
allocated: the arguments are `jax.ShapeDtypeStruct`s.

  TARGETS          the chips (planning/chips.py: a host-side table, so `jaxserve plan` needs no jax)
  abstract_device  a compile-only device of a target
  compile_report   compiles one function there: compiled or the compiler's error, and its memory
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
from typing import Any, Callable, Sequence

import jax
from jax.experimental import topologies

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
      return "the CUDA plugin is not installed (see README: compiling for GPU)"
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


def compile_report(fn: Callable, abstract_args: Sequence[Any], device: jax.Device | None, *,
                   donate: Sequence[int] = (), name: str | None = None,
                   shardings: Sequence[Any] | None = None, out_shardings: Any = None,
                   ) -> dict[str, Any]:
  """Compiles `fn(*abstract_args)` for `device` and reports it.

  `abstract_args` are pytrees of arrays or ShapeDtypeStructs (placed on `device` here, or, for a
  program over a mesh of abstract devices, on `shardings`: one pytree of shardings per argument,
  with `out_shardings` for the results; byte counts are then per device); arguments `donate`
  are donated, as the engine donates its cache and state. Returns {name, compiled,
  error, argument_bytes, temp_bytes, output_bytes, alias_bytes}: the error is the compiler's
  message (None when it compiled), the byte counts come from `memory_analysis()` (None on failure).
  """
  report = {"name": name or getattr(fn, "__name__", "program"), "compiled": False, "error": None,
            "argument_bytes": None, "temp_bytes": None, "output_bytes": None, "alias_bytes": None}
  if shardings is None:
    args, jit_options = on_device(tuple(abstract_args), device), {}
  else:
    placed = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    args = tuple(jax.tree.map(placed, a, sh) for a, sh in zip(abstract_args, shardings))
    device = jax.tree.leaves(shardings[0])[0].mesh.devices.flat[0]
    jit_options = {"out_shardings": out_shardings}
  options = dict(_COMPILER_OPTIONS[_PLATFORM_OF_DEVICE[device.platform]])
  try:
    lowered = jax.jit(fn, donate_argnums=tuple(donate), **jit_options).lower(*args)
    memory = lowered.compile(options).memory_analysis()
  except Exception as e:  # The compiler's verdict is the report: RESOURCE_EXHAUSTED, VMEM, ...
    report["error"] = f"{type(e).__name__}: {e}"
    return report
  report.update(compiled=True, argument_bytes=memory.argument_size_in_bytes,
                temp_bytes=memory.temp_size_in_bytes, output_bytes=memory.output_size_in_bytes,
                alias_bytes=memory.alias_size_in_bytes)
  return report

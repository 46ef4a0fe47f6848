"""Real TPU and GPU chips as compile-only devices on a machine that has neither.

XLA's TPU compiler (libtpu, from `pip install 'jax[tpu]'`) and GPU compiler (the CUDA plugin) both
run on a CPU-only host when handed an abstract device: `jax.experimental.topologies` builds one
from a topology name (TPU) or from an XLA `GpuTargetConfigProto` text (GPU, `gpu_specs/`).
`jax.jit(f).lower(args placed on it).compile()` then runs the whole compiler, Mosaic and Triton
kernels included, and `memory_analysis()` says what the program needs on that chip. Nothing is
allocated: the arguments are `jax.ShapeDtypeStruct`s.

  TARGETS          the chips, with their memory per device and where each figure comes from
  abstract_device  a compile-only device of a target
  compile_report   compiles one function there: compiled or the compiler's error, and its memory
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.util
import os
import pathlib
import types
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.experimental import topologies

_SPECS = pathlib.Path(__file__).parent / "gpu_specs"


class Platform(enum.Enum):
  TPU = "tpu"
  CUDA = "cuda"


@dataclasses.dataclass(frozen=True)
class Target:
  """One chip. `memory_bytes` is the published memory per device; `usable_bytes` what a program
  may use there, the figure the pool is sized from (on a chip: memory_stats()["bytes_limit"])."""

  name: str
  platform: Platform
  memory_bytes: int
  memory_source: str
  usable_bytes: int
  usable_source: str
  topology: str  # TPU: a topology name (the smallest slice; we use one device of it).
  spec: str | None = None  # CUDA: the GpuTargetConfigProto file in gpu_specs/.
  topology_options: Mapping[str, str] = dataclasses.field(default_factory=dict)


GIB = 2**30
# libtpu 0.0.42.1's own limit: the largest buffer it compiles for one device, found by bisection
# to 1 MiB (tests/test_targets.py checks it still holds); its error message rounds the same
# figure, e.g. "exceeds available HBM (15.75G)" on v5e.
_LIBTPU = "largest buffer libtpu 0.0.42.1 compiles on one device (bisected to 1 MiB)"
_XLA_SPEC = "device_memory_size of XLA's spec, measured on the chip (gpu_specs/{})"

TARGETS = types.MappingProxyType({t.name: t for t in (
    Target("v5e", Platform.TPU, 16 * GIB, "cloud.google.com/tpu/docs/v5e: HBM2 16 GB per chip",
           16_908_288_000, _LIBTPU, "v5e:2x2"),
    Target("v6e", Platform.TPU, 32 * GIB, "cloud.google.com/tpu/docs/v6e: HBM 32 GB per chip",
           33_549_189_120, _LIBTPU, "v6e:2x2"),
    Target("v5p", Platform.TPU, 95 * GIB,
           "cloud.google.com/tpu/docs/v5p: HBM 95 GiB per chip (one device: megacore)",
           102_802_391_040, _LIBTPU, "v5p:2x2x1"),
    # v4's two TensorCores are one device with 32 GiB ("megacore", as a v4 VM runs); the
    # topology's default makes a device per core with 15.25 GiB each.
    Target("v4", Platform.TPU, 32 * GIB, "cloud.google.com/tpu/docs/v4: HBM2 32 GiB per chip",
           33_013_366_784, _LIBTPU, "v4:2x2x1", topology_options={"chip_config_name": "megacore"}),
    Target("h100", Platform.CUDA, 80 * 10**9, "NVIDIA H100 SXM datasheet: 80 GB HBM3",
           84_942_979_072, _XLA_SPEC.format("h100_sxm.txtpb"), "1x1x1", "h100_sxm.txtpb"),
    Target("h200", Platform.CUDA, 141 * 10**9, "NVIDIA H200 datasheet: 141 GB HBM3e",
           151_397_597_184, _XLA_SPEC.format("h200.txtpb"), "1x1x1", "h200.txtpb"),
)})

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


@functools.cache
def abstract_device(name: str) -> jax.Device:
  """A compile-only device of target `name`: one chip, alone in its sharding."""
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
  return topology.devices[0]


def on_device(tree: Any, device: jax.Device) -> Any:
  """The arrays (or ShapeDtypeStructs) of `tree` as ShapeDtypeStructs placed on `device`."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def compile_report(fn: Callable, abstract_args: Sequence[Any], device: jax.Device, *,
                   donate: Sequence[int] = (), name: str | None = None) -> dict[str, Any]:
  """Compiles `fn(*abstract_args)` for `device` and reports it.

  `abstract_args` are pytrees of arrays or ShapeDtypeStructs (placed on `device` here); arguments
  `donate` are donated, as the engine donates its cache and state. Returns {name, compiled,
  error, argument_bytes, temp_bytes, output_bytes, alias_bytes}: the error is the compiler's
  message (None when it compiled), the byte counts come from `memory_analysis()` (None on failure).
  """
  report = {"name": name or getattr(fn, "__name__", "program"), "compiled": False, "error": None,
            "argument_bytes": None, "temp_bytes": None, "output_bytes": None, "alias_bytes": None}
  options = dict(_COMPILER_OPTIONS[_PLATFORM_OF_DEVICE[device.platform]])
  try:
    lowered = jax.jit(fn, donate_argnums=tuple(donate)).lower(*on_device(tuple(abstract_args), device))
    memory = lowered.compile(options).memory_analysis()
  except Exception as e:  # The compiler's verdict is the report: RESOURCE_EXHAUSTED, VMEM, ...
    report["error"] = f"{type(e).__name__}: {e}"
    return report
  report.update(compiled=True, argument_bytes=memory.argument_size_in_bytes,
                temp_bytes=memory.temp_size_in_bytes, output_bytes=memory.output_size_in_bytes,
                alias_bytes=memory.alias_size_in_bytes)
  return report

"""The chips `jaxserve plan --compile` compiles for: memory per device, and where each figure
comes from. Host-side data; compiling/targets.py turns a chip into a compile-only device."""

from __future__ import annotations

import dataclasses
import types
from typing import Mapping

from jaxserve.config import Platform


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
  spec: str | None = None  # GPU: XLA's GpuTargetConfigProto file in compiling/gpu_specs/.
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
    Target("h100", Platform.GPU, 80 * 10**9, "NVIDIA H100 SXM datasheet: 80 GB HBM3",
           84_942_979_072, _XLA_SPEC.format("h100_sxm.txtpb"), "1x1x1", "h100_sxm.txtpb"),
    Target("h200", Platform.GPU, 141 * 10**9, "NVIDIA H200 datasheet: 141 GB HBM3e",
           151_397_597_184, _XLA_SPEC.format("h200.txtpb"), "1x1x1", "h200.txtpb"),
)})

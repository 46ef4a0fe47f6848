"""Which variant of a kernel runs: the TPU one (Mosaic), the GPU one (Triton), or on CPU the TPU
one in interpret mode."""

from __future__ import annotations

import enum

import jax


class Platform(enum.Enum):
  TPU = "tpu"
  GPU = "gpu"
  CPU = "cpu"  # No kernel compiler: the TPU variant in interpret mode.


def resolve(platform: str | Platform | None, interpret: bool | None) -> tuple[Platform, bool]:
  """The variant to run and whether to interpret it. platform None: jax.default_backend();
  interpret None: only on CPU, where no kernel can be compiled."""
  if platform is None:
    platform = jax.default_backend()
  try:
    platform = Platform(platform)
  except ValueError:
    raise ValueError(f"platform must be one of {[p.value for p in Platform]} or None, "
                     f"got {platform!r}") from None
  return platform, (platform is Platform.CPU) if interpret is None else bool(interpret)

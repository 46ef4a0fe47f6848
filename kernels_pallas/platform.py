"""Which variant of a kernel runs: the TPU one (Mosaic), the GPU one (Triton), or on CPU the TPU
one in interpret mode. Platform is jaxserve's one enum of JAX backends (jaxserve/config/engine.py,
a lower layer)."""

from __future__ import annotations

import jax

from jaxserve.config import Platform


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

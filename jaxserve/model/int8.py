"""int8 per output channel (`--quantization int8`): the one place its numbers are written, below
both the loader (loading/quantize.py, numpy) and a weight update (engine/weight_update.py, numpy
or jax.numpy inside a compiled program), so the two store the same bytes."""

from __future__ import annotations

import numpy as np


def symmetric(w, in_axes: tuple[int, ...], xp=np) -> tuple:
  """(values int8, scale float32) of float32 `w`, symmetric over `in_axes` (a group's axis, or
  every input axis: per output channel): scale = max |w| / 127, so the largest weight maps to
  +-127. `xp`: numpy or jax.numpy."""
  amax = xp.max(xp.abs(w), axis=in_axes, keepdims=True)
  scale = xp.where(amax == 0, 1, amax / 127).astype(xp.float32)
  values = xp.clip(xp.rint(w / scale), -127, 127).astype(xp.int8)
  return values, scale

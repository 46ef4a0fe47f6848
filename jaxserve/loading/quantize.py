"""Turning a parameter pytree (numpy, `weights.to_params`' layout) into the stored form a
quantization mode asks for, and back: int8 per output channel from float weights, and float
weights from quantized ones (for `--quantization none` on a quantized source).

A quantized weight is {"values": int8, "scale": float32[, "minimum": float32]}, the arrays of
model/quant.py's `Quantized` (its docstring has the layout).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from jaxserve.loading.gguf_blocks import Blocks
from jaxserve.model.quant import IN_AXES, STACKED


def _weights(params: dict):
  """(container, name, lead) of every quantizable weight present: lead 1 under `layers` (the
  stacked [L] axis)."""
  for name in IN_AXES:
    holder, lead = (params["layers"], 1) if name in STACKED else (params, 0)
    if name in holder:
      yield holder, name, lead


def int8(w: np.ndarray, in_axes: tuple[int, ...]) -> dict:
  """Symmetric int8 per output channel: scale = max |w| over the input axes / 127, so every
  channel uses the whole int8 range (round to nearest)."""
  w = np.asarray(w, np.float32)
  scale = np.max(np.abs(w), axis=in_axes, keepdims=True) / 127
  scale = np.where(scale == 0, 1, scale).astype(np.float32)
  values = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
  return {"values": values, "scale": scale}


def to_int8(params: dict) -> dict:
  """Every matrix int8 per output channel (a quantized one dequantized first)."""
  params = to_float(params)
  for holder, name, lead in _weights(params):
    holder[name] = int8(holder[name], tuple(a + lead for a in IN_AXES[name]))
  return params


def dequantize(w: Mapping) -> np.ndarray:
  """A stored quantized weight -> float32, exactly model/quant.py's `dequant` (and, for GGUF
  blocks, gguf's numbers)."""
  values, scale = np.asarray(w["values"]), np.asarray(w["scale"], np.float32)
  minimum = w.get("minimum")
  for axis, (v, s) in enumerate(zip(values.shape, scale.shape)):
    if s not in (1, v):
      scale = np.repeat(scale, v // s, axis=axis)
      minimum = None if minimum is None else np.repeat(np.asarray(minimum), v // s, axis=axis)
  out = values.astype(np.float32) * scale
  return out if minimum is None else out + np.asarray(minimum, np.float32)


def to_float(params: dict) -> dict:
  """Every quantized matrix as float32 (a copy of the containers; float arrays are shared)."""
  params = {**params, "layers": dict(params["layers"])}
  for holder, name, _ in _weights(params):
    if isinstance(holder[name], Mapping):
      holder[name] = dequantize(holder[name])
  return params


def from_blocks(w: Blocks) -> dict:
  """gguf_blocks.Blocks (already in our layout) -> the stored form."""
  out = {"values": w.values, "scale": w.scale}
  if w.minimum is not None:
    out["minimum"] = w.minimum
  return out


def is_quantized(params: dict) -> bool:
  return any(isinstance(holder[name], Mapping) for holder, name, _ in _weights(params))

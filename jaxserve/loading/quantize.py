"""Turning a parameter pytree (numpy, `weights.to_params`' layout) into the stored form a
quantization mode asks for, and back: int8 per output channel from float weights, and float
weights from quantized ones (for `--quantization none` on a quantized source).

A quantized weight is {"values": int8, "scale": float32[, "minimum": float32]}, the arrays of
model/quant.py's `Quantized` (its docstring has the layout).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxserve.loading.gguf_blocks import Blocks
from jaxserve.model import int8 as int8_numbers
from jaxserve.model.quant import IN_AXES, STACKED, Layout


def _weights(params: dict):
  """(container, name, lead) of every quantizable weight present: lead 1 under `layers` (the
  stacked [L] axis)."""
  for name in IN_AXES:
    holder, lead = (params["layers"], 1) if name in STACKED else (params, 0)
    if name in holder:
      yield holder, name, lead


PER_CHANNEL = Layout(None)


def int8(w: np.ndarray, in_axes: tuple[int, ...], layout: Layout = PER_CHANNEL) -> dict:
  """int8 in `layout`: per output channel (group None) or per `layout.group` elements of the last
  input axis. Symmetric, scale = max |w| / 127, so the largest weight maps to +-127; with a
  minimum (asymmetric), scale = (max - min) / 255 and the group's minimum maps to -128."""
  w = np.asarray(w, np.float32)
  x, axes = w, in_axes
  if layout.group is not None:  # [..., In, ...] -> [..., In / g, g, ...]: reduce over the g.
    a = in_axes[-1]
    x = w.reshape(w.shape[:a] + (w.shape[a] // layout.group, layout.group) + w.shape[a + 1:])
    axes = (a + 1,)
  sshape = layout.scale_shape(w.shape, in_axes)
  if layout.has_min:
    lo, hi = x.min(axes, keepdims=True), x.max(axes, keepdims=True)
    scale = np.where(hi > lo, (hi - lo) / 255, 1).astype(np.float32)
    values = np.clip(np.rint((x - lo) / scale) - 128, -128, 127).astype(np.int8)
    minimum = (lo + 128 * scale).astype(np.float32)
    return {"values": values.reshape(w.shape), "scale": scale.reshape(sshape),
            "minimum": minimum.reshape(sshape)}
  values, scale = int8_numbers.symmetric(x, axes)
  return {"values": values.reshape(w.shape), "scale": scale.reshape(sshape)}


def to_int8(params: dict, layouts: Mapping[str, Layout] | None = None) -> dict:
  """Every matrix int8 (a quantized one dequantized first): per output channel, what
  `--quantization int8` stores, or in its layout of `layouts` (a weight absent stays float32;
  scripts/quality.py sweep measures the other layouts)."""
  layouts = {name: PER_CHANNEL for name in IN_AXES} if layouts is None else layouts
  params = to_float(params)
  for holder, name, lead in _weights(params):
    if name in layouts:
      holder[name] = int8(holder[name], tuple(a + lead for a in IN_AXES[name]), layouts[name])
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

"""Quantized weights: integer values with a float scale (and optionally a float minimum) per group
of input elements or per output channel, dequantized inside the compiled step.

Shape letters: the key in jaxserve/model/__init__.py.

A weight keeps its float layout (wq [D, N, H], embed [V, D], ...) for its int8 `values`; `scale`
and `minimum` have the same rank, each input axis shortened to its number of groups (the last
input axis split into groups of `group`; per output channel: every input axis 1). So a weight is
`values * scale + minimum` with each scale broadcast over its group: GGUF's blocks exactly
(loading/gguf_blocks.py), or int8 per output channel (loading/quantize.py). Decode reads every
weight each step, so reading 8 bits instead of 32 (or 16) is the speed; the float weight exists
only inside the step, one layer at a time (XLA fuses the dequantization into the dot's operand).
A matmul with such a weight, XLA's or the CPU kernel's, is quant_linear.py's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels_cpu
import kernels_cpu.reference
from jaxserve.config import Quantization

# Each quantizable weight's input axes in its float layout (without the stacked [L] axis): the
# axes a dot reduces over, the ones GGUF's blocks run along.
IN_AXES = {
    "embed": (1,),  # [V, D]: a row per token; tied, the LM head reduces over D.
    "lm_head": (0,),  # [D, V]
    "wq": (0,), "wk": (0,), "wv": (0,),  # [D, N|K, H]
    "wo": (0, 1),  # [N, H, D]
    "w_gate": (0,), "w_up": (0,),  # [D, F]
    "w_down": (0,),  # [F, D]
}
STACKED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # Under params["layers"].


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one weight is stored: `group` input elements share a scale (None: per output channel,
  one scale over all input axes), whether each group has a minimum too, `bits`: 8 (int8
  values) or 4 (values in [0, 16) two a byte along the last input axis, uint8: the CPU kernel's
  packed form, kernels_cpu.reference.packed), and `tiled`: the arrays, as the [K, N] matrix
  the kernel reads (a stacked layer's one layer; the tied embedding [V, D] as the head, [D, V]),
  stored in tiles of 64 output columns, its streaming order (kernels_cpu.reference.tiled), the
  shapes unchanged."""

  group: int | None = None
  has_min: bool = False
  bits: int = 8
  tiled: bool = False

  def scale_shape(self, shape: tuple[int, ...], in_axes: tuple[int, ...]) -> tuple[int, ...]:
    out = list(shape)
    for a in in_axes:
      if self.group is None:
        out[a] = 1
      elif a == in_axes[-1]:
        if shape[a] % self.group:
          raise ValueError(f"groups of {self.group} do not divide an input axis of {shape[a]}")
        out[a] = shape[a] // self.group
    return tuple(out)


Layouts = Mapping[str, Layout]  # Weight name (IN_AXES' keys) -> its layout; absent: float.


class Quantized(nnx.Module):
  """One quantized weight: values (int8, the float layout; or packed, uint8 with its last input
  axis `packed_axis` halved), scale and minimum (float32).

  `layer`: None, or (set by llama.run_layers when the scan hands the arrays over whole, [L, ...],
  for the CPU kernel to read in place) the traced index of the layer this step reads. `tiled`:
  the arrays hold tiles of [K, N] (K: the input axes; trailing, as the embedding's, the matrix
  is the transpose)."""

  layer = None
  # Whether the CPU kernel multiplies it with int8 activations (EngineConfig.cpu_activations, set
  # by quant_linear.with_activations on the engine's own view of the model): static, compiled in.
  int8_activations = False

  def __init__(self, shape, names, layout: Layout, in_axes: tuple[int, ...]):
    sshape = layout.scale_shape(tuple(shape), in_axes)
    # An axis shortened to 1 is not split over devices; any other keeps its weight's name, so
    # the scales of a head or an MLP column sit on the device that holds its values.
    snames = tuple(None if s == 1 and n != 1 else name for s, n, name in zip(sshape, shape, names))
    param = lambda value, names: nnx.Param(value, out_sharding=names, eager_sharding=False)
    self.packed_axis = in_axes[-1] if layout.bits == 4 else None
    self.tiled, self.in_axes = layout.tiled, in_axes
    if self.packed_axis is not None:
      shape = tuple(n // 2 if a == self.packed_axis else n for a, n in enumerate(shape))
    self.values = param(jnp.zeros(shape, jnp.uint8 if layout.bits == 4 else jnp.int8), names)
    self.scale = param(jnp.ones(sshape, jnp.float32), snames)
    if layout.has_min:
      self.minimum = param(jnp.zeros(sshape, jnp.float32), snames)


def weight(name: str, layouts: Layouts | None, make_float, shape, names) -> nnx.Param | Quantized:
  """The float Param `make_float()`, or a Quantized weight when `layouts` names this one."""
  layout = (layouts or {}).get(name)
  if layout is None:
    return make_float()
  return Quantized(shape, names, layout, IN_AXES[name])


def arrays(w: Quantized) -> tuple:
  """(values, scale, minimum or None) of w's one matrix (layer `w.layer` of stacked arrays)."""
  out = (w.values[...], w.scale[...], w.minimum[...] if hasattr(w, "minimum") else None)
  if w.layer is not None:
    out = tuple(None if a is None else jax.lax.dynamic_index_in_dim(a, w.layer, keepdims=False)
                for a in out)
  if w.tiled:
    out = tuple(None if a is None else _untiled(w, a) for a in out)
  if w.packed_axis is None:
    return out
  return (kernels_cpu.reference.unpacked(out[0], w.packed_axis), *out[1:])


def _untiled(w: Quantized, a):
  """One matrix's array of w (a layer's, or the embedding) in its float layout again."""
  K = math.prod(a.shape[a.ndim - len(w.in_axes):] if w.in_axes[0] else a.shape[:len(w.in_axes)])
  kn = kernels_cpu.reference.untiled(a.reshape(K, -1))
  return (kn if w.in_axes[0] == 0 else kn.T).reshape(a.shape)


def is_stored(path, _) -> bool:
  """An nnx filter: the arrays of a stacked layer's quantized weights (run_layers keeps them
  whole)."""
  return len(path) >= 2 and path[-2] in STACKED and path[-1] in ("values", "scale", "minimum")


def read_layer(layer: nnx.Module, index) -> None:
  """Marks each quantized weight of `layer` (holding whole [L, ...] arrays) to read `index`."""
  for name in STACKED:
    w = getattr(layer, name, None)
    if isinstance(w, Quantized):
      w.layer = index


def dequant(w: Quantized, dtype):
  """values * scale + minimum in float32 (exactly gguf's numbers), then cast to `dtype`."""
  values, scale, minimum = arrays(w)
  # The grouped axis, if any: shortened, but not to 1 (a per-channel scale broadcasts as is).
  split = [a for a, (v, s) in enumerate(zip(values.shape, scale.shape)) if s not in (1, v)]
  x = values.astype(jnp.float32)
  if split:
    a = split[0]
    groups = scale.shape[a]
    grouped = values.shape[:a] + (groups, values.shape[a] // groups) + values.shape[a + 1:]
    x = x.reshape(grouped)
    scale = jnp.expand_dims(scale, a + 1)
    minimum = None if minimum is None else jnp.expand_dims(minimum, a + 1)
  x = x * scale
  if minimum is not None:
    x = x + minimum
  return x.reshape(values.shape).astype(dtype)


def value(w: nnx.Param | Quantized, dtype):
  """A weight as an array of `dtype`: a float Param as it is stored, a Quantized one
  dequantized."""
  if isinstance(w, Quantized):
    return dequant(w, dtype)
  return w[...]


def embed(ids, w: nnx.Param | Quantized, dtype):
  """ids [...] -> rows [..., D] of the embedding [V, D]: only the rows asked for are
  dequantized."""
  if not isinstance(w, Quantized):
    return w[...][ids]
  take = lambda a: a[...][ids]
  if w.tiled:  # Row v of [V, X] is column v of the head's [X, V], in tile v // 64.
    tile = kernels_cpu.reference.TILE
    take = lambda a: a[...].reshape(-1, a.shape[1], tile)[ids // tile, :, ids % tile]
  rows = take(w.values).astype(jnp.float32) * jnp.repeat(take(w.scale), _group(w), -1)
  if hasattr(w, "minimum"):
    rows = rows + jnp.repeat(take(w.minimum), _group(w), -1)
  return rows.astype(dtype)


def _group(w: Quantized) -> int:
  return w.values.shape[-1] // w.scale.shape[-1]


# The layout `plan --compile` and the planner assume for GGUF blocks without a file to read: a
# 4-bit block type's (Q4_1, Q4_K), a scale and a minimum per 32 values.
GGUF_LAYOUT = Layout(32, has_min=True)


def layouts_for(mode: Quantization) -> dict[str, Layout] | None:
  """Every weight in one layout, for a model built from a config alone (`plan --compile`):
  int8 per output channel, or GGUF_LAYOUT; None (float) for none and auto (a config has no
  blocks)."""
  layout = {Quantization.INT8: Layout(None), Quantization.GGUF: GGUF_LAYOUT}.get(mode)
  return None if layout is None else {name: layout for name in IN_AXES}


def layouts_of(params: Mapping, tiled: frozenset[str] = frozenset()) -> dict[str, Layout]:
  """The layouts a parameter pytree (numpy or jax; `weights.to_params`' layout) stores: a weight
  held as {"values", "scale"[, "minimum"]} is quantized; those named in `tiled` are in tiles
  (model/kernel_forms.py: the shapes do not tell)."""
  found = {}
  for name, in_axes in IN_AXES.items():
    w = params.get("layers", {}).get(name) if name in STACKED else params.get(name)
    if not isinstance(w, Mapping):
      continue
    lead = 1 if name in STACKED else 0  # The stacked [L] axis.
    values, scale = w["values"].shape, w["scale"].shape
    bits = 4 if w["values"].dtype == np.uint8 else 8
    if all(scale[a + lead] == 1 for a in in_axes):
      group = None
    else:
      last = in_axes[-1] + lead
      group = values[last] * (8 // bits) // scale[last]
    found[name] = Layout(group, "minimum" in w, bits, name in tiled)
  return found


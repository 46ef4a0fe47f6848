"""The jnp reference of qmatmul: dequantize to float32, then one dot."""

from __future__ import annotations

import jax.numpy as jnp


def dequantized(values, scale, minimum, *, nk: bool):
  """values * scale + minimum, float32, each scale repeated over its group of inputs: [K, N]
  (kn) or [N, K] (nk)."""
  axis = 1 if nk else 0
  group = values.shape[axis] // scale.shape[axis]
  w = values.astype(jnp.float32) * jnp.repeat(scale, group, axis)
  return w if minimum is None else w + jnp.repeat(minimum, group, axis)


def qmatmul_reference(x_MK, values, scale, minimum=None, *, nk: bool = False, layer=None):
  """y [M, N] = x [M, K] @ W, as qmatmul (one matrix, or `layer` of a stacked [L, ...] one)."""
  if layer is not None:
    values, scale = values[layer], scale[layer]
    minimum = None if minimum is None else minimum[layer]
  w = dequantized(values, scale, minimum, nk=nk)
  spec = "MK,NK->MN" if nk else "MK,KN->MN"
  return jnp.einsum(spec, x_MK.astype(jnp.float32), w, preferred_element_type=jnp.float32)

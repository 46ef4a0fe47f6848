"""The jnp reference of qmatmul: dequantize to float32, then one dot. And the kernel's storage
forms with their inverses: 4-bit values packed two a byte, and kn arrays in tiles of 64 columns."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def packed(values: np.ndarray, axis: int) -> np.ndarray:
  """Values in [0, 16) (int8) -> uint8 with `axis` halved: pair j of that axis (elements 2j and
  2j + 1) in the low and high 4 bits of byte j."""
  if values.min(initial=0) < 0 or values.max(initial=0) > 15 or values.shape[axis] % 2:
    raise ValueError(f"packing needs values in [0, 16) and an even axis {axis} of {values.shape}")
  v = np.moveaxis(values.astype(np.uint8), axis, 0)
  return np.moveaxis(v[0::2] | (v[1::2] << 4), 0, axis)


def unpacked(values, axis: int):
  """packed's inverse, int8, in jnp (inside a compiled step)."""
  pairs = jnp.stack([values & 15, values >> 4], axis=axis + 1)
  shape = values.shape[:axis] + (2 * values.shape[axis],) + values.shape[axis + 1:]
  return pairs.reshape(shape).astype(jnp.int8)


TILE = 64  # Output columns a task of the kernel computes: one tile's run (qmatmul.cc).


def tiled(a: np.ndarray) -> np.ndarray:
  """A kn array [..., R, N] (values, scales or minima) in the kernel's tiled order, same shape:
  its memory holds [..., N / 64, R, 64], so the rows of one task's 64 columns are one run."""
  *lead, R, N = a.shape
  if N % TILE:
    raise ValueError(f"tiles of {TILE} columns do not divide N = {N}")
  return np.ascontiguousarray(a.reshape(*lead, R, N // TILE, TILE).swapaxes(-3, -2)).reshape(
      a.shape)


def untiled(a):
  """tiled's inverse, in jnp (inside a compiled step)."""
  *lead, R, N = a.shape
  return a.reshape(*lead, N // TILE, R, TILE).swapaxes(-3, -2).reshape(a.shape)


def dequantized(values, scale, minimum, *, nk: bool):
  """values * scale + minimum, float32, each scale repeated over its group of inputs: [K, N]
  (kn) or [N, K] (nk); values uint8 are packed (kn: along K)."""
  axis = 1 if nk else 0
  if values.dtype == jnp.uint8:
    values = unpacked(values, axis)
  group = values.shape[axis] // scale.shape[axis]
  w = values.astype(jnp.float32) * jnp.repeat(scale, group, axis)
  return w if minimum is None else w + jnp.repeat(minimum, group, axis)


def qmatmul_reference(x_MK, values, scale, minimum=None, *, nk: bool = False, layer=None,
                      tiled: bool = False):
  """y [M, N] = x [M, K] @ W, as qmatmul (one matrix, or `layer` of a stacked [L, ...] one)."""
  if layer is not None:
    values, scale = values[layer], scale[layer]
    minimum = None if minimum is None else minimum[layer]
  if tiled:
    values, scale = untiled(values), untiled(scale)
    minimum = None if minimum is None else untiled(minimum)
  w = dequantized(values, scale, minimum, nk=nk)
  spec = "MK,NK->MN" if nk else "MK,KN->MN"
  return jnp.einsum(spec, x_MK.astype(jnp.float32), w, preferred_element_type=jnp.float32)


BLOCK = 32  # Inputs sharing one int8 activation scale (qmatmul.h's kBlock).


def quantized_rows(x_MK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """x [M, K] float32 -> (q [M, K] int8, d [M, K / 32] float32), x ~ d * q per block of 32, as
  the kernel's int8 activation mode quantizes it (float32 steps, rounding to nearest even)."""
  M, K = x_MK.shape
  xb = np.asarray(x_MK, np.float32).reshape(M, K // BLOCK, BLOCK)
  amax = np.abs(xb).max(-1)
  d = amax / np.float32(127)
  inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
  q = np.rint(xb * inverse[..., None]).astype(np.int8)
  return q.reshape(M, K), d


def qmatmul_int8_reference(x_MK, values, scale, minimum=None, *, nk: bool = False, layer=None,
                           tiled: bool = False) -> np.ndarray:
  """y [M, N] (float64) as qmatmul with int8_activations: x quantized by quantized_rows, each
  block's products summed as integers, times x's block scale and the weight's group scale,
  plus the group's minimum times sum(d * q) over the group."""
  values, scale = np.asarray(values), np.asarray(scale)
  minimum = None if minimum is None else np.asarray(minimum)
  if layer is not None:
    values, scale = values[layer], scale[layer]
    minimum = None if minimum is None else minimum[layer]
  if tiled:
    values, scale, minimum = (None if a is None else np.asarray(untiled(a))
                              for a in (values, scale, minimum))
  if values.dtype == np.uint8:
    values = np.asarray(unpacked(values, 0))
  if nk:
    values, scale = values.T, scale.T
    minimum = None if minimum is None else minimum.T
  q, d = quantized_rows(np.asarray(x_MK))
  (M, K), N = q.shape, values.shape[1]
  B = K // BLOCK
  dots = np.einsum("MBk,BkN->MBN", q.reshape(M, B, BLOCK).astype(np.float64),
                   values.reshape(B, BLOCK, N).astype(np.float64))  # Exact integers.
  per_group = B // scale.shape[0]
  s = np.repeat(scale.astype(np.float64), per_group, axis=0)  # [B, N]
  y = np.einsum("MBN,MB,BN->MN", dots, d.astype(np.float64), s)
  if minimum is not None:
    sums = d.astype(np.float64) * q.reshape(M, B, BLOCK).sum(-1)  # [M, B]
    y += sums.reshape(M, -1, per_group).sum(-1) @ minimum.astype(np.float64)
  return y

"""GGUF's quantized blocks unpacked into integer values and per-group float scales and minima,
exactly: every block type read here stores `d * q` or `d * q + m` per small group (llama.cpp's
ggml-quants), so `values * scale + minimum` gives back gguf's own dequantized floats bit for bit.

A tensor is read as rows of `in` elements (GGUF's ne[0]: a torch [out, in] row); each row is a run
of blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) or 256 (the K-quants) elements. A K-quant's
super-block scale times its 6- or 8-bit sub-block scales becomes one float32 per sub-block of 32
(Q4_K, Q5_K) or 16 (Q6_K); the product of a float16 and a small integer is exact in float32.
"""

from __future__ import annotations

import dataclasses

import numpy as np

QK_K = 256  # Elements of a K-quant super-block.


@dataclasses.dataclass(frozen=True)
class Blocks:
  """One quantized matrix in torch layout: values [out, in] int8, scale [out, in / group] float32,
  minimum (None: zero) like scale. Dequantized: values * scale + minimum, each group's scale
  repeated over its `group` values."""

  values: np.ndarray
  scale: np.ndarray
  minimum: np.ndarray | None

  @property
  def group(self) -> int:
    return self.values.shape[-1] // self.scale.shape[-1]

  def map(self, f) -> Blocks:
    """f applied to each array (a reshape or transpose that keeps the input axis's groups)."""
    return Blocks(f(self.values), f(self.scale), None if self.minimum is None else f(self.minimum))

  def regroup(self, group: int, with_minimum: bool) -> Blocks:
    """The same numbers in smaller groups (`group` divides this one's), with a minimum array of
    zeros when asked for one: so layers of different block types stack into one array."""
    k = self.group // group
    minimum = self.minimum if self.minimum is not None else (
        np.zeros_like(self.scale) if with_minimum else None)
    repeat = lambda a: None if a is None else np.repeat(a, k, axis=-1)
    return Blocks(self.values, repeat(self.scale), repeat(minimum))

  def dequantize(self) -> np.ndarray:
    """float32 [out, in]: what gguf.quants.dequantize gives for the file's bytes."""
    rep = lambda a: np.repeat(a, self.group, axis=-1)
    out = self.values.astype(np.float32) * rep(self.scale)
    return out if self.minimum is None else out + rep(self.minimum)


def _f16(b: np.ndarray) -> np.ndarray:
  """[n, 2] bytes -> [n, 1] float32 (a float16 widens exactly)."""
  return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
  """[n, bytes] -> [n, 2 * bytes]: each run of `run` bytes holds `run` elements in its low
  nibbles, then the next `run` in its high nibbles."""
  n = qs.shape[0]
  q = qs.reshape(n, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
  return (q & 0x0F).reshape(n, -1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
  """[n, 4] bytes (one little-endian uint32) -> [n, count] bits 0..count-1."""
  word = np.ascontiguousarray(qh).view("<u4")  # [n, 1]
  return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _legacy(blocks: np.ndarray, bits: int, has_min: bool):
  """Q4_0 / Q4_1 / Q5_0 / Q5_1 / (Q8_0 apart): d [, m] [, qh] qs, 32 elements a block."""
  d = _f16(blocks[:, 0:2])
  at = 2
  m = None
  if has_min:
    m, at = _f16(blocks[:, 2:4]), 4
  q = _nibbles(blocks[:, at + (4 if bits == 5 else 0):], 16).astype(np.int16)
  if bits == 5:
    q |= _bits(blocks[:, at:at + 4], 32).astype(np.int16) << 4
  if not has_min:
    q -= 1 << (bits - 1)  # Symmetric types store q + 8 (4 bits) or q + 16 (5 bits).
  return q.astype(np.int8), d, m


def _q8_0(blocks):
  return blocks[:, 2:].copy().view(np.int8), _f16(blocks[:, 0:2]), None


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit minima [n, 8]: bytes 0-3 hold
  scales 0-3 (and the top 2 bits of scales 4-7), bytes 4-7 minima 0-3 (and the top bits of
  minima 4-7), bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and minima 4-7 (high)."""
  lo_s, lo_m, rest = s[:, 0:4], s[:, 4:8], s[:, 8:12]
  scales = np.concatenate([lo_s & 63, (rest & 15) | ((lo_s >> 6) << 4)], axis=1)
  minima = np.concatenate([lo_m & 63, (rest >> 4) | ((lo_m >> 6) << 4)], axis=1)
  return scales.astype(np.float32), minima.astype(np.float32)


def _q4_k(blocks, five_bits: bool = False):
  d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
  sc, mn = _k_scales(blocks[:, 4:16])
  at = 16 + (QK_K // 8 if five_bits else 0)
  q = _nibbles(blocks[:, at:at + QK_K // 2], 32).astype(np.uint8)  # [n, 256]
  if five_bits:
    # Bit i of high-bit byte l is the 5th bit of element l of sub-block i.
    qh = blocks[:, 16:16 + QK_K // 8]  # [n, 32]
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
    q = q | (high.reshape(q.shape) << 4)
  return q.astype(np.int8), d * sc, -(dmin * mn)


def _q6_k(blocks):
  n = blocks.shape[0]
  ql, qh = blocks[:, 0:128], blocks[:, 128:192]
  sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # [n, 16]
  d = _f16(blocks[:, 208:210])
  low = _nibbles(ql, 64).astype(np.int16)  # [n, 256]: per half of 128, 64 low nibbles then high.
  # Per half of 128: 2-bit pieces at shifts 0, 2, 4, 6 of 32 bytes cover its 4 runs of 32.
  high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
  q = (low | (high.reshape(n, QK_K).astype(np.int16) << 4)) - 32
  return q.astype(np.int8), d * sc, None


# GGUF type name -> (elements a block, bytes a block, its reader: blocks [n, bytes] ->
# (values [n, elements] int8, scale [n, groups], minimum [n, groups] or None)).
READERS = {
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, lambda b: _legacy(b, 4, False)),
    "Q4_1": (32, 20, lambda b: _legacy(b, 4, True)),
    "Q5_0": (32, 22, lambda b: _legacy(b, 5, False)),
    "Q5_1": (32, 24, lambda b: _legacy(b, 5, True)),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, lambda b: _q4_k(b, five_bits=True)),
    "Q6_K": (QK_K, 210, _q6_k),
}


def unpack(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> Blocks:
  """A GGUF tensor's raw bytes (any shape, uint8) of type `type_name` -> Blocks for the torch
  shape (out, in). Raises ValueError for a type not read here."""
  if type_name not in READERS:
    raise ValueError(f"GGUF block type {type_name} is not read in gguf mode (read: "
                     f"{', '.join(READERS)}); use --quantization none or int8")
  size, nbytes, read = READERS[type_name]
  rows, cols = shape
  blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows * cols // size, nbytes)
  values, scale, minimum = read(blocks)
  as_rows = lambda a: None if a is None else np.ascontiguousarray(a, np.float32).reshape(rows, -1)
  return Blocks(values.reshape(rows, cols), as_rows(scale), as_rows(minimum))

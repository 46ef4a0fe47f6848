"""How the KV cache stores one value: float32, bfloat16, or quantized to 8 bits.

  int8     values q in [-127, 127] and, per token and KV head, a power-of-two scale 2^e stored
           as its exponent e in one int8 (OCP Microscaling's E8M0 idea: a shared exponent per
           block, here a block is one head of one token). x ~ q * 2^e with
           e = ceil(log2(amax / 127)), so |q| <= 127 and at least half the range is used. Why a
           power of two: the exponent fits in a page row's int8 lanes beside the values (one DMA
           moves both, the kernels write it like a value), and q * 2^e is exact in bfloat16.
  float8   float8_e4m3fn or float8_e5m2 with one scale per tensor (K's, V's), as tpu-inference's
           ragged kernel takes them: stored x / scale, read back * scale. The engine uses 1.0
           (no calibration); values are clipped to the format's largest finite value first.

Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import jax.numpy as jnp

INT8_MAX = 127.0
_EXPONENT_RANGE = (-100, 100)  # Far from f32's subnormals (2^-126), which TPUs flush to 0.
FLOAT8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
STORAGE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int8), *FLOAT8)


def is_int8(dtype) -> bool:
  return jnp.dtype(dtype) == jnp.int8


def is_float8(dtype) -> bool:
  return jnp.dtype(dtype) in FLOAT8


def is_8bit(dtype) -> bool:
  return jnp.dtype(dtype).itemsize == 1


def quantize(x, dtype, scale: float = 1.0):
  """x [..., H] (one token's head on the last axis) -> (values [..., H] in `dtype`, exponents
  [...] int8 for int8, else None). `scale`: float8's per-tensor scale."""
  dtype = jnp.dtype(dtype)
  x = x.astype(jnp.float32)
  if is_int8(dtype):
    amax = jnp.max(jnp.abs(x), axis=-1)  # [...]
    e = jnp.ceil(jnp.log2(jnp.maximum(amax, 2.0 ** _EXPONENT_RANGE[0]) / INT8_MAX))
    e = jnp.clip(e, *_EXPONENT_RANGE)
    q = jnp.clip(jnp.round(x * jnp.exp2(-e)[..., None]), -INT8_MAX, INT8_MAX)
    return q.astype(jnp.int8), e.astype(jnp.int8)
  if is_float8(dtype):
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x / scale, -top, top).astype(dtype), None
  return x.astype(dtype), None


def dequantize(values, exponents=None, scale: float = 1.0):
  """The inverse of quantize, in float32: values [..., H], exponents [...] or None."""
  x = values.astype(jnp.float32)
  if exponents is not None:
    return x * jnp.exp2(exponents.astype(jnp.float32))[..., None]
  return x * scale if is_float8(values.dtype) else x

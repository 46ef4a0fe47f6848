"""The checked wrapper of qmatmul.cc: y [M, N] = x [M, K] @ (values * scale + minimum), the
weight read where it lies (int8 values, float32 scales and minima per group of G inputs).

Layouts: kn, values [K, N] with scale [K / G, N] (a layer's weights in their float layout); nk,
values [N, K] with scale [N, K / G] (the embedding read as the tied LM head); kn values may be
packed, uint8 [K / 2, N] (reference.packed: 4-bit values two a byte), and kn arrays may be
`tiled` (reference.tiled: the same shape, stored as tiles of 64 columns, N % 64 == 0), so that a
task reads its columns as one run instead of 64 bytes from each row. Either may carry a leading
[L] axis, with `layer` (an int32 scalar, traced: the scan's index) picking the matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu import library


def qmatmul(x_MK, values, scale, minimum=None, *, nk: bool = False, layer=None,
            tiled: bool = False, int8_activations: bool = False, isa: str = "auto"):
  """y [M, N] float32. Raises ValueError for shapes or dtypes the kernel does not take, or when
  the library is not built (check `library.available()` first).

  `int8_activations`: each row of x is quantized in blocks of 32 inputs to int8 with a float
  scale a block, and the products run on integers (qmatmul_int8.cc; its numpy reference is
  reference.qmatmul_int8_reference): K and the weight's groups must be multiples of 32. A row's
  result does not depend on the other rows of the call."""
  _check(x_MK, values, scale, minimum, nk, layer, tiled)
  if int8_activations:
    _check_int8(values, scale, nk)
  isa_code = library.isa_code(isa)
  N = values.shape[-2] if nk else values.shape[-1]
  call = jax.ffi.ffi_call("jaxserve_qmatmul",
                          jax.ShapeDtypeStruct((x_MK.shape[0], N), jnp.float32))
  has_min = minimum is not None
  return call(x_MK.astype(jnp.float32), values, scale,
              minimum if has_min else jnp.zeros((1,), jnp.float32),
              jnp.asarray(0 if layer is None else layer, jnp.int32),
              nk=nk, has_min=has_min, tiled=tiled, int8_x=int8_activations,
              isa=np.int64(isa_code))


def _check(x, values, scale, minimum, nk, layer, tiled):
  if tiled and (nk or values.shape[-1] % 64):
    raise ValueError(f"tiled arrays are kn with N a multiple of 64; got {values.shape}, nk={nk}")
  stacked = 1 if layer is not None else 0
  if x.ndim != 2 or values.ndim != 2 + stacked:
    raise ValueError(f"x must be [M, K] and values [{'L, ' * stacked}K, N] or "
                     f"[{'L, ' * stacked}N, K]; got {x.shape} and {values.shape}")
  is_packed = values.dtype == jnp.uint8 and not nk
  if not (values.dtype == jnp.int8 or is_packed) or scale.dtype != jnp.float32:
    raise ValueError(f"values must be int8 (or uint8, packed, kn only) and scale float32; got "
                     f"{values.dtype}{' nk' if nk else ''}, {scale.dtype}")
  K, N = (values.shape[-1], values.shape[-2]) if nk else values.shape[-2:]
  K *= 2 if is_packed else 1
  if x.shape[1] != K:
    raise ValueError(f"x has {x.shape[1]} inputs, the weight {K}")
  groups = scale.shape[-1] if nk else scale.shape[-2]
  want = values.shape[:-2] + ((N, groups) if nk else (groups, N))
  if scale.shape != want or groups == 0 or K % groups or (is_packed and (K // groups) % 2):
    raise ValueError(f"scale {scale.shape} does not group values {values.shape} "
                     f"({'nk' if nk else 'kn'}: groups must divide K = {K})")
  if minimum is not None and (minimum.shape != scale.shape or minimum.dtype != jnp.float32):
    raise ValueError(f"minimum must be float32 like scale {scale.shape}; got {minimum.shape}")


def takes_int8(values, scale, *, nk: bool = False) -> bool:
  """Whether qmatmul runs these arrays with int8 activations: K and the weight's groups are
  whole blocks of 32 (not Q6_K's groups of 16)."""
  K, group = _sizes(values, scale, nk)
  return K % BLOCK == 0 and group % BLOCK == 0


def _sizes(values, scale, nk) -> tuple[int, int]:
  """(K, inputs a scale covers)."""
  K = values.shape[-1] if nk else values.shape[-2] * (2 if values.dtype == jnp.uint8 else 1)
  return K, K // (scale.shape[-1] if nk else scale.shape[-2])


def _check_int8(values, scale, nk):
  if not takes_int8(values, scale, nk=nk):
    K, group = _sizes(values, scale, nk)
    raise ValueError(f"int8 activations need K ({K}) and the weight's group ({group}) to be "
                     f"multiples of {BLOCK}")


BLOCK = 32  # Inputs that share one int8 activation scale (qmatmul.h's kBlock).

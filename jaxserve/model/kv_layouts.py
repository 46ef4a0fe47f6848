"""The KV cache's layouts (`KVLayout`): how each shapes, writes and reads the arrays of one page
group (model/kv_cache.py holds the arrays), and the storage types of `KVDtype`.

Addressing is the same for all layouts: a token's K/V goes to flat slot `page * Z + offset`, and a
sequence's positions are listed by its page table. The contiguous layout keeps that addressing:
slot s owns pages 1 + s * W .. (s + 1) * W (engine/kv_spec.py's `slot_page_tables`), laid out back
to back, so its page table is the identity slice of its region.
Page 0 is a scratch page: padding tokens write their K/V there (the contiguous layout drops those
writes), and no page table points at it for a real position.

Quantized storage (int8, float8) is decoded back to float32 on read, as the kernels do
(kernels_pallas/kv_quant.py, one definition). int8 keeps a power-of-two scale per token and KV
head as its int8 exponent: in the token-major layouts in an array shaped like the values with
the head dim replaced by 1 (so the layout code is shared between values and scales), in the
RAGGED layout in the page row after the V heads (kernels_pallas/ragged_layout.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from jaxserve.config import KVDtype, KVLayout
from kernels_pallas import kv_quant, ragged_layout

SCRATCH_PAGE = 0

STORAGE_DTYPES = {KVDtype.FLOAT32: jnp.float32, KVDtype.BFLOAT16: jnp.bfloat16,
                  KVDtype.FLOAT16: jnp.float16, KVDtype.INT8: jnp.int8,
                  KVDtype.FLOAT8_E4M3: jnp.float8_e4m3fn, KVDtype.FLOAT8_E5M2: jnp.float8_e5m2}


# Quantization: one token's K or V [..., K, H] in, (values, exponents [..., K, 1] or None) out.

def encode(x, kv_dtype: KVDtype):
  values, exponents = kv_quant.quantize(x, STORAGE_DTYPES[kv_dtype])
  return values, None if exponents is None else exponents[..., None]


def dequantize(values, exponents):
  """Stored values -> float32 (or the stored float type when no decoding is needed)."""
  if exponents is None and values.dtype in (jnp.float32, jnp.bfloat16):
    return values
  return kv_quant.dequantize(values, None if exponents is None else exponents[..., 0])


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one layout shapes, writes and reads an array. X is H for values and 1 for scales.

  shape(L, P, Z, K, X, Bs, W) -> the stored shape;
  write(a, b, layer, page, offset, k, v, Z) -> (a, b) (b is None when K and V share array a);
  gather(a, b, layer, tables, Z) -> k, v [B, W * Z, K, X].
  """

  shape: Callable
  separate: bool  # K and V in two arrays, or both in one.
  write: Callable
  gather: Callable
  axes: tuple[str, ...]  # Logical axis names, for sharding by KV head over a mesh.


def _flat_gather(x, B, Z):  # [B, W, Z, K, X] -> [B, W * Z, K, X]
  return x.reshape(B, x.shape[1] * Z, *x.shape[3:])


def _token_major_write(a, b, layer, page, offset, k, v, Z):
  return a.at[layer, page, offset].set(k), b.at[layer, page, offset].set(v)


def _token_major_gather(a, b, layer, tables, Z):
  B = tables.shape[0]
  return _flat_gather(a[layer, tables], B, Z), _flat_gather(b[layer, tables], B, Z)


def _contiguous_write(a, b, layer, page, offset, k, v, Z):
  L, Bs, W = a.shape[:3]
  # Page p >= 1 is position (p - 1) * Z of the [Bs * W * Z] positions; scratch writes go out of
  # range and are dropped, so padding never touches a slot's region.
  flat = jnp.where(page == SCRATCH_PAGE, Bs * W * Z, (page - 1) * Z + offset)  # [B, T]
  put = lambda x, new: x.reshape(L, Bs * W * Z, *x.shape[4:]).at[layer, flat].set(
      new, mode="drop").reshape(x.shape)
  return put(a, k), put(b, v)


def _contiguous_gather(a, b, layer, tables, Z):
  Bs, W = a.shape[1:3]
  # Page p >= 1 is page p - 1 of the slots' regions laid end to end; scratch entries (past a
  # sequence's positions, masked) read page 0. Any run of a table's columns works, so attention
  # may read a sequence a chunk at a time.
  page = jnp.maximum(tables - 1, 0)  # [B, w]
  B = tables.shape[0]
  take = lambda x: _flat_gather(x[layer].reshape(Bs * W, *x.shape[3:])[page], B, Z)
  return take(a), take(b)


def ragged_lanes(K, H, Kg=1, dtype="float32"):
  """Cr: Kg groups of one ragged page row each (kernels_pallas.ragged_layout: 2 * (K / Kg) * H
  lanes, int8's exponents after them, rounded up to 128). Under tensor parallelism Kg = tp: a
  device's KV heads are one group, its own lane-dense rows."""
  return Kg * ragged_layout.layout_for(K // Kg, H, dtype).lanes


def ragged_write(a, layer, page, offset, k, v, exponents, Z, Kg):
  """k, v [B, T, K, H] and exponents (int8: K's and V's, [B, T, K, 1] each) into page rows."""
  L, P, _, Cr = a.shape
  group = lambda x: x.reshape(*x.shape[:-2], Kg, -1)  # [B, T, K, X] -> [B, T, Kg, K / Kg * X]
  parts = [group(k), group(v)] + [group(e).astype(k.dtype) for e in exponents if e is not None]
  rows = jnp.concatenate(parts, -1)  # [B, T, Kg, 2 * K / Kg * H (+ 2 * K / Kg)]
  rows = jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, Cr // Kg - rows.shape[-1])])
  rows = rows.reshape(*rows.shape[:-2], Cr)  # [B, T, Cr]
  flat = (layer * P + page) * Z + offset  # [B, T]: one scatter writes K and V of every token.
  return a.reshape(L * P * Z, Cr).at[flat].set(rows.astype(a.dtype)).reshape(a.shape)


def ragged_gather(a, layer, tables, Z, K, H, Kg, dtype):
  """-> k, v [B, S, K, H] and their exponents [B, S, K, 1] (None but for int8)."""
  g = a[layer, tables]  # [B, W, Z, Cr]: each page's K and V of every head in one read.
  B, n, m = tables.shape[0], K // Kg * H, K // Kg
  rows = g.reshape(B, g.shape[1] * Z, Kg, -1)  # [B, S, Kg, Cr / Kg]
  heads = lambda x, X: x.reshape(B, -1, K, X)  # [B, S, Kg, K / Kg * X] -> [B, S, K, X]
  k, v = heads(rows[..., :n], H), heads(rows[..., n:2 * n], H)
  if not kv_quant.is_int8(dtype):
    return k, v, None, None
  return k, v, heads(rows[..., 2 * n:2 * n + m], 1), heads(rows[..., 2 * n + m:2 * (n + m)], 1)


TOKEN_AXES = ("layers", "pages", "page_tokens", "kv_heads", "head_dim")
LAYOUTS = {
    KVLayout.PAGED_TOKEN_MAJOR: Layout(
        shape=lambda L, P, Z, K, X, Bs, W: (L, P, Z, K, X), separate=True,
        write=_token_major_write, gather=_token_major_gather, axes=TOKEN_AXES),
    KVLayout.RAGGED: Layout(
        shape=None, separate=False, write=None, gather=None,  # KVPool handles it (lane groups).
        axes=("layers", "pages", "page_tokens", "kv_lanes")),
    KVLayout.CONTIGUOUS: Layout(
        shape=lambda L, P, Z, K, X, Bs, W: (L, Bs, W, Z, K, X), separate=True,
        write=_contiguous_write, gather=_contiguous_gather,
        axes=("layers", "slots", "pages", "page_tokens", "kv_heads", "head_dim")),
}


KV_DTYPE_OF_STORAGE = {jnp.dtype(d): kv for kv, d in STORAGE_DTYPES.items()}

"""The engine's paged KV layouts as the decode kernels read them: pools of page slabs.

Every layout is viewed, for free (reshapes only), as one pool of slabs [Y, Z, Ks, H]: Z positions
of Ks KV heads. A (page, K or V, KV head) triple lives in slab
    page * page_stride + kv * v_offset + head * head_stride
of the K pool (kv 0) or the V pool (kv 1), and the kernels copy or gather slabs by that number:
  TOKEN_MAJOR     k, v [P, Z, K, H]     one slab per page holds all K heads (Ks = K)
  HEAD_MAJOR      k, v [K, P, Z, H]     one slab per page and head (Ks = 1, head_stride P)
  KV_INTERLEAVED  k [P, 2, Z, K, H]     K then V of each page; v is None and both pools are k's
                                        one array (page_stride 2, v_offset 1)
With `layer` the arrays carry a leading [L] axis: it merges into the slab axis and the page
tables are shifted by the layer's first page, so the layer is read in place, never sliced out
(a traced slice of a custom call's operand would be a whole-layer copy per step).

Quantized pages are decoded inside the kernel, after the load: int8 (and optionally float8 /
float16) values times a float32 scale per position and KV head, shaped like the values with H
replaced by 1 (k_scale, v_scale; one array for KV_INTERLEAVED, like the values).
Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from kernels_pallas import common

VALUE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.float8_e4m3fn)


class PageLayout(enum.Enum):
  TOKEN_MAJOR = "[P, Z, K, H]"
  HEAD_MAJOR = "[K, P, Z, H]"
  KV_INTERLEAVED = "[P, 2, Z, K, H]"


@dataclasses.dataclass(frozen=True)
class SlabIndex:
  """Where one page's K or V of one KV head sits in its pool (all static ints)."""

  page_stride: int
  v_offset: int
  head_stride: int  # 0 when a slab holds every head (Ks = K).

  @property
  def per_head(self) -> bool:
    return self.head_stride > 0

  def slab(self, page, kv: int, head):
    return page * self.page_stride + kv * self.v_offset + head * self.head_stride

  def head_in_slab(self, head):
    return 0 if self.per_head else head


TOKEN_MAJOR_INDEX = SlabIndex(page_stride=1, v_offset=0, head_stride=0)


@dataclasses.dataclass(frozen=True)
class Pools:
  """The decode kernels' view of the pages: pools [Y, Z, Ks, H], scale pools [Y, Z, Ks] or None."""

  k: jax.Array
  v: jax.Array
  k_scale: jax.Array | None
  v_scale: jax.Array | None
  tables: jax.Array  # [B, W] the caller's page tables, shifted to the layer's pages.
  index: SlabIndex
  num_kv_heads: int
  num_pages: int  # P of one layer.

  @property
  def page_size(self) -> int:
    return self.k.shape[1]

  @property
  def head_dim(self) -> int:
    return self.k.shape[3]

  def dequantized_dtype(self, q_dtype):
    """The dtype both matmul operands use: bf16 only when Q and the stored pages both are."""
    stored = self.k.dtype if self.k.dtype in common.KV_DTYPES else jnp.float32
    return common.compute_dtype(q_dtype, stored)


def _require(ok: bool, message: str):
  if not ok:
    raise ValueError(message)


def _check_values(layout, k_pages, v_pages, layer):
  lead = "[L, " if layer is not None else "["
  ndim = len(layout.value.split(",")) + (layer is not None)
  _require(k_pages.ndim == ndim, f"k_pages must be {lead}{layout.value[1:]} for {layout.name} "
                                 f"pages{' with layer' if layer is not None else ''}, got shape "
                                 f"{k_pages.shape}")
  _require(k_pages.dtype in VALUE_DTYPES, f"k_pages dtype must be one of float32, bfloat16, "
                                          f"float16, int8, float8_e4m3fn, got {k_pages.dtype}")
  if layout is PageLayout.KV_INTERLEAVED:
    _require(v_pages is None, "v_pages must be None for KV_INTERLEAVED pages (k_pages holds both)")
    _require(k_pages.shape[-4] == 2, f"k_pages axis -4 must be 2 (K, V), got {k_pages.shape}")
    return
  _require(v_pages is not None and v_pages.shape == k_pages.shape,
           f"v_pages must have k_pages' shape {k_pages.shape}, got "
           f"{None if v_pages is None else v_pages.shape}")
  _require(v_pages.dtype == k_pages.dtype,
           f"v_pages must have k_pages' dtype {k_pages.dtype}, got {v_pages.dtype}")


def _check_scales(layout, k_pages, k_scale, v_scale):
  scale_shape = (*k_pages.shape[:-1], 1)
  separate = layout is not PageLayout.KV_INTERLEAVED
  _require(k_scale is not None or k_pages.dtype != jnp.int8, "k_scale is required for int8 pages")
  _require((v_scale is not None) == (separate and k_scale is not None),
           "v_scale must be given exactly when k_scale is, and be None for KV_INTERLEAVED pages")
  for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
    if scale is not None:
      _require(scale.shape == scale_shape and scale.dtype == jnp.float32,
               f"{name} must be float32 of shape {scale_shape}, got {scale.dtype}{scale.shape}")


def _pool(x, layout):
  """Values [(L,) ...layout...] -> [Y, Z, Ks, X]: merges the leading axes (a free reshape)."""
  if layout is PageLayout.HEAD_MAJOR:
    return x.reshape(-1, x.shape[-2], 1, x.shape[-1])  # [L * K * P, Z, 1, X]
  return x.reshape(-1, *x.shape[-3:])  # [L * P (* 2), Z, K, X]


def to_pools(layout: PageLayout, k_pages, v_pages, k_scale, v_scale, page_tables, layer) -> Pools:
  """Checks the pages of `layout` (ValueError naming the bad argument) and views them as pools."""
  _require(isinstance(layout, PageLayout), f"layout must be a PageLayout, got {layout!r}")
  _check_values(layout, k_pages, v_pages, layer)
  _check_scales(layout, k_pages, k_scale, v_scale)
  if layer is not None:
    _require(jnp.ndim(layer) == 0, f"layer must be a scalar, got shape {jnp.shape(layer)}")
  shape = k_pages.shape[1:] if layer is not None else k_pages.shape
  num_kv_heads = shape[0] if layout is PageLayout.HEAD_MAJOR else shape[-2]
  num_pages = shape[1] if layout is PageLayout.HEAD_MAJOR else shape[0]
  index = SlabIndex(page_stride=2 if layout is PageLayout.KV_INTERLEAVED else 1,
                    v_offset=1 if layout is PageLayout.KV_INTERLEAVED else 0,
                    head_stride=num_pages if layout is PageLayout.HEAD_MAJOR else 0)
  tables = page_tables
  if layer is not None:  # The layer's first page, in units of `page`.
    per_layer = num_pages * (num_kv_heads if layout is PageLayout.HEAD_MAJOR else 1)
    tables = page_tables + (jnp.asarray(layer, jnp.int32) * per_layer).astype(page_tables.dtype)
  k = _pool(k_pages, layout)
  v = k if v_pages is None else _pool(v_pages, layout)
  as_scales = lambda s: None if s is None else _pool(s, layout)[..., 0]  # [Y, Z, Ks]
  k_s = as_scales(k_scale)
  v_s = k_s if v_scale is None and k_s is not None else as_scales(v_scale)
  return Pools(k, v, k_s, v_s, tables, index, num_kv_heads, num_pages)


def check_decode(q, pools: Pools, lengths) -> common.PagedDims:
  """Checks q, the page tables and lengths against the pools; raises ValueError naming them."""
  _require(q.ndim == 3, f"q must be [tokens, num_heads, head_dim], got shape {q.shape}")
  num_seqs, num_heads, q_head_dim = q.shape
  _require(q_head_dim == pools.head_dim,
           f"q head_dim {q_head_dim} != k_pages head_dim {pools.head_dim}")
  _require(num_heads % pools.num_kv_heads == 0, f"q num_heads {num_heads} must be a multiple of "
                                                f"k_pages num_kv_heads {pools.num_kv_heads}")
  tables = pools.tables
  _require(tables.ndim == 2, f"page_tables must be 2-D, got shape {tables.shape}")
  common.check_int_array(tables, "page_tables", (num_seqs, tables.shape[1]))
  common.check_int_array(lengths, "lengths", (num_seqs,))
  return common.PagedDims(num_heads, pools.num_kv_heads, pools.head_dim, pools.num_pages,
                          pools.page_size, tables.shape[1])


def decode_slab(values, scale, dtype):
  """Loaded values [..., Hv] (and scale [..., 1] or None) -> dtype: dequantized after the load."""
  if scale is None:
    return values.astype(dtype)
  return (values.astype(jnp.float32) * scale).astype(dtype)

"""The ragged kernels' KV page layout: one lane-dense row per token, K heads then V heads.

    kv_pages [L, P, Z, Cr]   row z of page p of layer l holds one token:
                            lanes [h * H, (h + 1) * H)           K of KV head h
                            lanes [(K + h) * H, (K + h + 1) * H)  V of KV head h
                            lanes [2 * K * H, Cr)                 padding (zeros), Cr % 128 == 0
    int8 pages add, after the V heads, the scale exponents (kv_quant.py): lane 2 * K * H + j holds
    K head j's (j < K), then V head j - K's, in H * ceil(2K / H) lanes (whole head-width groups,
    which the GPU kernel stores like a head). The values' row is padded past them.

Why this shape: a TPU tiles the minor two dims of an array in HBM and VMEM by (sublanes, 128
lanes), sublanes = 8 for 32-bit and 16 for 16-bit dtypes. The token-major [P, Z, K, H] pages have
minor dims (K, H) = (3, 64) for SmolLM2, padded to (8, 128) or (16, 128): 5.3x (f32) or 10.7x
(bf16) the bytes. Here the minor dims are (Z, Cr): Z is a multiple of the sublane count for every
page size the engine uses, and Cr is 2 * K * H rounded up to 128, so the only waste is at most 127
lanes per token, and none where 2 * K * H % 128 == 0 (SmolLM2: 384 lanes; Llama-3-8B: 2,048).
Padding the lanes at the end never wastes more than padding head_dim would (K = 3, H = 80: 480
lanes -> 512, where a head_dim padded to 128 would give 768), and keeps each head's lanes at a
fixed offset the GPU kernel reads with one strided load. One page row holding K and V together
means one DMA per page moves both.

Shape letters: the key in jaxserve/model/__init__.py (Cr: lanes of a page row).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels_pallas import kv_quant

LANES = 128


def sublanes(dtype) -> int:
  """Rows of one native TPU tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit dtypes."""
  return 8 * (4 // jnp.dtype(dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class RaggedLayout:
  """Where a token's K and V heads sit in a page row, and what the layout costs."""

  num_kv_heads: int
  head_dim: int
  dtype: str  # A jnp dtype name, so the dataclass stays hashable (a static jit argument).
  lanes: int  # Cr
  scale_lanes: int = 0  # int8: the lanes that hold the 2K scale exponents (whole H-lane groups).

  @property
  def value_lanes(self) -> int:
    return 2 * self.num_kv_heads * self.head_dim

  @property
  def used_lanes(self) -> int:
    """Lanes holding data: the values, and int8's 2K exponents."""
    return self.value_lanes + (2 * self.num_kv_heads if self.scale_lanes else 0)

  @property
  def padding_lanes(self) -> int:
    return self.lanes - self.used_lanes

  @property
  def page_size_multiple(self) -> int:
    """Page sizes that are a multiple of this tile the pages with no padded rows."""
    return sublanes(self.dtype)

  def k_lanes(self, head: int) -> tuple[int, int]:
    return head * self.head_dim, (head + 1) * self.head_dim

  def v_lanes(self, head: int) -> tuple[int, int]:
    return self.k_lanes(self.num_kv_heads + head)

  def page_shape(self, num_layers: int, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (num_layers, num_pages, page_size, self.lanes)

  def num_bytes(self, num_layers: int, num_pages: int, page_size: int) -> int:
    """Bytes the pages take on a TPU, tile padding of the page rows included."""
    rows = -(-page_size // self.page_size_multiple) * self.page_size_multiple
    return num_layers * num_pages * rows * self.lanes * jnp.dtype(self.dtype).itemsize

  def wasted_bytes(self, num_layers: int, num_pages: int, page_size: int) -> int:
    """num_bytes less the bytes of the K/V values themselves."""
    used = num_layers * num_pages * page_size * self.used_lanes * jnp.dtype(self.dtype).itemsize
    return self.num_bytes(num_layers, num_pages, page_size) - used


def scale_lanes_for(num_kv_heads: int, head_dim: int, dtype) -> int:
  """Lanes of a row's scale exponents: int8 only, 2K of them in whole H-lane groups."""
  return head_dim * -(-2 * num_kv_heads // head_dim) if kv_quant.is_int8(dtype) else 0


def layout_for(num_kv_heads: int, head_dim: int, dtype) -> RaggedLayout:
  """The lane-dense layout for a model's (K, H) and KV dtype (a pure function of the three)."""
  if num_kv_heads < 1 or head_dim < 1:
    raise ValueError(f"num_kv_heads and head_dim must be >= 1, got {num_kv_heads}, {head_dim}")
  scales = scale_lanes_for(num_kv_heads, head_dim, dtype)
  used = 2 * num_kv_heads * head_dim + scales
  return RaggedLayout(num_kv_heads, head_dim, jnp.dtype(dtype).name,
                      -(-used // LANES) * LANES, scales)


def pack_rows(k_new, v_new, lanes: int, exponents=None):
  """k_new, v_new [T, K, H] -> [T, Cr] page rows in this layout (padding lanes 0); exponents
  [T, 2K] int8 (K's, then V's): int8 pages' scales, in the lanes after the values."""
  t = k_new.shape[0]
  parts = [k_new.reshape(t, -1), v_new.reshape(t, -1)]  # [T, KH] each
  if exponents is not None:
    parts.append(exponents.astype(k_new.dtype))  # [T, 2K]
  rows = jnp.concatenate(parts, axis=1)  # [T, 2KH (+ 2K)]
  return jnp.pad(rows, ((0, 0), (0, lanes - rows.shape[1])))


def unpack_exponents(rows, num_kv_heads: int, head_dim: int):
  """[..., Cr] int8 page rows -> the scale exponents of K and of V, [..., K] each."""
  lo = 2 * num_kv_heads * head_dim
  return rows[..., lo:lo + num_kv_heads], rows[..., lo + num_kv_heads:lo + 2 * num_kv_heads]


def unpack_rows(rows, num_kv_heads: int, head_dim: int):
  """[..., Cr] page rows -> K, V [..., K, H]: the inverse of pack_rows."""
  width = num_kv_heads * head_dim
  shape = (*rows.shape[:-1], num_kv_heads, head_dim)
  return rows[..., :width].reshape(shape), rows[..., width:2 * width].reshape(shape)


def lane_window(lo: int, hi: int, lanes: int) -> tuple[int, int]:
  """The 128-aligned lane range that covers [lo, hi): what a TPU kernel can slice for free."""
  return lo // LANES * LANES, min(lanes, -(-hi // LANES) * LANES)

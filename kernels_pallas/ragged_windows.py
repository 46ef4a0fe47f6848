"""Lane windows of the ragged layout for the TPU kernel: each KV head's K and V lanes, widened to
128-aligned ranges a kernel can slice without relayout (head_dim 64 puts heads mid-vreg).

Queries are placed in their head's K window with zeros on the other lanes, so the neighbours'
lanes add exactly 0 to QK^T; the output of a V window holds the neighbours' PV too, and
unpack_outputs keeps only the head's own lanes. With head_dim a multiple of 128 the windows are
the heads themselves. int8 rows add one window over their 2K scale exponents. Shape letters:
the key in jaxserve/model/__init__.py (A rows).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas import ragged_layout


@dataclasses.dataclass(frozen=True)
class HeadWindows:
  k: tuple[tuple[int, int], ...]  # Per KV head, the [lo, hi) lanes covering its K.
  v: tuple[tuple[int, int], ...]
  k_offsets: tuple[int, ...]  # Where the head's first K lane sits inside its window.
  v_offsets: tuple[int, ...]
  head_dim: int
  scales: tuple[int, int] | None = None  # int8: the lanes covering the 2K exponents.
  scale_offset: int = 0  # Where K head 0's exponent sits inside that window.

  @classmethod
  def of(cls, layout: ragged_layout.RaggedLayout) -> "HeadWindows":
    heads = range(layout.num_kv_heads)
    k = tuple(ragged_layout.lane_window(*layout.k_lanes(h), layout.lanes) for h in heads)
    v = tuple(ragged_layout.lane_window(*layout.v_lanes(h), layout.lanes) for h in heads)
    k_off = tuple(layout.k_lanes(h)[0] - k[h][0] for h in heads)
    v_off = tuple(layout.v_lanes(h)[0] - v[h][0] for h in heads)
    if not layout.scale_lanes:
      return cls(k, v, k_off, v_off, layout.head_dim)
    lo = layout.value_lanes
    scales = ragged_layout.lane_window(lo, lo + 2 * layout.num_kv_heads, layout.lanes)
    return cls(k, v, k_off, v_off, layout.head_dim, scales, lo - scales[0])

  @property
  def num_heads(self) -> int:
    return len(self.k)

  def scale_column(self, scales_CS, j: int):
    """[C, 1]: exponent j's scales (K head j, then V head j - K) of a chunk; None without."""
    if scales_CS is None:
      return None
    col = self.scale_offset + j
    return scales_CS[:, col:col + 1]

  @property
  def width(self) -> int:
    return max(hi - lo for lo, hi in self.k + self.v)

  def pack_queries(self, q_AKGH: jax.Array) -> jax.Array:
    """[A, K, G, H] -> [A, K, G, E]: head h's values at its K offset, zeros elsewhere."""
    e, d = self.width, self.head_dim
    heads = [jnp.pad(q_AKGH[:, h], ((0, 0), (0, 0), (off, e - off - d)))  # [A, G, E]
             for h, off in enumerate(self.k_offsets)]
    return jnp.stack(heads, axis=1)

  def unpack_outputs(self, o_XKGE: jax.Array) -> jax.Array:
    """[A, K, G, E] -> [A, K, G, H]: each head's own V lanes of its window's output."""
    d = self.head_dim
    return jnp.stack([o_XKGE[:, h, :, off:off + d] for h, off in enumerate(self.v_offsets)],
                     axis=1)

"""The KV cache on the device: fixed-shape arrays that sequences index through page tables.

Which pages a sequence owns is host state (`kv_pages.py`); this module holds only the arrays, in
one of the layouts of `KVLayout` and one of the storage types of `KVDtype`, shaped by a
`CacheSpec` (the engine makes it from its config: engine/kv_spec.py). Every layout is read
and written through the same narrow interface (`create`, `write`, `gather`, `num_bytes`), so the
jnp attention never knows which one it runs on; the Pallas backend reads and writes the RAGGED
layout in place, inside its kernel.

There is one cache type, `KVCache`: a tuple of page groups (`groups`, Pg of them), each a
`KVPool` with a page table of its own per sequence (one pool, or the full pool then the window
pool), and, with a speculative draft model, the draft's groups beside them (`draft`). Callers
that move pages (the host tier, the shardings) ask `groups` and `with_groups`; nothing tests
which kind of cache it holds.
The layouts themselves, their addressing and quantized storage, are kv_layouts.py's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import KVDtype, KVLayout, ModelConfig
from jaxserve.model.kv_layouts import (
  KV_DTYPE_OF_STORAGE,
  LAYOUTS,
  SCRATCH_PAGE,
  STORAGE_DTYPES,
  TOKEN_AXES,
  dequantize,
  encode,
  ragged_gather,
  ragged_lanes,
  ragged_write,
)

__all__ = ["SCRATCH_PAGE", "CacheSpec", "KVCache", "KVPool", "ragged_lanes"]


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """What sets a cache's shapes: all of it the engine's choice (engine/kv_spec.py)."""

  layout: KVLayout
  kv_dtype: KVDtype
  num_pages: int  # P of the full pool, scratch page 0 included.
  page_size: int  # Z
  num_slots: int  # Bs: the contiguous layout's slot regions, W pages each.
  max_pages_per_seq: int  # W
  tp: int = 1  # Kg of a RAGGED cache: its page rows are padded per device's heads.
  num_window_pages: int = 0  # P of the window pool (KVCache); 0: one pool.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
  """One page group's pool: the K/V of its layers in `num_pages` pages, in one layout."""

  k: jax.Array  # Values in `layout`'s shape; K and V together when the layout interleaves them.
  v: jax.Array | None  # None when k holds both.
  k_scale: jax.Array | None = None  # int8, not RAGGED: exponents, like k with head_dim 1.
  v_scale: jax.Array | None = None
  layout: KVLayout = dataclasses.field(default=KVLayout.PAGED_TOKEN_MAJOR,
                                       metadata=dict(static=True))
  # (K, H, Kg, dtype name) of a RAGGED cache, whose page rows do not show them: Kg lane groups
  # of K / Kg heads.
  ragged_heads: tuple[int, int, int, str] | None = dataclasses.field(default=None,
                                                                      metadata=dict(static=True))

  # The token-major layout's logical axis names; `axes` gives the running layout's.
  AXES = TOKEN_AXES

  @classmethod
  def create(cls, model: ModelConfig, spec: CacheSpec, num_layers: int | None = None,
             num_pages: int | None = None) -> KVPool:
    """Every layer of `model` in `spec.num_pages` pages, or `num_layers` of them in
    `num_pages` (a windowed cache's full or window pool)."""
    layout, kv_dtype = LAYOUTS[spec.layout], spec.kv_dtype
    # 0 layers: the full pool when every layer is local and keeps its window (Mistral).
    dims = (model.num_layers if num_layers is None else num_layers,
            num_pages or spec.num_pages, spec.page_size, model.num_kv_heads)
    shape = lambda X: layout.shape(*dims, X, spec.num_slots, spec.max_pages_per_seq)
    values, ragged = STORAGE_DTYPES[kv_dtype], None
    if spec.layout is KVLayout.RAGGED:
      ragged = (model.num_kv_heads, model.head_dim, spec.tp, jnp.dtype(values).name)
      shape = lambda X: (*dims[:3], ragged_lanes(*ragged))
    zeros = lambda X, dtype: jnp.zeros(shape(X), dtype)
    scaled = kv_dtype is KVDtype.INT8 and spec.layout is not KVLayout.RAGGED  # Its rows hold them.
    # Separate zeros() calls: the cache is donated, and donated buffers must be distinct.
    return cls(k=zeros(model.head_dim, values),
               v=zeros(model.head_dim, values) if layout.separate else None,
               k_scale=zeros(1, jnp.int8) if scaled else None,
               v_scale=zeros(1, jnp.int8) if scaled and layout.separate else None,
               layout=spec.layout, ragged_heads=ragged)

  @property
  def axes(self) -> tuple[str, ...]:
    return LAYOUTS[self.layout].axes

  @property
  def page_size(self) -> int:
    return self.k.shape[self.axes.index("page_tokens")]

  @property
  def kv_dtype(self) -> KVDtype:
    return KV_DTYPE_OF_STORAGE[jnp.dtype(self.k.dtype)]

  @property
  def num_kv_heads(self) -> int:
    if self.layout is KVLayout.RAGGED:
      return self.ragged_heads[0]
    return self.k.shape[self.axes.index("kv_heads")]

  @property
  def num_pages(self) -> int:
    """Pages a page table may name, scratch page 0 included."""
    if self.layout is KVLayout.CONTIGUOUS:
      return 1 + self.k.shape[1] * self.k.shape[2]
    return self.k.shape[self.axes.index("pages")]

  @property
  def num_bytes(self) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(self))

  def write(self, layer, cache_index, k, v) -> KVPool:
    """Writes k, v [B, T, K, H] of one layer at flat slots [B, T] (page * Z + offset)."""
    lay, Z = LAYOUTS[self.layout], self.page_size
    page, offset = cache_index // Z, cache_index % Z  # [B, T]
    (k, k_scale), (v, v_scale) = encode(k, self.kv_dtype), encode(v, self.kv_dtype)
    if self.layout is KVLayout.RAGGED:
      return dataclasses.replace(self, k=ragged_write(self.k, layer, page, offset, k, v,
                                                       (k_scale, v_scale), Z,
                                                       self.ragged_heads[2]))
    new_k, new_v = lay.write(self.k, self.v, layer, page, offset, k, v, Z)
    new_ks, new_vs = self.k_scale, self.v_scale
    if k_scale is not None:
      new_ks, new_vs = lay.write(self.k_scale, self.v_scale, layer, page, offset, k_scale,
                                 v_scale, Z)
    return dataclasses.replace(self, k=new_k, v=new_v, k_scale=new_ks, v_scale=new_vs)

  def gather(self, layer, page_tables):
    """The pages of each sequence, flattened and decoded: [B, W * Z, K, H] for k and for v."""
    lay, Z = LAYOUTS[self.layout], self.page_size
    if self.layout is KVLayout.RAGGED:
      k, v, ks, vs = ragged_gather(self.k, layer, page_tables, Z, *self.ragged_heads)
      return dequantize(k, ks), dequantize(v, vs)
    k, v = lay.gather(self.k, self.v, layer, page_tables, Z)
    if self.k_scale is None:
      return dequantize(k, None), dequantize(v, None)
    ks, vs = lay.gather(self.k_scale, self.v_scale, layer, page_tables, Z)
    return dequantize(k, ks), dequantize(v, vs)



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """The device KV cache: page groups, each a pool with a page table of its own per sequence. A
  step's tables hold every group's side by side, [B, Pg * W] (AttentionMetadata), in `groups`'
  order.

  Pg = 1: one pool of every layer. Pg = 2, for a model with sliding-window (local) layers: the
  full pool holds the global layers' KV of every position, the window pool the local layers' KV
  of only the pages their window can still touch (the scheduler frees the others). Layer l is
  then layer `index[l]` of the window pool if `is_window[l]`, else of the full pool.

  `draft`: the speculative draft model's groups (engine/draft.py), its own layers and heads,
  read and written through the target's page tables: the same pages and positions, so no second
  allocator. Empty without a draft model."""

  groups: tuple[KVPool, ...]
  draft: tuple[KVPool, ...] = ()
  # [L] each layer's pool (True: the window pool) and its index there; () with one group.
  is_window: tuple[bool, ...] = dataclasses.field(default=(), metadata=dict(static=True))
  index: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))

  @classmethod
  def create(cls, model: ModelConfig, spec: CacheSpec) -> KVCache:
    """The cache `spec` describes: one pool, or two when the local layers keep only their
    window (spec.num_window_pages)."""
    if not spec.num_window_pages:
      return cls((KVPool.create(model, spec),))
    local = tuple(model.local_layers)
    num_local = sum(local)
    index = tuple(sum(local[:l]) if w else l - sum(local[:l]) for l, w in enumerate(local))
    full = KVPool.create(model, spec, num_layers=model.num_layers - num_local)
    window = KVPool.create(model, spec, num_layers=num_local, num_pages=spec.num_window_pages)
    return cls((full, window), is_window=local, index=index)

  num_groups = property(lambda self: len(self.groups))  # Pg: page tables a sequence has.
  page_size = property(lambda self: self.groups[0].page_size)
  num_pages = property(lambda self: self.groups[0].num_pages)  # Pages a first-group table names.
  layout = property(lambda self: self.groups[0].layout)
  kv_dtype = property(lambda self: self.groups[0].kv_dtype)

  @property
  def num_window_pages(self) -> int:
    """Pages of the window pool, scratch page included; 0 with one group."""
    return self.groups[1].num_pages if self.num_groups > 1 else 0

  @property
  def num_bytes(self) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(self))  # The draft's groups included.

  def with_groups(self, groups: tuple[KVPool, ...]) -> KVCache:
    return dataclasses.replace(self, groups=tuple(groups))

  def map_pools(self, fn) -> KVCache:
    """`fn` applied to every pool: the target's groups and the draft's."""
    return dataclasses.replace(self, groups=tuple(map(fn, self.groups)),
                               draft=tuple(map(fn, self.draft)))

  @property
  def target(self) -> KVCache:
    """The target model's groups alone: what its layers read and write."""
    return dataclasses.replace(self, draft=())

  @property
  def draft_cache(self) -> KVCache:
    """The draft model's groups as a cache of their own: what its layers read and write."""
    return KVCache(self.draft)

  def with_draft(self, draft: KVCache) -> KVCache:
    """This cache with `draft`'s groups as the draft model's."""
    return dataclasses.replace(self, draft=draft.groups)

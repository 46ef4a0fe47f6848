"""The KV cache on the device: fixed-shape arrays that sequences index through page tables.

Which pages a sequence owns is host state (`kv_pages.py`); this module holds only the arrays, in
one of the layouts of `KVLayout` and one of the storage types of `KVDtype`. Every layout is read
and written through the same narrow interface (`create`, `write`, `gather`, `num_bytes`), so the
jnp attention never knows which one it runs on; the Pallas backend reads and writes the RAGGED
layout in place, inside its kernel.

Addressing is the same for all layouts: a token's K/V goes to flat slot `page * Z + offset`, and a
sequence's positions are listed by its page table. The contiguous layout keeps that addressing:
slot s owns pages 1 + s * W .. (s + 1) * W (`slot_page_tables`), laid out back to back, so its page
table is the identity slice of its region.
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

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import Dtype, EngineConfig, KVDtype, KVLayout, ModelConfig
from jaxserve.config.engine import RAGGED_KV_DTYPES, window_pages_per_seq
from kernels_pallas import kv_quant, ragged_layout

SCRATCH_PAGE = 0

STORAGE_DTYPES = {KVDtype.FLOAT32: jnp.float32, KVDtype.BFLOAT16: jnp.bfloat16,
                  KVDtype.FLOAT16: jnp.float16, KVDtype.INT8: jnp.int8,
                  KVDtype.FLOAT8_E4M3: jnp.float8_e4m3fn, KVDtype.FLOAT8_E5M2: jnp.float8_e5m2}


def kv_dtype_of(engine: EngineConfig) -> KVDtype:
  """The engine's KV storage type: its `kv_dtype`, or else its compute dtype."""
  if engine.kv_dtype is not None:
    return engine.kv_dtype
  return KVDtype.BFLOAT16 if engine.dtype is Dtype.BFLOAT16 else KVDtype.FLOAT32


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
class _Layout:
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


def _ragged_write(a, layer, page, offset, k, v, exponents, Z, Kg):
  """k, v [B, T, K, H] and exponents (int8: K's and V's, [B, T, K, 1] each) into page rows."""
  L, P, _, Cr = a.shape
  group = lambda x: x.reshape(*x.shape[:-2], Kg, -1)  # [B, T, K, X] -> [B, T, Kg, K / Kg * X]
  parts = [group(k), group(v)] + [group(e).astype(k.dtype) for e in exponents if e is not None]
  rows = jnp.concatenate(parts, -1)  # [B, T, Kg, 2 * K / Kg * H (+ 2 * K / Kg)]
  rows = jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, Cr // Kg - rows.shape[-1])])
  rows = rows.reshape(*rows.shape[:-2], Cr)  # [B, T, Cr]
  flat = (layer * P + page) * Z + offset  # [B, T]: one scatter writes K and V of every token.
  return a.reshape(L * P * Z, Cr).at[flat].set(rows.astype(a.dtype)).reshape(a.shape)


def _ragged_gather(a, layer, tables, Z, K, H, Kg, dtype):
  """-> k, v [B, S, K, H] and their exponents [B, S, K, 1] (None but for int8)."""
  g = a[layer, tables]  # [B, W, Z, Cr]: each page's K and V of every head in one read.
  B, n, m = tables.shape[0], K // Kg * H, K // Kg
  rows = g.reshape(B, g.shape[1] * Z, Kg, -1)  # [B, S, Kg, Cr / Kg]
  heads = lambda x, X: x.reshape(B, -1, K, X)  # [B, S, Kg, K / Kg * X] -> [B, S, K, X]
  k, v = heads(rows[..., :n], H), heads(rows[..., n:2 * n], H)
  if not kv_quant.is_int8(dtype):
    return k, v, None, None
  return k, v, heads(rows[..., 2 * n:2 * n + m], 1), heads(rows[..., 2 * n + m:2 * (n + m)], 1)


_TOKEN_AXES = ("layers", "pages", "page_tokens", "kv_heads", "head_dim")
_LAYOUTS = {
    KVLayout.PAGED_TOKEN_MAJOR: _Layout(
        shape=lambda L, P, Z, K, X, Bs, W: (L, P, Z, K, X), separate=True,
        write=_token_major_write, gather=_token_major_gather, axes=_TOKEN_AXES),
    KVLayout.RAGGED: _Layout(
        shape=None, separate=False, write=None, gather=None,  # KVCache handles it (groups).
        axes=("layers", "pages", "page_tokens", "kv_lanes")),
    KVLayout.CONTIGUOUS: _Layout(
        shape=lambda L, P, Z, K, X, Bs, W: (L, Bs, W, Z, K, X), separate=True,
        write=_contiguous_write, gather=_contiguous_gather,
        axes=("layers", "slots", "pages", "page_tokens", "kv_heads", "head_dim")),
}


_KV_DTYPE_OF_STORAGE = {jnp.dtype(d): kv for kv, d in STORAGE_DTYPES.items()}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
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
  AXES = _TOKEN_AXES
  PAGE_GROUPS = 1  # Page tables a step's sequence has (WindowedKV: 2).

  @classmethod
  def create(cls, model: ModelConfig, engine: EngineConfig, num_layers: int | None = None,
             num_pages: int | None = None) -> KVCache:
    """Every layer of `model` in `engine.num_pages` pages, or `num_layers` of them in
    `num_pages` (one page group of a `WindowedKV`)."""
    kv_layout = engine.kv_layout or KVLayout.PAGED_TOKEN_MAJOR  # None: the engine had no say.
    layout, kv_dtype = _LAYOUTS[kv_layout], kv_dtype_of(engine)
    # 0 layers: a WindowedKV's full pool when every layer is local (Mistral).
    dims = (model.num_layers if num_layers is None else num_layers,
            num_pages or engine.num_pages, engine.page_size, model.num_kv_heads)
    shape = lambda X: layout.shape(*dims, X, engine.num_slots, engine.max_pages_per_seq)
    values, ragged = STORAGE_DTYPES[kv_dtype], None
    if kv_layout is KVLayout.RAGGED:
      if kv_dtype not in RAGGED_KV_DTYPES:
        raise ValueError(f"the ragged KV layout stores "
                         f"{', '.join(d.label for d in RAGGED_KV_DTYPES)}, not {kv_dtype.label}")
      ragged = (model.num_kv_heads, model.head_dim, engine.tp, jnp.dtype(values).name)
      shape = lambda X: (*dims[:3], ragged_lanes(*ragged))
    zeros = lambda X, dtype: jnp.zeros(shape(X), dtype)
    scaled = kv_dtype is KVDtype.INT8 and kv_layout is not KVLayout.RAGGED  # Its rows hold them.
    # Separate zeros() calls: the cache is donated, and donated buffers must be distinct.
    return cls(k=zeros(model.head_dim, values),
               v=zeros(model.head_dim, values) if layout.separate else None,
               k_scale=zeros(1, jnp.int8) if scaled else None,
               v_scale=zeros(1, jnp.int8) if scaled and layout.separate else None,
               layout=kv_layout, ragged_heads=ragged)

  @property
  def axes(self) -> tuple[str, ...]:
    return _LAYOUTS[self.layout].axes

  @property
  def page_size(self) -> int:
    return self.k.shape[self.axes.index("page_tokens")]

  @property
  def kv_dtype(self) -> KVDtype:
    return _KV_DTYPE_OF_STORAGE[jnp.dtype(self.k.dtype)]

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

  def write(self, layer, cache_index, k, v) -> KVCache:
    """Writes k, v [B, T, K, H] of one layer at flat slots [B, T] (page * Z + offset)."""
    lay, Z = _LAYOUTS[self.layout], self.page_size
    page, offset = cache_index // Z, cache_index % Z  # [B, T]
    (k, k_scale), (v, v_scale) = encode(k, self.kv_dtype), encode(v, self.kv_dtype)
    if self.layout is KVLayout.RAGGED:
      return dataclasses.replace(self, k=_ragged_write(self.k, layer, page, offset, k, v,
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
    lay, Z = _LAYOUTS[self.layout], self.page_size
    if self.layout is KVLayout.RAGGED:
      k, v, ks, vs = _ragged_gather(self.k, layer, page_tables, Z, *self.ragged_heads)
      return dequantize(k, ks), dequantize(v, vs)
    k, v = lay.gather(self.k, self.v, layer, page_tables, Z)
    if self.k_scale is None:
      return dequantize(k, None), dequantize(v, None)
    ks, vs = lay.gather(self.k_scale, self.v_scale, layer, page_tables, Z)
    return dequantize(k, ks), dequantize(v, vs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowedKV:
  """Two page pools, for a model with sliding-window (local) layers: `full` holds the global
  layers' KV of every position, `window` the local layers' KV of only the pages their window can
  still touch (the scheduler frees the others). A page table names pages of one pool; a step's
  tables hold both, [B, 2 * W] (AttentionMetadata). Layer l is layer `index[l]` of its pool."""

  full: KVCache
  window: KVCache
  is_window: tuple[bool, ...] = dataclasses.field(metadata=dict(static=True))  # [L]
  index: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # [L]

  @classmethod
  def create(cls, model: ModelConfig, engine: EngineConfig) -> WindowedKV:
    local = tuple(model.local_layers)
    num_local = sum(local)
    index = tuple(sum(local[:l]) if w else l - sum(local[:l]) for l, w in enumerate(local))
    return cls(KVCache.create(model, engine, num_layers=model.num_layers - num_local),
               KVCache.create(model, engine, num_layers=num_local,
                              num_pages=num_window_pages(model, engine)),
               is_window=local, index=index)

  PAGE_GROUPS = 2  # Each sequence's page table, then its window table.
  page_size = property(lambda self: self.full.page_size)
  num_pages = property(lambda self: self.full.num_pages)  # Pages a full-pool table may name.
  layout = property(lambda self: self.full.layout)
  kv_dtype = property(lambda self: self.full.kv_dtype)

  @property
  def num_bytes(self) -> int:
    return self.full.num_bytes + self.window.num_bytes


def num_window_pages(model: ModelConfig, engine: EngineConfig) -> int:
  """Pages of the window pool, scratch page 0 included, when the local layers keep only their
  window's pages (engine.window_pages; not the contiguous layout, whose slots own their
  regions); 0 when every layer keeps every page. Each slot holds at most
  `window_pages_per_seq` of them, so the pool never runs out."""
  windowed = engine.window_pages and any(model.local_layers)
  if not windowed or engine.kv_layout is KVLayout.CONTIGUOUS:
    return 0
  per_seq = window_pages_per_seq(model.sliding_window, engine.page_size, engine.prefill_buckets[-1])
  if per_seq >= engine.max_pages_per_seq:  # The window holds the whole context: nothing to free.
    return 0
  return 1 + engine.num_slots * per_seq


def create(model: ModelConfig, engine: EngineConfig) -> KVCache | WindowedKV:
  """The engine's cache: one pool, or two when the local layers keep only their window."""
  if num_window_pages(model, engine):
    return WindowedKV.create(model, engine)
  return KVCache.create(model, engine)


def lane_groups(engine: EngineConfig) -> int:
  """The capacity planner's `lane_groups` for this engine's cache: tp for the RAGGED layout
  (its rows are padded per device group), 0 for the token-major ones."""
  layout = engine.kv_layout
  if layout is None:
    raise ValueError("the KV layout is picked with the backend (engine.engine_config_for)")
  return engine.tp if layout is KVLayout.RAGGED else 0


def slot_page_tables(engine: EngineConfig) -> np.ndarray | None:
  """[Bs, W] host page tables of the contiguous layout (slot s owns pages 1 + s * W + i);
  None for the paged layouts, whose tables come from the page allocator."""
  if engine.kv_layout is not KVLayout.CONTIGUOUS:
    return None
  W = engine.max_pages_per_seq
  return (1 + np.arange(engine.num_slots)[:, None] * W + np.arange(W)[None, :]).astype(np.int32)

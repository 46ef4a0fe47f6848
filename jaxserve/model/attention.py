"""Attention over the KV cache, behind one interface with swappable backends.

`attend` is called by every layer with the queries and an `AttentionMetadata` pytree that says
where each query sits; an `AttentionSpec` (static: the backend, and the mesh the kernels run on)
decides how the pages are read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.config import AttentionBackend, KVLayout
from jaxserve.config.engine import width_buckets
from jaxserve.model import axes
from jaxserve.model.kv_cache import KVCache, WindowedKV

_MASKED = -1e30  # Finite, so a fully masked row (an idle slot) gives zeros, never NaN.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
  """Where every query of one packed step sits: T tokens on one axis, B sequences.

  Sequence b's new tokens are the packed rows [cu_q_lens[b], cu_q_lens[b + 1]); the first
  `num_decode_rows` sequences are decode rows of one token each (engine/step_args.py)."""

  positions: jax.Array  # [1, T] absolute position of each token.
  # [Pg, T] flat cache slot (page * Z + offset) each token's K/V goes to in each page group's
  # pool (Pg = 1, or 2 for a WindowedKV: the full pool, then the window pool).
  cache_index: jax.Array
  page_tables: jax.Array  # [B, Pg * W] pages of each sequence: each group's table, side by side.
  kv_lens: jax.Array  # [B] valid KV positions of each sequence once this step's K/V is written.
  cu_q_lens: jax.Array  # [B + 1] int32 from 0: cumulative new tokens per sequence.
  sample_rows: jax.Array  # [B] the packed row of each sequence's last token (its logits).
  block_rows: jax.Array  # [nb, Tb] packed rows of each prefill query block (T: none).
  block_seq: jax.Array  # [nb] the sequence of each block.
  num_decode_rows: int = dataclasses.field(default=0, metadata=dict(static=True))  # D

  @classmethod
  def one_sequence(cls, n: int, page_size: int) -> AttentionMetadata:
    """A step of one sequence of n new tokens at positions 0.. in pages 1, 2, ... (one query
    block): a full forward, for tests and teacher-forced scripts."""
    pages = -(-n // page_size)
    return cls(positions=jnp.arange(n)[None], cache_index=(page_size + jnp.arange(n))[None],
               page_tables=jnp.arange(1, pages + 1)[None], kv_lens=jnp.array([n]),
               cu_q_lens=jnp.array([0, n], jnp.int32), sample_rows=jnp.array([n - 1]),
               block_rows=jnp.arange(n)[None], block_seq=jnp.zeros(1, jnp.int32))


  def group(self, g: int, num_groups: int) -> AttentionMetadata:
    """The metadata of page group g's layers: their page tables and cache slots only."""
    W = self.page_tables.shape[1] // num_groups
    return dataclasses.replace(self, page_tables=self.page_tables[:, g * W:(g + 1) * W],
                               cache_index=self.cache_index[g:g + 1])


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """How attention runs: static, part of every compiled step's identity."""

  backend: AttentionBackend = AttentionBackend.REFERENCE
  # The engine's mesh, when it has one: the kernels then run once per device (attend_per_shard).
  mesh: Mesh | None = None


def attend(q, k, v, cache: KVCache | WindowedKV, layer, meta: AttentionMetadata,
           spec: AttentionSpec, window=None, local_window: int | None = None):
  """q [1, T, N, H], the step's new k, v [1, T, K, H] -> (out [1, T, N, H], cache with k, v
  written). `window` (a scalar, may be traced): each query sees only the last `window`
  positions, its own included; `local_window` (static) is the one value below "all" it takes,
  which the kernels need at compile time."""
  if isinstance(cache, WindowedKV):
    return _attend_windowed(q, k, v, cache, layer, meta, spec, local_window)
  if spec.backend is AttentionBackend.REFERENCE:
    cache = cache.write(layer, meta.cache_index, k, v)  # One scatter (per array) for the step.
    return attend_reference(q, cache, layer, meta, window), cache
  platform = _KERNEL_PLATFORM[spec.backend]
  kernel = lambda q, k, v, cache, layer, meta: _attend_pallas(q, k, v, cache, layer, meta, platform)
  if isinstance(window, int):  # Static: a window pool's layer, always local.
    kernel = lambda *a: _attend_pallas(*a, platform, window)
  elif window is not None:  # Two kernels, one with the window compiled in; the layer picks one.
    full, local = kernel, lambda *a: _attend_pallas(*a, platform, local_window)
    kernel = lambda *a: jax.lax.cond(window > local_window, full, local, *a)
  if spec.mesh is None or axes.MODEL not in spec.mesh.axis_names:
    return kernel(q, k, v, cache, layer, meta)
  return attend_per_shard(kernel, q, k, v, cache, layer, meta, spec.mesh)


def _attend_windowed(q, k, v, cache: WindowedKV, layer, meta: AttentionMetadata,
                     spec: AttentionSpec, local_window: int):
  """A local layer reads and writes the window pool through the window tables (positions
  outside its window are masked; the entries of pages it freed name the scratch page), a global
  layer the full pool; one branch runs, picked on the device by the scanned layer index."""
  index = jnp.asarray(cache.index, jnp.int32)[layer]

  def full(c: WindowedKV):
    out, kv = attend(q, k, v, c.full, index, meta.group(0, c.PAGE_GROUPS), spec)
    return out, dataclasses.replace(c, full=kv)

  def local(c: WindowedKV):
    out, kv = attend(q, k, v, c.window, index, meta.group(1, c.PAGE_GROUPS), spec,
                     window=local_window, local_window=local_window)
    return out, dataclasses.replace(c, window=kv)

  if all(cache.is_window):  # Every layer local (Mistral): the full pool holds no layer.
    return local(cache)
  return jax.lax.cond(jnp.asarray(cache.is_window)[layer], local, full, cache)


def attend_per_shard(attend, q, k, v, cache: KVCache, layer, meta: AttentionMetadata, mesh: Mesh):
  """`attend(q, k, v, cache, layer, meta)` run once per device on its own heads under shard_map.
  For the Pallas kernels, which XLA cannot partition: left to GSPMD they would be run whole, on
  gathered copies of the cache. The packed token axis stays whole on every device."""
  heads = P(None, None, axes.MODEL, None)  # [1, T, N, H]: a device's query heads use its KV heads.
  # Only the KV-head split: page tables name pages of the whole cache, so each device needs
  # every page (of its own heads).
  kv = axes.cache_spec(cache.axes, only_model=True)
  cache_specs = jax.tree.map(lambda _: kv, cache)
  in_specs = (heads, heads, heads, cache_specs, P(), jax.tree.map(lambda _: P(), meta))
  return jax.shard_map(attend, mesh=mesh, in_specs=in_specs, out_specs=(heads, cache_specs),
                       check_vma=False)(q, k, v, cache, layer, meta)


def attend_reference(q, cache: KVCache, layer, meta: AttentionMetadata, window=None):
  """q [1, T, N, H] -> [1, T, N, H], the step's K/V already in `cache`. Simple, and fast on CPU:
  each decode row reads its own sequence's pages, each prefill query block of Tb tokens its
  sequence's pages once. Every query takes one softmax over its sequence's positions as the
  pages hold them, so a token's output does not depend on how its prompt was chunked, cached or
  batched. Only the table columns the step's longest sequence needs are read (`_by_width`)."""
  q = q[0]
  out = jnp.zeros_like(q)
  D, pos = meta.num_decode_rows, meta.positions[0]
  if D:
    out = _by_width(out, q, cache, layer, jnp.arange(D)[:, None], meta.page_tables[:D],
                    meta.kv_lens[:D], pos, window)
  if meta.block_rows.shape[0]:
    seq = meta.block_seq
    out = _by_width(out, q, cache, layer, meta.block_rows, meta.page_tables[seq],
                    meta.kv_lens[seq], pos, window)
  return out[None]


def _by_width(out, q, cache: KVCache, layer, rows, tables, kv_lens, positions, window):
  """`_attend_blocks` over the narrowest of the table widths `width_buckets` lists that holds
  every block's positions: one branch per width, picked on the device, in one program."""
  widths = width_buckets(tables.shape[1])
  need = (jnp.max(kv_lens) + cache.page_size - 1) // cache.page_size
  index = jnp.minimum(jnp.searchsorted(jnp.asarray(widths), need), len(widths) - 1)
  branches = [functools.partial(_attend_blocks, width=w) for w in widths]
  return jax.lax.switch(index, branches, out, q, cache, layer, rows, tables, kv_lens, positions,
                        window)


def _attend_blocks(out, q, cache: KVCache, layer, rows, tables, kv_lens, positions, window, *,
                   width):
  """out, q [T, N, H]; rows [A, R] packed rows (T: none), tables [A, W] and kv_lens [A] of each
  block's one sequence -> out with the blocks' rows set, reading the first `width` pages."""
  T, N, H = q.shape
  safe = jnp.minimum(rows, T - 1)
  qb, pos = q[safe], positions[safe]  # [A, R, N, H], [A, R]
  k, v = cache.gather(layer, tables[:, :width])  # [A, S, K, H] each
  A, R = rows.shape
  S, K = k.shape[1], k.shape[2]
  qb = qb.reshape(A, R, K, N // K, H)
  scores = jnp.einsum("ARKGH,ASKH->AKGRS", qb, k, preferred_element_type=jnp.float32)
  scores = scores * (H ** -0.5)
  kv_pos = jnp.arange(S)
  mask = (kv_pos[None, None, :] <= pos[:, :, None]) & (kv_pos < kv_lens[:, None, None])
  if window is not None:  # [A, R, S]: positions older than the window are out.
    mask &= kv_pos[None, None, :] > pos[:, :, None] - window
  scores = jnp.where(mask[:, None, None], scores, _MASKED)  # [A, K, G, R, S]
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  ob = jnp.einsum("AKGRS,ASKH->ARKGH", probs, v).reshape(A, R, N, H)
  return out.at[rows].set(ob.astype(out.dtype), mode="drop")


_KERNEL_PLATFORM = {AttentionBackend.PALLAS: None, AttentionBackend.PALLAS_TPU: "tpu",
                    AttentionBackend.PALLAS_GPU: "gpu"}


def _attend_pallas(q, k, v, cache: KVCache, layer, meta: AttentionMetadata, platform: str | None,
                   window: int | None = None):
  """The ragged kernel: writes the step's K/V into the pages and attends, in one call per layer,
  over the cache in place (the RAGGED layout)."""
  import kernels_pallas  # The kernels import Pallas; the reference path does not need it.

  if cache.layout is not KVLayout.RAGGED:
    raise ValueError(f"the Pallas backend runs on the ragged KV layout, not {cache.layout.value}")
  # The kernel quantizes the new K/V to the pages' dtype itself (float8 at scale 1.0).
  out, pages = kernels_pallas.ragged_paged_attention(
      q[0], k[0], v[0], cache.k, meta.page_tables,
      meta.cu_q_lens, meta.kv_lens, jnp.int32(meta.page_tables.shape[0]), layer=layer,
      sliding_window=window, platform=platform)
  return out[None], dataclasses.replace(cache, k=pages)

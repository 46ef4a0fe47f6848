"""Attention over the KV cache, behind one interface with swappable backends.

`attend` is called by every layer with the queries and an `AttentionMetadata` pytree that says
where each query sits; an `AttentionSpec` (static: the backend, and the mesh the kernels run on)
decides how the pages are read.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.config import AttentionBackend, KVLayout
from jaxserve.model import axes
from jaxserve.model.kv_cache import KVCache, KVPool

_MASKED = -1e30  # Finite, so a fully masked row (an idle slot) gives zeros, never NaN.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
  """Where every query of one packed step sits: T tokens on one axis, B sequences.

  Sequence b's new tokens are the packed rows [cu_q_lens[b], cu_q_lens[b + 1]); the first
  `num_decode_rows` sequences are decode rows of one token each (engine/step_args.py)."""

  positions: jax.Array  # [1, T] absolute position of each token.
  # [Pg, T] flat cache slot (page * Z + offset) each token's K/V goes to in each page group's
  # pool (Pg = 1, or 2 with window pages: the full pool, then the window pool).
  cache_index: jax.Array
  page_tables: jax.Array  # [B, Pg * W] pages of each sequence: each group's table, side by side.
  kv_lens: jax.Array  # [B] valid KV positions of each sequence once this step's K/V is written.
  cu_q_lens: jax.Array  # [B + 1] int32 from 0: cumulative new tokens per sequence.
  sample_rows: jax.Array  # [B] the packed row of each sequence's last token (its logits).
  block_rows: jax.Array  # [nb, Tb] packed rows of each prefill query block (T: none).
  block_seq: jax.Array  # [nb] the sequence of each block.
  # [1, T] the last position each query sees (None: its own). An image's tokens see every token
  # of their image, as Gemma 3 attends among them both ways in prefill (every backend).
  attend_until: jax.Array | None = None
  # [3, 1, T] each token's three M-RoPE positions (Qwen2.5-VL; model/rope.py), None for a model
  # with one: `positions` plus the step's rope_shifts.
  rope_positions: jax.Array | None = None
  num_decode_rows: int = dataclasses.field(default=0, metadata=dict(static=True))  # Bd

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


def attend(q, k, v, cache: KVCache, layer, meta: AttentionMetadata, spec: AttentionSpec,
           window=None, local_window: int | None = None):
  """q [1, T, N, H], the step's new k, v [1, T, K, H] -> (out [1, T, N, H], cache with k, v
  written). `window` (a scalar, may be traced): each query sees only the last `window`
  positions, its own included; `local_window` (static) is the one value below "all" it takes,
  which the kernels need at compile time."""
  if cache.num_groups > 1:  # Window pages: each layer is in one of the two pools.
    return _attend_windowed(q, k, v, cache, layer, meta, spec, local_window)
  out, pool = attend_pool(q, k, v, cache.groups[0], layer, meta, spec, window, local_window)
  return out, cache.with_groups((pool,))


def attend_pool(q, k, v, pool: KVPool, layer, meta: AttentionMetadata, spec: AttentionSpec,
                window=None, local_window: int | None = None):
  """`attend` on one page group's pool (layer: its index there; meta: that group's)."""
  if spec.backend is AttentionBackend.REFERENCE:
    pool = pool.write(layer, meta.cache_index, k, v)  # One scatter (per array) for the step.
    return attend_reference(q, pool, layer, meta, window), pool
  platform = _KERNEL_PLATFORM[spec.backend]
  kernel = lambda q, k, v, pool, layer, meta: _attend_pallas(q, k, v, pool, layer, meta, platform)
  if isinstance(window, int):  # Static: a window pool's layer, always local.
    kernel = lambda *a: _attend_pallas(*a, platform, window)
  elif window is not None:  # Two kernels, one with the window compiled in; the layer picks one.
    full, local = kernel, lambda *a: _attend_pallas(*a, platform, local_window)
    kernel = lambda *a: jax.lax.cond(window > local_window, full, local, *a)
  if spec.mesh is None or axes.MODEL not in spec.mesh.axis_names:
    return kernel(q, k, v, pool, layer, meta)
  return attend_per_shard(kernel, q, k, v, pool, layer, meta, spec.mesh)


def _attend_windowed(q, k, v, cache: KVCache, layer, meta: AttentionMetadata,
                     spec: AttentionSpec, local_window: int):
  """A local layer reads and writes the window pool through the window tables (positions
  outside its window are masked; the entries of pages it freed name the scratch page), a global
  layer the full pool; one branch runs, picked on the device by the scanned layer index."""
  index = jnp.asarray(cache.index, jnp.int32)[layer]

  def full(c: KVCache):
    out, pool = attend_pool(q, k, v, c.groups[0], index, meta.group(0, c.num_groups), spec)
    return out, c.with_groups((pool, c.groups[1]))

  def local(c: KVCache):
    out, pool = attend_pool(q, k, v, c.groups[1], index, meta.group(1, c.num_groups), spec,
                            window=local_window, local_window=local_window)
    return out, c.with_groups((c.groups[0], pool))

  if all(cache.is_window):  # Every layer local (Mistral): the full pool holds no layer.
    return local(cache)
  return jax.lax.cond(jnp.asarray(cache.is_window)[layer], local, full, cache)


def attend_per_shard(attend, q, k, v, cache: KVPool, layer, meta: AttentionMetadata, mesh: Mesh):
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


def attend_reference(q, cache: KVPool, layer, meta: AttentionMetadata, window=None):
  """q [1, T, N, H] -> [1, T, N, H], the step's K/V already in `cache`. Simple, and fast on CPU:
  each decode row and each prefill query block of Tb tokens reads its sequence's pages, a chunk
  of them at a time (`_attend_blocks`), only as far as the step's longest sequence reaches.
  Every query runs the same online softmax over its sequence's positions in chunks at fixed
  positions, so a token's output does not depend on how its prompt was chunked, cached or
  batched."""
  q = q[0]
  out = jnp.zeros_like(q)
  Bd, pos = meta.num_decode_rows, meta.positions[0]
  until = pos if meta.attend_until is None else meta.attend_until[0]
  if Bd:
    out = _attend_blocks(out, q, cache, layer, jnp.arange(Bd)[:, None], meta.page_tables[:Bd],
                         meta.kv_lens[:Bd], pos, until, window)
  if meta.block_rows.shape[0]:
    seq = meta.block_seq
    out = _attend_blocks(out, q, cache, layer, meta.block_rows, meta.page_tables[seq],
                         meta.kv_lens[seq], pos, until, window)
  return out[None]


# C: KV positions one online-softmax step reads (rounded to whole pages). Every query's softmax
# runs over chunks at these fixed positions, so it must be the same for decode and prefill.
KV_CHUNK = 128


def _attend_blocks(out, q, cache: KVPool, layer, rows, tables, kv_lens, positions, until,
                   window):
  """out, q [T, N, H]; rows [A, R] packed rows (T: none), tables [A, W] and kv_lens [A] of each
  block's one sequence; positions and until [T] (AttentionMetadata's) -> out with the blocks'
  rows set.

  A flash-style online softmax over the context, Q pages (C positions) at a time, from the
  first chunk a window can see to the last one the longest sequence holds: the cost follows the
  positions attended, and no [rows x table width] score matrix or whole-context gather is ever
  materialized. A chunk that masks a query entirely leaves its running max, sum and output
  exactly as they were, so how many chunks a step runs changes no query's result."""
  T, N, H = q.shape
  A, R = rows.shape
  Z = cache.page_size
  Q = max(1, KV_CHUNK // Z)
  C = Q * Z
  safe = jnp.minimum(rows, T - 1)
  pos, last_seen = positions[safe], until[safe]  # [A, R]
  tables = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % Q)))  # Whole chunks; SCRATCH_PAGE.
  first, last = 0, 1  # One chunk holds the whole table: static bounds, which reverse-mode
  if tables.shape[1] > Q:  # autodiff needs (a trainer's forward, scripts/rl.py); same result.
    if window is not None:  # Chunks wholly before every query's window are skipped.
      first = jnp.maximum(jnp.min(pos) - window + 1, 0) // C
    last = (jnp.max(kv_lens) + C - 1) // C

  def chunk(j, carry):
    k, v = cache.gather(layer, jax.lax.dynamic_slice_in_dim(tables, j * Q, Q, axis=1))
    mask = _mask(j * C + jnp.arange(C), pos, last_seen, kv_lens, window)
    return _online_step(carry, qb, k, v, mask)

  K = cache.num_kv_heads
  qb = q[safe].reshape(A, R, K, N // K, H)  # [A, R, K, G, H]
  stats = jnp.full((A, K, N // K, R), _MASKED, jnp.float32)  # [A, K, G, R]
  init = (stats, jnp.zeros_like(stats), jnp.zeros((A, K, N // K, R, H), jnp.float32))
  _, total, acc = jax.lax.fori_loop(first, last, chunk, init)
  ob = acc / jnp.where(total > 0, total, 1.0)[..., None]  # An idle row (nothing seen): zeros.
  ob = ob.transpose(0, 3, 1, 2, 4).reshape(A, R, N, H)
  return out.at[rows].set(ob.astype(out.dtype), mode="drop")


def _mask(kv_pos, pos, until, kv_lens, window):
  """[A, 1, 1, R, C]: which of the chunk's positions kv_pos [C] each query (at pos [A, R])
  sees: those up to `until` [A, R] (its own, or its image's last) its sequence holds, not
  older than its window (transformers' AND of the window with causal-OR-image)."""
  mask = (kv_pos[None, None, :] <= until[:, :, None]) & (kv_pos < kv_lens[:, None, None])
  if window is not None:  # Positions older than the window are out.
    mask &= kv_pos[None, None, :] > pos[:, :, None] - window
  return mask[:, None, None]


def _online_step(carry, qb, k, v, mask):
  """One chunk of the online softmax: carry (running max [A, K, G, R], sum [A, K, G, R], output
  [A, K, G, R, H]), qb [A, R, K, G, H], k, v [A, C, K, H], mask [A, 1, 1, R, C]."""
  m, total, acc = carry
  H = qb.shape[-1]
  scores = jnp.einsum("ARKGH,ACKH->AKGRC", qb, k, preferred_element_type=jnp.float32)
  scores = jnp.where(mask, scores * (H ** -0.5), _MASKED)  # [A, K, G, R, C]
  m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
  scale = jnp.exp(m - m_new)  # 1 exactly where the chunk shows a query nothing new.
  p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
  pv = jnp.einsum("AKGRC,ACKH->AKGRH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return m_new, total * scale + jnp.sum(p, axis=-1), acc * scale[..., None] + pv


_KERNEL_PLATFORM = {AttentionBackend.PALLAS: None, AttentionBackend.PALLAS_TPU: "tpu",
                    AttentionBackend.PALLAS_GPU: "gpu", AttentionBackend.CPU: "cpu-ffi"}


def _attend_pallas(q, k, v, cache: KVPool, layer, meta: AttentionMetadata, platform: str | None,
                   window: int | None = None):
  """The ragged kernel: writes the step's K/V into the pages and attends, in one call per layer,
  over the cache in place (the RAGGED layout)."""
  import kernels_cpu
  import kernels_pallas  # The kernels import Pallas; the reference path does not need it.

  if cache.layout is not KVLayout.RAGGED:
    raise ValueError(f"the Pallas backend runs on the ragged KV layout, not {cache.layout.value}")
  # The kernel quantizes the new K/V to the pages' dtype itself (float8 at scale 1.0).
  args = (q[0], k[0], v[0], cache.k, meta.page_tables, meta.cu_q_lens, meta.kv_lens,
          jnp.int32(meta.page_tables.shape[0]))
  until = None if meta.attend_until is None else meta.attend_until[0]
  kw = dict(layer=layer, sliding_window=window, attend_until=until)
  if platform == "cpu-ffi":  # The same op in C++ (kernels_cpu/ragged.cc), on the CPU.
    out, pages = kernels_cpu.ragged_paged_attention(*args, **kw)
  else:
    out, pages = kernels_pallas.ragged_paged_attention(*args, **kw, platform=platform)
  return out[None], dataclasses.replace(cache, k=pages)

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
from jaxserve.model.kv_cache import KVCache

_MASKED = -1e30  # Finite, so a fully masked row (an idle slot) gives zeros, never NaN.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
  """Where every query of one packed step sits: T tokens on one axis, B sequences.

  Sequence b's new tokens are the packed rows [cu_q_lens[b], cu_q_lens[b + 1]); the first
  `num_decode_rows` sequences are decode rows of one token each (engine/step_args.py)."""

  positions: jax.Array  # [1, T] absolute position of each token.
  cache_index: jax.Array  # [1, T] flat cache slot (page * Z + offset) each token's K/V goes to.
  page_tables: jax.Array  # [B, W] pages of each sequence.
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
  if spec.backend is AttentionBackend.REFERENCE:
    cache = cache.write(layer, meta.cache_index, k, v)  # One scatter (per array) for the step.
    return attend_reference(q, cache, layer, meta, window), cache
  platform = _KERNEL_PLATFORM[spec.backend]
  kernel = lambda q, k, v, cache, layer, meta: _attend_pallas(q, k, v, cache, layer, meta, platform)
  if window is not None:  # Two kernels, one with the window compiled in; the layer picks one.
    full, local = kernel, lambda *a: _attend_pallas(*a, platform, local_window)
    kernel = lambda *a: jax.lax.cond(window > local_window, full, local, *a)
  if spec.mesh is None or axes.MODEL not in spec.mesh.axis_names:
    return kernel(q, k, v, cache, layer, meta)
  return attend_per_shard(kernel, q, k, v, cache, layer, meta, spec.mesh)


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

  - decode rows (the first D) each read their own sequence's pages;
  - prefill tokens attend to the step's own tokens of their sequence (read back from the cache at
    `cache_index`, so a quantized cache gives what later steps will read), and, only when some
    sequence of the step has a cached prefix (a later chunk, a prefix-cache hit), each query
    block of Tb tokens reads its sequence's pages for it. The two softmax parts are merged.
  """
  q, pos = q[0], meta.positions[0]  # [T, N, H], [T]
  T, D = q.shape[0], meta.num_decode_rows
  parts = []
  if D:  # [D, 1, N, H] over [D, S]: each row's own pages, its new token included.
    k, v = cache.gather(layer, meta.page_tables[:D])
    kv_pos = jnp.arange(k.shape[1])
    mask = _causal(kv_pos[None, None], pos[:D, None, None], window) & (
        kv_pos < meta.kv_lens[:D, None, None])
    o, m, l = _softmax_parts(q[:D, None], k, v, mask)
    parts.append(o[:, 0] / l[:, 0, :, None])
  if T > D:
    parts.append(_attend_prefill(q, pos, cache, layer, meta, window))
  out = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
  return out.astype(q.dtype)[None]


def _attend_prefill(q, pos, cache: KVCache, layer, meta: AttentionMetadata, window):
  """The prefill rows [D, T) of q [T, N, H] -> [T - D, N, H]."""
  T, D, Z = q.shape[0], meta.num_decode_rows, cache.page_size
  B = meta.kv_lens.shape[0]
  rows = jnp.arange(D, T)
  seq = jnp.clip(jnp.searchsorted(meta.cu_q_lens, rows, side="right", method="compare_all") - 1,
                 0, B - 1)  # [P]
  real = rows < meta.cu_q_lens[-1]
  # The step's own tokens: K/V as stored, each at its flat cache slot.
  index = meta.cache_index[0, D:]  # [P]
  k, v = cache.gather(layer, (index // Z)[:, None])  # [P, Z, K, H]
  pick = lambda x: jnp.take_along_axis(x, (index % Z)[:, None, None, None], axis=1)[:, 0]
  k, v, qp, pp = pick(k)[None], pick(v)[None], q[D:][None], pos[D:]  # [1, P, K, H], [1, P, N, H]
  mask = (seq[:, None] == seq[None, :]) & real[None, :] & _causal(pp[None, :], pp[:, None], window)
  o, m, l = (x[0] for x in _softmax_parts(qp, k, v, mask[None]))  # [P, N, H], [P, N], [P, N]

  prefix = meta.kv_lens - jnp.diff(meta.cu_q_lens)  # [B]: positions cached before this step
  has_prefix = jnp.any(prefix[D:] > 0)
  o2, m2, l2 = jax.lax.cond(has_prefix, _prefix_parts, _no_prefix_parts,
                            q, pos, cache, layer, meta, prefix, window)
  m_all = jnp.maximum(m, m2[D:])
  a, b = jnp.exp(m - m_all), jnp.exp(m2[D:] - m_all)
  return (o * a[..., None] + o2[D:] * b[..., None]) / (l * a + l2[D:] * b)[..., None]


def _prefix_parts(q, pos, cache: KVCache, layer, meta: AttentionMetadata, prefix, window):
  """Each prefill query block over its sequence's cached prefix -> (o [T, N, H], m, l [T, N]),
  unnormalised, rows of no block masked out."""
  T, N, H = q.shape
  rows, seq = meta.block_rows, meta.block_seq  # [nb, Tb], [nb]
  safe = jnp.minimum(rows, T - 1)
  k, v = cache.gather(layer, meta.page_tables[seq])  # [nb, S, K, H]
  kv_pos = jnp.arange(k.shape[1])
  mask = (kv_pos[None, None, :] < prefix[seq][:, None, None]) & _causal(
      kv_pos[None, None, :], pos[safe][:, :, None], window)
  o, m, l = _softmax_parts(q[safe], k, v, mask)
  empty = _no_prefix_parts(q, pos, cache, layer, meta, prefix, window)
  return tuple(x.at[rows].set(y, mode="drop") for x, y in zip(empty, (o, m, l)))


def _no_prefix_parts(q, pos, cache, layer, meta, prefix, window):
  T, N, H = q.shape
  return (jnp.zeros((T, N, H), jnp.float32), jnp.full((T, N), _MASKED, jnp.float32),
          jnp.zeros((T, N), jnp.float32))


def _causal(kv_pos, q_pos, window):
  """Keys at kv_pos visible from queries at q_pos (broadcast): not after it, and inside the
  window when there is one."""
  mask = kv_pos <= q_pos
  if window is not None:
    mask &= kv_pos > q_pos - window
  return mask


def _softmax_parts(q, k, v, mask):
  """q [A, R, N, H] over k, v [A, S, K, H] where mask [A, R, S] -> (o [A, R, N, H], m [A, R, N],
  l [A, R, N]): the softmax's unnormalised output, row max and sum, so parts over different keys
  merge exactly (out = o / l)."""
  A, R, N, H = q.shape
  K = k.shape[2]
  scores = jnp.einsum("ARKGH,ASKH->ARKGS", q.reshape(A, R, K, N // K, H), k,
                      preferred_element_type=jnp.float32) * (H ** -0.5)
  scores = jnp.where(mask[:, :, None, None, :], scores, _MASKED)
  m = jnp.max(scores, axis=-1)
  p = jnp.exp(scores - m[..., None])
  l = jnp.sum(p, axis=-1)
  o = jnp.einsum("ARKGS,ASKH->ARKGH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return o.reshape(A, R, N, H), m.reshape(A, R, N), l.reshape(A, R, N)


_KERNEL_PLATFORM = {AttentionBackend.PALLAS: None, AttentionBackend.PALLAS_TPU: "tpu",
                    AttentionBackend.PALLAS_GPU: "gpu"}


def _attend_pallas(q, k, v, cache: KVCache, layer, meta: AttentionMetadata, platform: str | None,
                   window: int | None = None):
  """The ragged kernel: writes the step's K/V into the pages and attends, in one call per layer,
  over the cache in place (the RAGGED layout)."""
  import kernels_pallas  # The kernels import Pallas; the reference path does not need it.

  if cache.layout is not KVLayout.RAGGED:
    raise ValueError(f"the Pallas backend runs on the ragged KV layout, not {cache.layout.value}")
  out, pages = kernels_pallas.ragged_paged_attention(
      q[0], k[0].astype(cache.k.dtype), v[0].astype(cache.k.dtype), cache.k, meta.page_tables,
      meta.cu_q_lens, meta.kv_lens, jnp.int32(meta.page_tables.shape[0]), layer=layer,
      sliding_window=window, platform=platform)
  return out[None], dataclasses.replace(cache, k=pages)

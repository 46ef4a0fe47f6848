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
  positions: jax.Array  # [B, T] absolute position of each query token.
  cache_index: jax.Array  # [B, T] flat cache slot (page * Z + offset) each token's K/V goes to.
  page_tables: jax.Array  # [B, W] pages of each sequence.
  kv_lens: jax.Array  # [B] valid KV positions of each sequence once this step's K/V is written.
  q_lens: jax.Array  # [B] real (unpadded) query tokens of each sequence.

  @property
  def last_index(self):
    """[B] index in T of each sequence's last real query token."""
    return jnp.maximum(self.q_lens - 1, 0)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """How attention runs: static, part of every compiled step's identity."""

  backend: AttentionBackend = AttentionBackend.REFERENCE
  # The engine's mesh, when it has one: the kernels then run once per device (attend_per_shard).
  mesh: Mesh | None = None


def attend(q, cache: KVCache, layer, meta: AttentionMetadata, spec: AttentionSpec, window=None):
  """q [B, T, N, H] -> [B, T, N, H]. `window` (a scalar, may be traced): each query sees only
  the last `window` positions, its own included."""
  # The paged kernels do not take a window (the ragged kernel does; issue 14): a model with one
  # runs on the reference.
  if spec.backend is AttentionBackend.REFERENCE or window is not None:
    return attend_reference(q, cache, layer, meta, window)
  platform = _KERNEL_PLATFORM[spec.backend]
  kernel = lambda q, cache, layer, meta: _attend_pallas(q, cache, layer, meta, platform)
  if spec.mesh is None or axes.MODEL not in spec.mesh.axis_names:
    return kernel(q, cache, layer, meta)
  return attend_per_shard(kernel, q, cache, layer, meta, spec.mesh)


def attend_per_shard(attend, q, cache: KVCache, layer, meta: AttentionMetadata, mesh: Mesh):
  """`attend(q, cache, layer, meta)` -> [B, T, N, H], run once per device on its own heads (and
  slots, when B splits over `data`) under shard_map. For the Pallas kernels, which XLA cannot
  partition: left to GSPMD they would be run whole, on gathered copies of the cache."""
  batch = axes.DATA if q.shape[0] % mesh.shape[axes.DATA] == 0 else None  # Prefill's B=1 stays whole.
  heads = P(batch, None, axes.MODEL, None)  # [B, T, N, H]: a device's query heads use its KV heads.
  # Only the KV-head split: page tables name pages of the whole cache, so each device needs
  # every page (of its own heads).
  kv = axes.cache_spec(cache.axes, only_model=True)
  in_specs = (heads, jax.tree.map(lambda _: kv, cache), P(),
              jax.tree.map(lambda _: P(batch), meta))  # Every metadata field is [B, ...].
  return jax.shard_map(attend, mesh=mesh, in_specs=in_specs, out_specs=heads,
                       check_vma=False)(q, cache, layer, meta)


def attend_reference(q, cache: KVCache, layer, meta: AttentionMetadata, window=None):
  """Gathers each sequence's pages and runs a masked softmax: simple, and fast on CPU."""
  B, T, N, H = q.shape
  k, v = cache.gather(layer, meta.page_tables)  # [B, S, K, H] each
  S, K = k.shape[1], k.shape[2]
  q = q.reshape(B, T, K, N // K, H)
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
  scores = scores * (H ** -0.5)
  kv_pos = jnp.arange(S)
  mask = (kv_pos[None, None, :] <= meta.positions[:, :, None]) & (kv_pos < meta.kv_lens[:, None, None])
  if window is not None:  # [B, T, S]: positions older than the window are out.
    mask &= kv_pos[None, None, :] > meta.positions[:, :, None] - window
  scores = jnp.where(mask[:, None, None], scores, _MASKED)  # [B, K, G, T, S]
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
  return out.reshape(B, T, N, H)


_KERNEL_PLATFORM = {AttentionBackend.PALLAS: None, AttentionBackend.PALLAS_TPU: "tpu",
                    AttentionBackend.PALLAS_GPU: "gpu"}


def _attend_pallas(q, cache: KVCache, layer, meta: AttentionMetadata, platform: str | None):
  import kernels_pallas  # The kernels import Pallas; the reference path does not need it.

  B, T, N, H = q.shape
  if T == 1:  # Decode: one query per slot, over the cache as stored (any layout and dtype).
    k, v, k_scale, v_scale, tables = cache.decode_pages(meta.page_tables)
    out = kernels_pallas.paged_decode_attention(
        q[:, 0], k, v, tables, meta.kv_lens, k_scale=k_scale, v_scale=v_scale,
        layout=_decode_layout(cache.layout), layer=layer, platform=platform)
    return out[:, None]
  # Prefill reads token-major pages: the cache hands them over in place where its layout
  # allows, else rearranged for this one layer (KVCache.kernel_pages). It runs once per
  # prompt chunk, decode once per token: the copy only matters for decode.
  k_pages, v_pages, tables, layer = cache.kernel_pages(layer, meta.page_tables)
  # Prefill: B sequences packed back to back as one ragged batch.
  cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(meta.q_lens)]).astype(jnp.int32)
  packed = _pack(q, meta.q_lens, cu_q_lens)  # [B * T, N, H]
  out = kernels_pallas.ragged_prefill_attention(packed, k_pages, v_pages, tables,
                                                cu_q_lens, meta.kv_lens, layer=layer, platform=platform)
  return _unpack(out, cu_q_lens, T)


def _decode_layout(layout: KVLayout):
  """The decode kernel's name for the cache's layout (contiguous is viewed as token-major)."""
  from kernels_pallas import PageLayout

  return {KVLayout.PAGED_TOKEN_MAJOR: PageLayout.TOKEN_MAJOR,
          KVLayout.CONTIGUOUS: PageLayout.TOKEN_MAJOR,
          KVLayout.PAGED_HEAD_MAJOR: PageLayout.HEAD_MAJOR,
          KVLayout.PAGED_KV_INTERLEAVED: PageLayout.KV_INTERLEAVED}[layout]


def _pack(q, q_lens, cu_q_lens):
  B, T = q.shape[:2]
  t = jnp.arange(B * T)
  seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, B - 1)
  idx = t - cu_q_lens[seq]
  valid = t < cu_q_lens[-1]
  return jnp.where(valid[:, None, None], q[seq, jnp.minimum(idx, T - 1)], 0)


def _unpack(out, cu_q_lens, T):
  rows = jnp.minimum(cu_q_lens[:-1, None] + jnp.arange(T)[None, :], out.shape[0] - 1)  # [B, T]
  return out[rows]

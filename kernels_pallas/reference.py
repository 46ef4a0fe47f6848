"""Plain-jnp paged attention: the kernels' shared reference (gather the pages, masked softmax).

Written for clarity, not speed: it materialises every sequence's whole page table of K/V.
Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import common


def _gather_pages(pages, page_tables):
  """[P, Z, K, H] pages, [A, W] tables -> [A, W * Z, K, H] f32 K or V in position order."""
  a, w = page_tables.shape
  _, z, k, h = pages.shape
  return pages[page_tables].reshape(a, w * z, k, h).astype(jnp.float32)


def _masked_attention(q_AKGH, k_ASKH, v_ASKH, mask_AS, sm_scale: float):
  """Softmax attention of each row a over its S keys where mask; all-masked rows give 0."""
  logits = jnp.einsum("akgh,askh->akgs", q_AKGH.astype(jnp.float32), k_ASKH) * sm_scale
  mask = mask_AS[:, None, None, :]  # [A, 1, 1, S]
  logits = jnp.where(mask, logits, -jnp.inf)  # [A, K, G, S]
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)  # [A, K, G, S]
  l = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("akgs,askh->akgh", p, v_ASKH)  # [A, K, G, H]
  return out / jnp.where(l > 0, l, 1.0)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def paged_decode_reference(q, k_pages, v_pages, page_tables, lengths, *, sm_scale=None):
  """q [B, N, H] attends to positions [0, lengths[b]) of its pages; returns [B, N, H]."""
  dims = common.check_decode_args(q, k_pages, v_pages, page_tables, lengths)
  b, n, h = q.shape
  scale = common.default_scale(sm_scale, h)
  k = _gather_pages(k_pages, page_tables)  # [B, S, K, H]
  v = _gather_pages(v_pages, page_tables)
  mask = jnp.arange(k.shape[1])[None, :] < lengths[:, None]  # [B, S]
  q_BKGH = q.reshape(b, dims.num_kv_heads, dims.group, h)
  return _masked_attention(q_BKGH, k, v, mask, scale).reshape(b, n, h).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def ragged_prefill_reference(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *,
                             sm_scale=None):
  """Packed q [T, N, H]: token i of sequence b sits at position kv_lens[b] - q_len[b] + i and
  attends causally to positions <= its own; padding rows give 0. Returns [T, N, H]."""
  dims = common.check_prefill_args(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
  t, n, h = q.shape
  scale = common.default_scale(sm_scale, h)
  tok = jnp.arange(t)  # [T]
  seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, kv_lens.shape[0] - 1)
  valid = tok < cu_q_lens[-1]  # [T]
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [B]
  pos = kv_lens[seq] - q_lens[seq] + tok - cu_q_lens[seq]  # [T]
  k = _gather_pages(k_pages, page_tables[seq])  # [T, S, K, H]
  v = _gather_pages(v_pages, page_tables[seq])
  mask = (jnp.arange(k.shape[1])[None, :] <= pos[:, None]) & valid[:, None]  # [T, S]
  q_TKGH = q.reshape(t, dims.num_kv_heads, dims.group, h)
  return _masked_attention(q_TKGH, k, v, mask, scale).reshape(t, n, h).astype(q.dtype)

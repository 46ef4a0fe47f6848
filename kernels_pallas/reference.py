"""Plain-jnp paged attention: the kernels' shared reference (gather the pages, masked softmax).

Written for clarity, not speed: it materialises every sequence's whole page table of K/V.
Shape letters as in common.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import common


def _gather_pages(pages, page_tables):
  """[P, B, K, D] pages, [X, W] tables -> [X, W * B, K, D] f32 K or V in position order."""
  x, w = page_tables.shape
  _, b, k, d = pages.shape
  return pages[page_tables].reshape(x, w * b, k, d).astype(jnp.float32)


def _masked_attention(q_XKGD, k_XLKD, v_XLKD, mask_XL, sm_scale: float):
  """Softmax attention of each row x over its L keys where mask; all-masked rows give 0."""
  logits = jnp.einsum("xkgd,xlkd->xkgl", q_XKGD.astype(jnp.float32), k_XLKD) * sm_scale
  mask = mask_XL[:, None, None, :]  # [X, 1, 1, L]
  logits = jnp.where(mask, logits, -jnp.inf)  # [X, K, G, L]
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)  # [X, K, G, L]
  l = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("xkgl,xlkd->xkgd", p, v_XLKD)  # [X, K, G, D]
  return out / jnp.where(l > 0, l, 1.0)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def paged_decode_reference(q, k_pages, v_pages, page_tables, lengths, *, sm_scale=None):
  """q [S, H, D] attends to positions [0, lengths[s]) of its pages; returns [S, H, D]."""
  dims = common.check_decode_args(q, k_pages, v_pages, page_tables, lengths)
  s, h, d = q.shape
  scale = common.default_scale(sm_scale, d)
  k = _gather_pages(k_pages, page_tables)  # [S, L, K, D]
  v = _gather_pages(v_pages, page_tables)
  mask = jnp.arange(k.shape[1])[None, :] < lengths[:, None]  # [S, L]
  q_SKGD = q.reshape(s, dims.num_kv_heads, dims.group, d)
  return _masked_attention(q_SKGD, k, v, mask, scale).reshape(s, h, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def ragged_prefill_reference(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *,
                             sm_scale=None):
  """Packed q [T, H, D]: token i of sequence s sits at position kv_lens[s] - q_len[s] + i and
  attends causally to positions <= its own; padding rows give 0. Returns [T, H, D]."""
  dims = common.check_prefill_args(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
  t, h, d = q.shape
  scale = common.default_scale(sm_scale, d)
  tok = jnp.arange(t)  # [T]
  seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, kv_lens.shape[0] - 1)
  valid = tok < cu_q_lens[-1]  # [T]
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [N]
  pos = kv_lens[seq] - q_lens[seq] + tok - cu_q_lens[seq]  # [T]
  k = _gather_pages(k_pages, page_tables[seq])  # [T, L, K, D]
  v = _gather_pages(v_pages, page_tables[seq])
  mask = (jnp.arange(k.shape[1])[None, :] <= pos[:, None]) & valid[:, None]  # [T, L]
  q_TKGD = q.reshape(t, dims.num_kv_heads, dims.group, d)
  return _masked_attention(q_TKGD, k, v, mask, scale).reshape(t, h, d).astype(q.dtype)

"""Plain-jnp ragged paged attention: the kernels' reference (write the new K/V, then attend).

Written for clarity, not speed: each token gathers its own sequence's pages. It reads only the
pages a sequence uses (page-table entries past a sequence's last page are never gathered) and
zeroes every masked value, so nothing in a page no sequence owns can reach an output.
Shape letters: the key in jaxserve/model/__init__.py; B sequences, W pages per sequence,
N query heads, G = N / K,
S key positions of one token's sequence (W * Z).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import kv_quant, ragged_checks, ragged_layout


def token_sequences(cu_q_lens, num_seqs, num_tokens: int):
  """seq [T] (the sequence of each packed token, clipped to [0, B)) and valid [T] (a real token
  of one of the first num_seqs sequences; padding and later sequences are not)."""
  tok = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
  live = jnp.arange(cu_q_lens.shape[0] - 1) < num_seqs  # [B]
  seq = jnp.sum((cu_q_lens[None, 1:] <= tok[:, None]) & live[None, :], axis=1)  # [T]
  valid = tok < cu_q_lens[num_seqs]
  return jnp.minimum(seq, cu_q_lens.shape[0] - 2).astype(jnp.int32), valid


def token_positions(cu_q_lens, kv_lens, seq):
  """[T] the KV position of each packed token: its sequence's new tokens end at kv_lens."""
  tok = jnp.arange(seq.shape[0], dtype=jnp.int32)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [B]
  return kv_lens[seq] - q_lens[seq] + tok - cu_q_lens[seq]


def token_reach(attend_until, cu_q_lens, kv_lens, num_seqs, num_tokens: int):
  """[T] int32 >= 0: how far past its own position each packed token attends, from
  attend_until [T] (the last position each sees) kept within its own sequence's keys; 0 for
  padding and for tokens that see only up to themselves."""
  seq, valid = token_sequences(cu_q_lens, num_seqs, num_tokens)
  pos = token_positions(cu_q_lens, kv_lens, seq)
  reach = jnp.minimum(attend_until, kv_lens[seq] - 1) - pos
  return jnp.where(valid, jnp.maximum(reach, 0), 0).astype(jnp.int32)


def write_new_kv(rows_TC, kv_pages, page_tables, seq, pos, valid, layer):
  """Scatters each valid token's row into its page; padding tokens write nothing."""
  num_layers, num_pages, page_size, lanes = kv_pages.shape
  page = page_tables[seq, jnp.clip(pos // page_size, 0, page_tables.shape[1] - 1)]  # [T]
  flat = (layer * num_pages + page) * page_size + pos % page_size  # [T]
  flat = jnp.where(valid, flat, num_layers * num_pages * page_size)  # Out of range: dropped.
  pages = kv_pages.reshape(-1, lanes).at[flat].set(rows_TC.astype(kv_pages.dtype), mode="drop")
  return pages.reshape(kv_pages.shape)


def _attend(q_TKGH, k_TSKH, v_TSKH, mask_TS, sm_scale: float):
  logits = jnp.einsum("TKGH,TSKH->TKGS", q_TKGH, k_TSKH) * sm_scale
  mask = mask_TS[:, None, None, :]  # [T, 1, 1, S]
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)  # [T, K, G, S]
  l = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("TKGS,TSKH->TKGH", p, v_TSKH)
  return out / jnp.where(l > 0, l, 1.0)  # Rows with no key (padding) are 0.


def new_rows(k_new, v_new, layout: ragged_layout.RaggedLayout, k_scale: float, v_scale: float):
  """The step's new K/V [T, K, H] quantized to the pages' dtype -> page rows [T, Cr]."""
  (k, k_exp), (v, v_exp) = (kv_quant.quantize(k_new, layout.dtype, k_scale),
                            kv_quant.quantize(v_new, layout.dtype, v_scale))
  exponents = None if k_exp is None else jnp.concatenate([k_exp, v_exp], axis=-1)  # [T, 2K]
  return ragged_layout.pack_rows(k, v, layout.lanes, exponents)


def read_rows(rows, layout: ragged_layout.RaggedLayout, k_scale: float, v_scale: float):
  """[..., Cr] page rows -> K, V [..., K, H] in float32, dequantized."""
  k, v = ragged_layout.unpack_rows(rows, layout.num_kv_heads, layout.head_dim)
  if not layout.scale_lanes:
    return kv_quant.dequantize(k, None, k_scale), kv_quant.dequantize(v, None, v_scale)
  k_exp, v_exp = ragged_layout.unpack_exponents(rows, layout.num_kv_heads, layout.head_dim)
  return kv_quant.dequantize(k, k_exp), kv_quant.dequantize(v, v_exp)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "k_scale", "v_scale"))
def ragged_paged_attention_reference(q, k_new, v_new, kv_pages, page_tables, cu_q_lens, kv_lens,
                                     num_seqs, *, layer=None, sm_scale=None, sliding_window=None,
                                     k_scale=None, v_scale=None, attend_until=None):
  """See kernels_pallas.ragged_paged_attention; returns (out [T, N, H], kv_pages)."""
  dims = ragged_checks.check_args(q, k_new, v_new, kv_pages, page_tables, cu_q_lens, kv_lens,
                                  num_seqs, layer, sliding_window, attend_until)
  k_scale, v_scale = ragged_checks.kv_scales(kv_pages.dtype, k_scale, v_scale)
  pages = kv_pages if layer is not None else kv_pages[None]
  layer = jnp.int32(0) if layer is None else jnp.asarray(layer, jnp.int32)
  t, n, h = q.shape
  seq, valid = token_sequences(cu_q_lens, num_seqs, t)
  pos = token_positions(cu_q_lens, kv_lens, seq)  # [T]
  rows = new_rows(k_new, v_new, dims.layout, k_scale, v_scale)  # [T, Cr]
  pages = write_new_kv(rows, pages, page_tables, seq, pos, valid, layer)

  z = dims.page_size
  key_pos = jnp.arange(page_tables.shape[1] * z, dtype=jnp.int32)  # [S]
  used_pages = jnp.maximum(-(-kv_lens[seq] // z), 1)  # [T]
  slot = jnp.minimum(key_pos[None, :] // z, used_pages[:, None] - 1)  # [T, S] never past the end
  gathered = pages[layer][page_tables[seq[:, None], slot], key_pos % z]  # [T, S, Cr]
  last = pos if attend_until is None else pos + token_reach(attend_until, cu_q_lens, kv_lens,
                                                            num_seqs, t)
  mask = valid[:, None] & (key_pos[None, :] <= last[:, None])  # [T, S]
  if sliding_window is not None:
    mask &= key_pos[None, :] > pos[:, None] - sliding_window
  k, v = read_rows(gathered, dims.layout, k_scale, v_scale)  # [T, S, K, H] each, float32
  k, v = (jnp.where(mask[..., None, None], x, 0.0) for x in (k, v))
  q_TKGH = q.reshape(t, dims.num_kv_heads, n // dims.num_kv_heads, h).astype(jnp.float32)
  out = _attend(q_TKGH, k, v, mask, ragged_checks.scale(sm_scale, h))
  out = out.reshape(t, n, h).astype(q.dtype)
  return out, (pages if kv_pages.ndim == 4 else pages[0])

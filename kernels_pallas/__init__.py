"""Pallas paged-attention kernels for the engine's KV pages, on TPU and GPU.

Two kernels, each with a TPU variant (Mosaic) and a GPU variant (Triton lowering) sharing one
jnp reference (reference.py):
  paged_decode_attention    one new token per sequence (tpu_decode.py, gpu_decode.py)
  ragged_prefill_attention  packed chunks of new tokens of several sequences, causal over their
                            cached pages plus themselves (tpu_prefill.py, gpu_prefill.py)
On CPU the TPU variant runs in plain Pallas interpret mode: it measured about 2x faster there
than the GPU variant (whole-page copies instead of per-row gathers), for the same compile time.

KV layouts. Prefill reads token-major pages: k_pages, v_pages [num_pages, page_size,
num_kv_heads, head_dim] of float32 or bfloat16. Decode reads every paged layout of the engine in
place, named by a static `PageLayout` (page_layout.py):
  TOKEN_MAJOR     k_pages, v_pages [P, Z, K, H]
  HEAD_MAJOR      k_pages, v_pages [K, P, Z, H]
  KV_INTERLEAVED  k_pages [P, 2, Z, K, H] holding K then V of each page; v_pages None
stored as float32, bfloat16, float16, float8_e4m3fn or int8; int8 comes with float32 scales per
position and KV head (k_scale, v_scale: the values' shape with head_dim 1; KV_INTERLEAVED: one
k_scale), and the kernels decode the values after loading them, so no dequantized copy exists.
Both kernels take `layer`: an int32 scalar with the arrays carrying a leading [L] axis, read in
place (see select_layer). Page 0 is the engine's scratch page and never in the valid part of a
page table. Page tables are int32.

ragged_paged_attention (ragged.py) is the one-call-per-layer kernel of a whole engine step:
every sequence's new tokens on one axis, their K/V written into the pages inside the kernel
(cache aliased in place), over the lane-dense page layout of ragged_layout.py.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas import gpu_decode, gpu_prefill, tpu_decode, tpu_prefill
from kernels_pallas.page_layout import PageLayout
from kernels_pallas.platform import Platform, resolve
from kernels_pallas.ragged import ragged_paged_attention
from kernels_pallas.ragged_layout import RaggedLayout
from kernels_pallas.ragged_layout import layout_for as ragged_layout_for

_DECODE = {Platform.TPU: tpu_decode.paged_decode_attention,
           Platform.GPU: gpu_decode.paged_decode_attention,
           Platform.CPU: tpu_decode.paged_decode_attention}
_PREFILL = {Platform.TPU: tpu_prefill.ragged_prefill_attention,
            Platform.GPU: gpu_prefill.ragged_prefill_attention,
            Platform.CPU: tpu_prefill.ragged_prefill_attention}


def select_layer(k_pages, v_pages, page_tables, layer):
  """Lets the kernels read one layer of a whole [L, P, Z, K, H] cache without copying it out.

  `cache.k[layer]` with a traced layer (a scan over layers) is a dynamic slice; a custom call
  cannot fuse it, so XLA materialises the layer's every page as a copy first: a whole-layer
  copy per layer per step. Merging the two leading axes instead is a free reshape, and the
  layer's pages become pages layer * P + p of one [L * P, Z, K, H] pool.
  """
  if layer is None:
    return k_pages, v_pages, page_tables
  if k_pages.ndim != 5:
    raise ValueError(f"k_pages must be [layers, num_pages, page_size, num_kv_heads, head_dim] "
                     f"when layer is given, got shape {k_pages.shape}")
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages must have k_pages' shape {k_pages.shape}, got {v_pages.shape}")
  if jnp.ndim(layer) != 0:
    raise ValueError(f"layer must be a scalar, got shape {jnp.shape(layer)}")
  num_layers, num_pages = k_pages.shape[:2]
  merged = (num_layers * num_pages, *k_pages.shape[2:])
  offset = (jnp.asarray(layer, jnp.int32) * num_pages).astype(page_tables.dtype)
  return k_pages.reshape(merged), v_pages.reshape(merged), page_tables + offset


def paged_decode_attention(q, k_pages, v_pages, page_tables, lengths, *, k_scale=None,
                           v_scale=None, layout=PageLayout.TOKEN_MAJOR, sm_scale=None,
                           platform=None, interpret=None, layer=None):
  """Attention of one new token per sequence over its pages.

  q [B, num_heads, head_dim]; page_tables [B, W] int32; lengths [B] int32: the number of valid
  KV positions of each sequence, the new token included (its K/V already written). Positions
  >= lengths are masked; a length of 0 gives 0. sm_scale defaults to 1 / sqrt(head_dim).
  k_pages, v_pages, k_scale, v_scale: pages of `layout` (see the module docstring).
  layer: None, or an int32 scalar with the arrays holding every layer (a leading [L] axis).
  Returns [B, num_heads, head_dim] in q.dtype.
  """
  platform, interpret = resolve(platform, interpret)
  return _DECODE[platform](q, k_pages, v_pages, page_tables, lengths, k_scale=k_scale,
                           v_scale=v_scale, layout=layout, layer=layer, sm_scale=sm_scale,
                           interpret=interpret)


def ragged_prefill_attention(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *,
                             sm_scale=None, platform=None, interpret=None, layer=None):
  """Causal attention of packed new tokens of several sequences over their pages.

  q [T, num_heads, head_dim]: the new tokens of num_seqs sequences back to back, then padding;
  cu_q_lens [num_seqs + 1] int32, cumulative query lengths from 0; kv_lens [num_seqs] int32: each
  sequence's KV length, its new tokens included (already written into the pages). Query i of
  sequence b sits at position kv_lens[b] - q_len[b] + i and attends to positions <= its own.
  page_tables [num_seqs, W]. Padding rows (past cu_q_lens[-1]) give 0. layer: as for decode.
  Returns [T, num_heads, head_dim] in q.dtype.
  """
  platform, interpret = resolve(platform, interpret)
  k_pages, v_pages, page_tables = select_layer(k_pages, v_pages, page_tables, layer)
  return _PREFILL[platform](q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens,
                            sm_scale=sm_scale, interpret=interpret)


__all__ = ["PageLayout", "Platform", "RaggedLayout", "paged_decode_attention",
           "ragged_layout_for", "ragged_paged_attention", "ragged_prefill_attention", "resolve",
           "select_layer"]

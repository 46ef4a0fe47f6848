"""Paged decode attention for TPU (Mosaic): one query token per sequence, flash-decoding.

Grid: one step per sequence ("parallel", so megacore chips split the batch). Each step walks the
sequence's pages in chunks of Q pages, DMAing chunk c + 1 from HBM while chunk c is computed, and
keeps an online softmax per KV head for its G query heads (GQA: the G heads share one K/V load).
Page tables and lengths arrive by scalar prefetch (SMEM), so the page ids are known before the
body runs. The pages are read in the caller's own layout (page_layout.py): a slab per page for
token-major and interleaved pages (all heads, lane windows as in tpu_pages.py), a slab per page
and head for head-major ones; quantized values are decoded in VMEM, after the copy, so HBM
traffic stays at the stored width. Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import common, page_layout, tpu_pages


def _load(buf_ref, slot, slab: int, lo: int, hi: int) -> jax.Array:
  """[2, Q, J, Z, M] buffer -> [Q, Z, hi - lo]: lanes [lo, hi) of slab `slab` of each page."""
  return buf_ref[slot, :, slab, :, pl.ds(lo, hi - lo)]


def _decode_kernel(tables_ref, lengths_ref, q_ref, *refs, sm_scale: float, heads, index,
                   pages_per_seq: int):
  """refs: the K, V pools [Y, Z, M] in HBM (then the K, V scale pools [Y, Z, Ks]), o_ref
  [K, Gp, E], their VMEM buffers [2, Q, J, Z, M] ([2, Q, J, Z, Ks]), DMA semaphores [pools, 2].

  heads: per KV head, (slab j, lane window lo, hi in the slab, scale lane).
  """
  num_pools = (len(refs) - 2) // 2
  hbm_refs, o_ref, buf_refs, sem_ref = (refs[:num_pools], refs[num_pools],
                                        refs[num_pools + 1:-1], refs[-1])
  seq = pl.program_id(0)
  length = lengths_ref[seq]
  per_chunk, _, page_size = buf_refs[0].shape[1:4]
  num_pages = pl.cdiv(length, page_size)
  chunk_len = per_chunk * page_size
  rows = q_ref.shape[1]
  dtype = q_ref.dtype

  fetch = functools.partial(tpu_pages.slab_copies, tables_ref, seq * pages_per_seq, num_pages,
                            hbm_refs=hbm_refs, buf_refs=buf_refs, sem_ref=sem_ref, index=index)

  def head_kv(slot, slab, lo, hi, scale_lane, kv):
    scale = None
    if num_pools == 4:
      scale = _load(buf_refs[2 + kv], slot, slab, scale_lane, scale_lane + 1)  # [Q, Z, 1]
    x = page_layout.decode_slab(_load(buf_refs[kv], slot, slab, lo, hi), scale, dtype)
    return x.reshape(chunk_len, hi - lo)  # [C, Hv]

  def compute(chunk, slot, carry):
    kv_pos = chunk * chunk_len + lax.broadcasted_iota(jnp.int32, (rows, chunk_len), 1)  # [Gp, C]
    mask = kv_pos < length
    new_carry = []
    for h, (slab, lo, hi, scale_lane) in enumerate(heads):
      q = q_ref[h, :, pl.ds(0, hi - lo)]  # [Gp, Hv]
      k = head_kv(slot, slab, lo, hi, scale_lane, 0)  # [C, Hv]
      v = head_kv(slot, slab, lo, hi, scale_lane, 1)  # [C, Hv]
      logits = common.qk_logits(q, k, sm_scale)  # [Gp, C]
      new_carry.append(common.softmax_step(carry[h], logits, mask, v))
    return tuple(new_carry)

  init = tuple(common.init_softmax(rows, hi - lo) for _, lo, hi, _ in heads)
  carry = tpu_pages.run_chunks(pl.cdiv(num_pages, per_chunk), fetch, compute, init)
  # A narrower last window (K * H % 128 != 0) leaves lanes [Hv, E) unwritten: unpack_heads
  # never reads them.
  for h, (_, lo, hi, _) in enumerate(heads):
    o_ref[h, :, pl.ds(0, hi - lo)] = common.finish_softmax(carry[h]).astype(o_ref.dtype)


def _head_slabs(pools: page_layout.Pools):
  """(windows for pack_heads, per-head (slab, lo, hi, scale lane) for the kernel)."""
  num_kv_heads, head_dim = pools.num_kv_heads, pools.head_dim
  if pools.index.per_head:  # One head per slab: its window is the whole slab.
    windows = tuple((h * head_dim, (h + 1) * head_dim) for h in range(num_kv_heads))
    return windows, tuple((h, 0, head_dim, 0) for h in range(num_kv_heads))
  windows = tpu_pages.head_windows(num_kv_heads, head_dim)
  return windows, tuple((0, lo, hi, h) for h, (lo, hi) in enumerate(windows))


def _operands(pools: page_layout.Pools, per_chunk: int):
  """The pools as [Y, Z, M] rows in HBM (a free view) and their double buffers [2, Q, J, Z, M]."""
  num_slabs = pools.num_kv_heads if pools.index.per_head else 1
  arrays = [pools.k, pools.v]
  if pools.k_scale is not None:
    arrays += [pools.k_scale, pools.v_scale]
  rows = [x.reshape(x.shape[0], x.shape[1], -1) for x in arrays]
  scratch = [pltpu.VMEM((2, per_chunk, num_slabs, *x.shape[1:]), x.dtype) for x in rows]
  return rows, scratch + [pltpu.SemaphoreType.DMA((len(rows), 2))]


@functools.partial(jax.jit, static_argnames=("layout", "sm_scale", "pages_per_chunk",
                                             "interpret"))
def paged_decode_attention(q, k_pages, v_pages, page_tables, lengths, *, k_scale=None,
                           v_scale=None, layout=page_layout.PageLayout.TOKEN_MAJOR, layer=None,
                           sm_scale=None, pages_per_chunk=None, interpret=False):
  """q [B, N, H] attends to positions [0, lengths[b]) of its pages; returns [B, N, H].

  k_pages, v_pages (k_scale, v_scale, layer): pages of `layout`, see page_layout.to_pools;
  page_tables [B, W] int32; lengths [B] int32.
  pages_per_chunk: pages per DMA/compute step (default about 128 positions).
  """
  pools = page_layout.to_pools(layout, k_pages, v_pages, k_scale, v_scale, page_tables, layer)
  dims = page_layout.check_decode(q, pools, lengths)
  num_seqs, _, head_dim = q.shape
  # No chunk needs more pages than a page table has: a shorter one unrolls fewer copies.
  per_chunk = min(pages_per_chunk or common.pages_per_chunk(dims.page_size), dims.pages_per_seq)
  windows, heads = _head_slabs(pools)
  dtype = pools.dequantized_dtype(q.dtype)
  rows = common.round_up(dims.group, tpu_pages.sublanes(dtype))  # Pad G to whole sublane tiles.
  q_BKGH = q.reshape(num_seqs, dims.num_kv_heads, dims.group, head_dim).astype(dtype)
  q_BKGH = jnp.pad(q_BKGH, ((0, 0), (0, 0), (0, rows - dims.group), (0, 0)))
  q_win = tpu_pages.pack_heads(q_BKGH, windows)  # [B, K, Gp, E]
  kernel = functools.partial(_decode_kernel, sm_scale=common.default_scale(sm_scale, head_dim),
                             heads=heads, index=pools.index, pages_per_seq=dims.pages_per_seq)
  q_spec = pl.BlockSpec((None, *q_win.shape[1:]), lambda b, *_: (b, 0, 0, 0))
  hbm_arrays, scratch = _operands(pools, per_chunk)
  o_win = tpu_pages.call_over_pages(
      kernel, (pools.tables.reshape(-1), lengths), q_win, q_spec, hbm_arrays, scratch,
      out_dtype=q.dtype, grid=(num_seqs,), interpret=interpret, name="paged_decode_attention_tpu")
  out = tpu_pages.unpack_heads(o_win, windows, head_dim)[:, :, :dims.group]  # [B, K, G, H]
  return out.reshape(q.shape)

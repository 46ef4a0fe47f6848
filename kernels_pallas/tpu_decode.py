"""Paged decode attention for TPU (Mosaic): one query token per sequence, flash-decoding.

Grid: one step per sequence ("parallel", so megacore chips split the batch). Each step walks the
sequence's pages in chunks of Q pages, DMAing chunk c + 1 from HBM while chunk c is computed, and
keeps an online softmax per KV head for its G query heads (GQA: the G heads share one K/V load).
Block tables and lengths arrive by scalar prefetch (SMEM), so the page ids are known before the
body runs. Shape letters as in common.py and tpu_pages.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import common
from kernels_pallas import tpu_pages


def _decode_kernel(
    tables_ref,  # [S * W] int32, SMEM
    lengths_ref,  # [S] int32, SMEM
    q_ref,  # [K, Gp, E] this sequence's query heads, packed in lane windows
    k_hbm_ref,  # [P, B, C] in HBM
    v_hbm_ref,  # [P, B, C] in HBM
    o_ref,  # [K, Gp, E]
    k_buf_ref,  # [2, Q, B, C] VMEM, double buffer
    v_buf_ref,  # [2, Q, B, C] VMEM
    sem_ref,  # DMA semaphores [2 (k, v), 2 (slot)]
    *,
    sm_scale: float,
    windows: tuple[tuple[int, int], ...],
    pages_per_seq: int,
):
  seq = pl.program_id(0)
  length = lengths_ref[seq]
  per_chunk, page_size = k_buf_ref.shape[1:3]
  num_pages = pl.cdiv(length, page_size)
  chunk_len = per_chunk * page_size
  rows = q_ref.shape[1]
  dtype = q_ref.dtype

  fetch = functools.partial(tpu_pages.chunk_copies, tables_ref, seq * pages_per_seq, num_pages,
                            hbm_refs=(k_hbm_ref, v_hbm_ref), buf_refs=(k_buf_ref, v_buf_ref),
                            sem_ref=sem_ref)

  def compute(chunk, slot, carry):
    kv_pos = chunk * chunk_len + lax.broadcasted_iota(jnp.int32, (rows, chunk_len), 1)  # [Gp, L]
    mask = kv_pos < length
    new_carry = []
    for h, window in enumerate(windows):
      q = q_ref[h, :, pl.ds(0, window[1] - window[0])]  # [Gp, w]
      k = tpu_pages.load_window(k_buf_ref, slot, window, dtype)  # [L, w]
      v = tpu_pages.load_window(v_buf_ref, slot, window, dtype)  # [L, w]
      logits = common.qk_logits(q, k, sm_scale)  # [Gp, L]
      new_carry.append(common.softmax_step(carry[h], logits, mask, v))
    return tuple(new_carry)

  init = tuple(common.init_softmax(rows, hi - lo) for lo, hi in windows)
  carry = tpu_pages.run_chunks(pl.cdiv(num_pages, per_chunk), fetch, compute, init)
  # A narrower last window (K * D % 128 != 0) leaves lanes [w, E) unwritten: unpack_heads
  # never reads them.
  for h, (lo, hi) in enumerate(windows):
    o_ref[h, :, pl.ds(0, hi - lo)] = common.finish_softmax(carry[h]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_chunk", "interpret"))
def paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None,
                           pages_per_chunk=None, interpret=False):
  """q [S, H, D] attends to positions [0, lengths[s]) of its pages; returns [S, H, D].

  k_pages, v_pages [P, B, K, D]; block_tables [S, W] int32; lengths [S] int32.
  pages_per_chunk: pages per DMA/compute step (default about 128 positions).
  """
  dims = common.check_decode_args(q, k_pages, v_pages, block_tables, lengths)
  num_seqs, _, head_dim = q.shape
  per_chunk = pages_per_chunk or common.pages_per_chunk(dims.page_size)
  windows = tpu_pages.head_windows(dims.num_kv_heads, head_dim)
  dtype = common.compute_dtype(q.dtype, k_pages.dtype)
  rows = common.round_up(dims.group, tpu_pages.sublanes(dtype))  # Pad G to whole sublane tiles.
  q_SKGD = q.reshape(num_seqs, dims.num_kv_heads, dims.group, head_dim).astype(dtype)
  q_SKGD = jnp.pad(q_SKGD, ((0, 0), (0, 0), (0, rows - dims.group), (0, 0)))
  q_win = tpu_pages.pack_heads(q_SKGD, windows)  # [S, K, Gp, E]
  kernel = functools.partial(_decode_kernel, sm_scale=common.default_scale(sm_scale, head_dim),
                             windows=windows, pages_per_seq=dims.pages_per_seq)
  q_spec = pl.BlockSpec((None, *q_win.shape[1:]), lambda s, *_: (s, 0, 0, 0))
  o_win = tpu_pages.call_over_pages(
      kernel, (block_tables.reshape(-1), lengths), q_win, q_spec, k_pages, v_pages,
      out_dtype=q.dtype, grid=(num_seqs,), per_chunk=per_chunk, dims=dims, interpret=interpret,
      name="paged_decode_attention_tpu")
  out = tpu_pages.unpack_heads(o_win, windows, head_dim)[:, :, :dims.group]  # [S, K, G, D]
  return out.reshape(q.shape)

"""Ragged paged prefill attention for TPU (Mosaic): packed chunks of several sequences.

The new tokens of all sequences are packed back to back. Grid: one step per block of Tq packed
tokens ("parallel"). A block can hold the tail of one sequence and the head of the next, so the
step loops over the sequences [seq_lo, seq_hi) that overlap it (computed by the wrapper, passed
by scalar prefetch); for each it walks that sequence's pages up to the block's last position
(causal), chunk by chunk with double-buffered DMAs, masking rows of other sequences. Every row
belongs to one sequence, so one online softmax per row serves all of them.
Q rows are laid out head-group major, [K, G, T, E]: a block's rows for one KV head are then the
[G, Tq, E] tile, which reshapes to [G * Tq, E] without crossing (8, 128) tiles (Tq % 8 == 0).
Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import common, tpu_pages

_TARGET_ROWS = 256  # Query rows (G * Tq) per block: fills the MXU's rows on v5e/v6e.


def _prefill_kernel(
    tables_ref,  # [B * W] int32, SMEM
    cu_q_lens_ref,  # [B + 1] int32, SMEM
    kv_lens_ref,  # [B] int32, SMEM
    seq_lo_ref,  # [T / Tq] int32, SMEM
    seq_hi_ref,  # [T / Tq] int32, SMEM
    q_ref,  # [K, G, Tq, E]
    k_hbm_ref,  # [P, Z, M] in HBM
    v_hbm_ref,  # [P, Z, M] in HBM
    o_ref,  # [K, G, Tq, E]
    k_buf_ref,  # [2, Q, Z, M] VMEM
    v_buf_ref,  # [2, Q, Z, M] VMEM
    sem_ref,  # DMA semaphores [2, 2]
    *,
    sm_scale: float,
    windows: tuple[tuple[int, int], ...],
    pages_per_seq: int,
):
  block = pl.program_id(0)
  _, group, block_q, _ = q_ref.shape
  rows = group * block_q
  per_chunk, page_size = k_buf_ref.shape[1:3]
  chunk_len = per_chunk * page_size
  dtype = q_ref.dtype
  # Packed token index of each row: rows are (g, t) pairs, g major; Tq is a power of two.
  tok = block * block_q + jnp.bitwise_and(
      lax.broadcasted_iota(jnp.int32, (rows, chunk_len), 0), block_q - 1)  # [R, C]
  block_start, block_end = block * block_q, (block + 1) * block_q

  def seq_body(seq, carry):
    q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    context = kv_lens_ref[seq] - (q_end - q_start)  # Cached positions before the new tokens.
    in_seq = (tok >= q_start) & (tok < q_end)  # [R, C]
    q_pos = context + tok - q_start  # [R, C]
    last_tok = jnp.minimum(q_end, block_end)
    kv_end = jnp.where(last_tok > jnp.maximum(q_start, block_start), context + last_tok - q_start, 0)
    num_pages = pl.cdiv(kv_end, page_size)
    fetch = functools.partial(tpu_pages.chunk_copies, tables_ref, seq * pages_per_seq, num_pages,
                              hbm_refs=(k_hbm_ref, v_hbm_ref), buf_refs=(k_buf_ref, v_buf_ref),
                              sem_ref=sem_ref)

    def compute(chunk, slot, carry):
      kv_pos = chunk * chunk_len + lax.broadcasted_iota(jnp.int32, (rows, chunk_len), 1)
      mask = in_seq & (kv_pos <= q_pos)  # [R, C] causal, and only this sequence's rows
      new_carry = []
      for h, window in enumerate(windows):
        q = q_ref[h, :, :, pl.ds(0, window[1] - window[0])].reshape(rows, -1)  # [R, Hv]
        k = tpu_pages.load_window(k_buf_ref, slot, window, dtype)  # [C, Hv]
        v = tpu_pages.load_window(v_buf_ref, slot, window, dtype)  # [C, Hv]
        logits = common.qk_logits(q, k, sm_scale)  # [R, C]
        new_carry.append(common.softmax_step(carry[h], logits, mask, v))
      return tuple(new_carry)

    return tpu_pages.run_chunks(pl.cdiv(num_pages, per_chunk), fetch, compute, carry)

  init = tuple(common.init_softmax(rows, hi - lo) for lo, hi in windows)
  carry = lax.fori_loop(seq_lo_ref[block], seq_hi_ref[block], seq_body, init)
  # A narrower last window (K * H % 128 != 0) leaves lanes [Hv, E) unwritten: unpack_heads
  # never reads them.
  for h, (lo, hi) in enumerate(windows):
    out = common.finish_softmax(carry[h]).astype(o_ref.dtype)  # [R, Hv]
    o_ref[h, :, :, pl.ds(0, hi - lo)] = out.reshape(group, block_q, hi - lo)


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_chunk", "block_q",
                                             "interpret"))
def ragged_prefill_attention(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *,
                             sm_scale=None, pages_per_chunk=None, block_q=None, interpret=False):
  """Packed q [T, N, H] of B sequences -> [T, N, H]; see kernels_pallas.ragged_prefill_attention.

  block_q: packed tokens per grid step (a power of two; default about 256 / G).
  """
  dims = common.check_prefill_args(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
  num_tokens, _, head_dim = q.shape
  dtype = common.compute_dtype(q.dtype, k_pages.dtype)
  min_block = tpu_pages.sublanes(dtype)
  block_q = block_q or common.query_block(num_tokens, dims.group, _TARGET_ROWS, min_block)
  if block_q % min_block or block_q != common.next_pow2(block_q):
    raise ValueError(f"block_q must be a power of two and a multiple of {min_block}, got {block_q}")
  per_chunk = pages_per_chunk or common.pages_per_chunk(dims.page_size)
  padded = common.round_up(num_tokens, block_q)
  num_blocks = padded // block_q
  windows = tpu_pages.head_windows(dims.num_kv_heads, head_dim)
  q_TKGH = q.reshape(num_tokens, dims.num_kv_heads, dims.group, head_dim).astype(dtype)
  q_TKGH = jnp.pad(q_TKGH, ((0, padded - num_tokens), (0, 0), (0, 0), (0, 0)))
  q_win = tpu_pages.pack_heads(q_TKGH, windows).transpose(1, 2, 0, 3)  # [K, G, T, E]
  seq_lo, seq_hi = common.block_seq_ranges(cu_q_lens, num_blocks, block_q)
  kernel = functools.partial(_prefill_kernel, sm_scale=common.default_scale(sm_scale, head_dim),
                             windows=windows, pages_per_seq=dims.pages_per_seq)
  q_spec = pl.BlockSpec((dims.num_kv_heads, dims.group, block_q, q_win.shape[-1]),
                        lambda j, *_: (0, 0, j, 0))
  hbm_arrays, scratch = tpu_pages.token_major_operands(k_pages, v_pages, dims, per_chunk)
  o_win = tpu_pages.call_over_pages(
      kernel, (page_tables.reshape(-1), cu_q_lens, kv_lens, seq_lo, seq_hi), q_win, q_spec,
      hbm_arrays, scratch, out_dtype=q.dtype, grid=(num_blocks,), interpret=interpret,
      name="ragged_prefill_attention_tpu")
  out = tpu_pages.unpack_heads(o_win.transpose(2, 0, 1, 3), windows, head_dim)  # [T, K, G, H]
  return out[:num_tokens].reshape(q.shape)

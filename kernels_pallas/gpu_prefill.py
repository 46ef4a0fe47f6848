"""Ragged paged prefill attention for GPU (Pallas Triton lowering): packed chunks of sequences.

Grid: (block of Tq packed tokens, KV head). As on TPU (tpu_prefill.py), a block loops over the
sequences [seq_lo, seq_hi) that overlap it and, for each, over that sequence's pages up to the
block's last position, with rows of other sequences masked; one online softmax per row. A
program's rows are the Gp query heads of its KV head times Tq tokens, laid out [K, Gp, T, H] by
the wrapper (Gp = G padded to a power of two). Pages are gathered as in gpu_decode.py.
Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import common, gpu_decode, page_layout

_TARGET_ROWS = 64  # Query rows (Gp * Tq) per program: 64 x H f32 accumulators fit 4 warps.


def _prefill_kernel(
    tables_ref,  # [B, Wp] int32
    cu_q_lens_ref,  # [B + 1] int32
    kv_lens_ref,  # [B] int32
    seq_lo_ref,  # [T / Tq] int32
    seq_hi_ref,  # [T / Tq] int32
    q_ref,  # [Gp, Tq, H]
    k_ref,  # [P * Z, K, H]
    v_ref,  # [P * Z, K, H]
    o_ref,  # [Gp, Tq, H]
    *,
    sm_scale: float,
    page_size: int,
    per_chunk: int,
):
  block, head = pl.program_id(0), pl.program_id(1)
  group, block_q, head_dim = q_ref.shape
  rows = group * block_q
  chunk_len = per_chunk * page_size
  q = q_ref[...].reshape(rows, head_dim)  # [R, H]
  tok = block * block_q + (jnp.arange(rows) % block_q)[:, None]  # [R, 1] packed token of a row
  block_start, block_end = block * block_q, (block + 1) * block_q

  def seq_body(seq, carry):
    q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    context = kv_lens_ref[seq] - (q_end - q_start)  # Cached positions before the new tokens.
    in_seq = (tok >= q_start) & (tok < q_end)  # [R, 1]
    q_pos = context + tok - q_start  # [R, 1]
    last_tok = jnp.minimum(q_end, block_end)
    kv_end = jnp.where(last_tok > jnp.maximum(q_start, block_start), context + last_tok - q_start, 0)
    num_pages = pl.cdiv(kv_end, page_size)

    def kv_body(chunk, carry):
      first_page = chunk * per_chunk
      k, v = gpu_decode.gather_chunk(
          tables_ref, seq, first_page, num_pages, (k_ref, v_ref), head,
          index=page_layout.TOKEN_MAJOR_INDEX, page_size=page_size, per_chunk=per_chunk,
          dtype=q.dtype)  # [C, H] each
      kv_pos = first_page * page_size + jnp.arange(chunk_len)[None, :]  # [1, C]
      mask = in_seq & (kv_pos <= q_pos)  # [R, C] causal, and only this sequence's rows
      logits = common.qk_logits(q, k, sm_scale)  # [R, C]
      return common.softmax_step(carry, logits, mask, v)

    return jax.lax.fori_loop(0, pl.cdiv(num_pages, per_chunk), kv_body, carry)

  init = common.init_softmax(rows, head_dim)
  carry = jax.lax.fori_loop(seq_lo_ref[block], seq_hi_ref[block], seq_body, init)
  o_ref[...] = common.finish_softmax(carry).reshape(group, block_q, head_dim).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_chunk", "block_q",
                                             "num_warps", "interpret"))
def ragged_prefill_attention(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens, *,
                             sm_scale=None, pages_per_chunk=None, block_q=None, num_warps=4,
                             interpret=False):
  """Packed q [T, N, H] of B sequences -> [T, N, H]; see kernels_pallas.ragged_prefill_attention.

  block_q: packed tokens per program (a power of two; default about 64 / Gp).
  """
  dims = common.check_prefill_args(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens)
  gpu_decode.check_triton_sizes(dims.page_size, dims.head_dim)
  num_tokens, _, head_dim = q.shape
  group = common.next_pow2(dims.group)
  block_q = block_q or common.query_block(num_tokens, group, _TARGET_ROWS, max(1, 16 // group))
  if block_q != common.next_pow2(block_q) or block_q * group < 16:
    raise ValueError(f"block_q must be a power of two with block_q * {group} >= 16, got {block_q}")
  per_chunk = gpu_decode.chunk_pages(pages_per_chunk, dims.page_size)
  tables = jnp.pad(page_tables, ((0, 0), (0, (-dims.pages_per_seq) % per_chunk)))
  padded = common.round_up(num_tokens, block_q)
  num_blocks = padded // block_q
  dtype = common.compute_dtype(q.dtype, k_pages.dtype)
  q_TKGH = q.reshape(num_tokens, dims.num_kv_heads, dims.group, head_dim).astype(dtype)
  q_TKGH = jnp.pad(q_TKGH, ((0, padded - num_tokens), (0, 0), (0, group - dims.group), (0, 0)))
  q_KGTH = q_TKGH.transpose(1, 2, 0, 3)  # [K, Gp, T, H]
  seq_lo, seq_hi = common.block_seq_ranges(cu_q_lens, num_blocks, block_q)
  flat = (dims.num_pages * dims.page_size, dims.num_kv_heads, head_dim)
  kernel = functools.partial(_prefill_kernel, sm_scale=common.default_scale(sm_scale, head_dim),
                             page_size=dims.page_size, per_chunk=per_chunk)
  whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  q_spec = pl.BlockSpec((None, group, block_q, head_dim), lambda j, k: (k, 0, j, 0))
  o_KGTH = pl.pallas_call(
      kernel,
      grid=(num_blocks, dims.num_kv_heads),
      in_specs=[whole(tables.shape), whole(cu_q_lens.shape), whole(kv_lens.shape),
                whole(seq_lo.shape), whole(seq_hi.shape), q_spec, whole(flat), whole(flat)],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q_KGTH.shape, q.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
      interpret=interpret,
      name="ragged_prefill_attention_gpu",
  )(tables, cu_q_lens, kv_lens, seq_lo, seq_hi, q_KGTH, k_pages.reshape(flat),
    v_pages.reshape(flat))
  out = o_KGTH.transpose(2, 0, 1, 3)[:num_tokens, :, :dims.group]  # [T, K, G, H]
  return out.reshape(q.shape)

"""Ragged paged attention for TPU (Mosaic): one call per layer for a whole engine step.

The new tokens of every sequence (decode rows, prefill chunks, both) are packed on one token axis.
Grid: one step per block of Tq packed tokens, run in order ("arbitrary"), because step 0 first
writes the step's new K/V into the pages and every later read must see them:
  1. write  For each sequence and each page its new tokens touch: DMA the page into VMEM, move the
            new rows in, DMA it back. The pages are [Z, Cr] tiles and a token is one sublane row, so
            a row cannot be DMAed alone (a bf16 row is half a packed sublane); the page is
            rewritten whole, its new rows put in place by a one-hot [Z, 2Z] x [2Z, Cr] matmul of the
            two Z-row blocks of new rows that cover it (exact: one 1 per row, f32 accumulation).
  2. attend Each block loops over the sequences [seq_lo, seq_hi) that overlap it; for each, over
            the chunks of its pages from the sliding window's first (or page 0) up to the block's
            last position (plus its furthest row's reach, attend_until), double-buffered DMAs
            of whole pages (K and V in one row), an online softmax per row, rows of other
            sequences masked.
The cache is read and written through the output ref, aliased to the input, so the kernel works on
the caller's one copy. 8-bit pages (kv_quant.py) are moved through bf16 in step 1 (exact) and
dequantized in VMEM in step 2: int8 times 2^e of its key, float8 through f32. Q rows are laid
out [K, G, T, E], each KV head's queries in the 128-aligned lane window that covers its K lanes
(ragged_layout.lane_window).
Shape letters: the key in jaxserve/model/__init__.py; R = G * Tq rows, Q pages per chunk,
C = Q * Z keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import common, kv_quant, ragged_layout, ragged_reference, tpu_pages
from kernels_pallas.ragged_windows import HeadWindows

_TARGET_ROWS = 256  # Query rows (G * Tq) per block: fills the MXU's rows on v5e/v6e.


def _write_new_kv(scalars, new_hbm_ref, pages_ref, page_buf, new_buf, sem, *, pages_per_seq):
  """Step 1: every live sequence's new rows into its pages (whole-page read-modify-write)."""
  meta_ref, tables_ref, cu_ref, kv_lens_ref = scalars[:4]
  page_size, lanes = page_buf.shape

  def write_page(seq, p, q_start, context, kv_len):
    page = tables_ref[seq * pages_per_seq + p] + meta_ref[1]
    start = page_size + q_start + p * page_size - context  # Row of new_hbm_ref for page row 0.
    block = lax.div(start, page_size)  # start >= 1: no floor-division sign fix-up
    copies = [pltpu.make_async_copy(pages_ref.at[page], page_buf, sem.at[0]),
              pltpu.make_async_copy(new_hbm_ref.at[block], new_buf.at[0], sem.at[1]),
              pltpu.make_async_copy(new_hbm_ref.at[block + 1], new_buf.at[1], sem.at[2])]
    tpu_pages.start_all(copies)
    tpu_pages.wait_all(copies)
    shift = start - block * page_size
    row = lax.broadcasted_iota(jnp.int32, (page_size, 2 * page_size), 0)
    col = lax.broadcasted_iota(jnp.int32, (page_size, 2 * page_size), 1)
    new = new_buf[...].reshape(2 * page_size, lanes)  # [2Z, Cr]
    if kv_quant.is_8bit(new.dtype):  # Every int8 and float8 value is exact in bf16.
      new = new.astype(jnp.float32).astype(jnp.bfloat16)
    one_hot = (col == row + shift).astype(new.dtype)  # [Z, 2Z]
    # f32 needs HIGHEST: the default rounds the operands to bf16 on the MXU.
    exact = lax.Precision.HIGHEST if new.dtype == jnp.float32 else None
    moved = jnp.dot(one_hot, new, precision=exact, preferred_element_type=jnp.float32)  # [Z, Cr]
    pos = p * page_size + lax.broadcasted_iota(jnp.int32, (page_size, lanes), 0)
    is_new = (pos >= context) & (pos < kv_len)
    # The select in f32: 8-bit vectors have few native ops; the round trip is exact.
    page_buf[...] = jnp.where(is_new, moved, page_buf[...].astype(jnp.float32)).astype(
        page_buf.dtype)
    back = pltpu.make_async_copy(page_buf, pages_ref.at[page], sem.at[0])
    back.start()
    back.wait()

  def write_seq(seq, _):
    q_start, q_end, kv_len = cu_ref[seq], cu_ref[seq + 1], kv_lens_ref[seq]
    context = kv_len - (q_end - q_start)
    last = jnp.where(q_end > q_start, pl.cdiv(kv_len, page_size), 0)
    lax.fori_loop(lax.div(context, page_size), last,
                  lambda p, c: (write_page(seq, p, q_start, context, kv_len), c)[1], 0)
    return 0

  lax.fori_loop(0, meta_ref[0], write_seq, 0)


def _ragged_kernel(meta_ref, tables_ref, cu_ref, kv_lens_ref, seq_lo_ref, seq_hi_ref,  # SMEM
                   block_reach_ref,  # SMEM [T' / Tq]: the most any of the block's rows reaches
                   q_ref,  # [K, G, Tq, E] VMEM
                   # reach_ref [R, 1] VMEM (only when `reaches`: each row's reach);
                   # new_hbm_ref [T' / Z, Z, Cr] HBM: the new rows, Z rows of zeros first;
                   # kv_pages as given (aliased to pages_ref, which the kernel uses);
                   # o_ref [K, G, Tq, E] VMEM; pages_ref [L * P, Z, Cr] HBM, the output alias
                   # of the cache; kv_buf [2, Q, Z, Cr] VMEM; sem DMA [2]; page_buf [Z, Cr],
                   # new_buf [2, Z, Cr] VMEM, write_sem DMA [3]
                   *refs,
                   sm_scale: float, windows: HeadWindows, pages_per_seq: int,
                   sliding_window: int | None, v_scale: float, reaches: bool):
  reach_ref, refs = (refs[0], refs[1:]) if reaches else (None, refs)
  new_hbm_ref, _, o_ref, pages_ref, kv_buf, sem, page_buf, new_buf, write_sem = refs
  block = pl.program_id(0)
  scalars = (meta_ref, tables_ref, cu_ref, kv_lens_ref)

  @pl.when(block == 0)
  def _():
    _write_new_kv(scalars, new_hbm_ref, pages_ref, page_buf, new_buf, write_sem,
                  pages_per_seq=pages_per_seq)

  _, group, block_q, _ = q_ref.shape
  rows = group * block_q
  per_chunk, page_size = kv_buf.shape[1:3]
  chunk_len = per_chunk * page_size
  dtype = q_ref.dtype
  read = functools.partial(_read_lanes, kv_buf, chunk_len=chunk_len)
  # Packed token of each row: rows are (g, t) pairs, g major; Tq is a power of two.
  tok = block * block_q + jnp.bitwise_and(
      lax.broadcasted_iota(jnp.int32, (rows, chunk_len), 0), block_q - 1)  # [R, C]
  reach = 0 if reach_ref is None else reach_ref[...]  # [R, 1]
  block_start, block_end = block * block_q, (block + 1) * block_q

  def seq_body(seq, carry):
    q_start, q_end = cu_ref[seq], cu_ref[seq + 1]
    context = kv_lens_ref[seq] - (q_end - q_start)
    in_seq = (tok >= q_start) & (tok < q_end)  # [R, C]
    q_pos = context + tok - q_start  # [R, C]
    first_tok, last_tok = jnp.maximum(q_start, block_start), jnp.minimum(q_end, block_end)
    kv_end = jnp.where(last_tok > first_tok, jnp.minimum(
        context + last_tok - q_start + block_reach_ref[block], kv_lens_ref[seq]), 0)
    num_pages = pl.cdiv(kv_end, page_size)
    first_chunk = 0
    if sliding_window is not None:  # Chunks wholly before the first row's window are skipped.
      first_key = jnp.maximum(context + first_tok - q_start - sliding_window + 1, 0)
      first_chunk = jnp.where(kv_end > 0, lax.div(first_key, chunk_len), 0)

    def fetch(chunk, slot):
      copies = []
      for i in range(per_chunk):
        index = jnp.minimum((first_chunk + chunk) * per_chunk + i, num_pages - 1)
        page = tables_ref[seq * pages_per_seq + index] + meta_ref[1]
        copies.append(pltpu.make_async_copy(pages_ref.at[page], kv_buf.at[slot, i],
                                            sem.at[slot]))
      return copies

    def compute(chunk, slot, carry):
      kv_pos = (first_chunk + chunk) * chunk_len + lax.broadcasted_iota(
          jnp.int32, (rows, chunk_len), 1)
      mask = in_seq & (kv_pos <= q_pos + reach)  # [R, C] causal, this sequence's rows only
      if sliding_window is not None:
        mask &= kv_pos > q_pos - sliding_window
      scales = None
      if windows.scales is not None:  # int8: 2^e per key and head, [C, sw] f32
        scales = jnp.exp2(read(slot, windows.scales, jnp.float32).astype(jnp.float32))
      new_carry = []
      for h, (k_win, v_win) in enumerate(zip(windows.k, windows.v)):
        kw = k_win[1] - k_win[0]
        q = q_ref[h, :, :, pl.ds(0, kw)].reshape(rows, kw)  # [R, kw]
        k = read(slot, k_win, dtype, scale=windows.scale_column(scales, h))  # [C, kw]
        v = read(slot, v_win, dtype, scale=windows.scale_column(scales, windows.num_heads + h))
        logits = common.qk_logits(q, k, sm_scale)  # [R, C]
        new_carry.append(common.softmax_step(carry[h], logits, mask, v))
      return tuple(new_carry)

    num_chunks = pl.cdiv(num_pages, per_chunk) - first_chunk
    return tpu_pages.run_chunks(num_chunks, fetch, compute, carry)

  init = tuple(common.init_softmax(rows, hi - lo) for lo, hi in windows.v)
  carry = lax.fori_loop(seq_lo_ref[block], seq_hi_ref[block], seq_body, init)
  for h, (lo, hi) in enumerate(windows.v):  # Lanes past a narrower window stay unwritten.
    out = common.finish_softmax(carry[h])  # [R, vw]
    out = (out if v_scale == 1.0 else out * v_scale).astype(o_ref.dtype)
    o_ref[h, :, :, pl.ds(0, hi - lo)] = out.reshape(group, block_q, hi - lo)


def _read_lanes(kv_buf, slot, window, dtype, *, chunk_len: int, scale=None):
  """A lane window of a chunk's page rows as [C, w] in `dtype`; int8 values times `scale` [C, 1],
  float8 ones through f32 (few 8-bit vector ops are native)."""
  lo, hi = window
  x = kv_buf[slot, :, :, pl.ds(lo, hi - lo)].reshape(chunk_len, hi - lo)  # [C, w]
  if scale is not None:
    return (x.astype(jnp.float32) * scale).astype(dtype)
  if kv_quant.is_8bit(x.dtype):
    return x.astype(jnp.float32).astype(dtype)
  return x.astype(dtype)


def _new_row_blocks(k_new, v_new, layout, page_size: int, kv_scales):
  """[T, K, H] x2 -> [T' / Z, Z, Cr] page rows, Z zero rows in front and at least Z behind, so
  the two Z-row blocks that cover any page's new rows always exist."""
  rows = ragged_reference.new_rows(k_new, v_new, layout, *kv_scales)  # [T, Cr]
  lanes = layout.lanes
  total = common.round_up(rows.shape[0] + page_size, page_size) + page_size
  rows = jnp.pad(rows, ((page_size, total - rows.shape[0] - page_size), (0, 0)))
  return rows.reshape(total // page_size, page_size, lanes)


@functools.partial(jax.jit, static_argnames=("dims", "sm_scale", "sliding_window", "kv_scales",
                                             "pages_per_chunk", "block_q", "interpret"))
def ragged_paged_attention(q, k_new, v_new, kv_pages, page_tables, cu_q_lens, kv_lens, num_seqs,
                           layer, *, dims, sm_scale, sliding_window, kv_scales=(1.0, 1.0),
                           reach=None, pages_per_chunk=None, block_q=None, interpret=False):
  """Checked arguments (ragged.py) -> (out [T, N, H], kv_pages [L, P, Z, Cr]); layer: int32;
  reach: None or [T] int32 (ragged_reference.token_reach)."""
  num_tokens, _, head_dim = q.shape
  page_size, lanes = dims.page_size, dims.layout.lanes
  if page_size % ragged_layout.sublanes(kv_pages.dtype):
    raise ValueError(f"kv_pages page_size must be a multiple of "
                     f"{ragged_layout.sublanes(kv_pages.dtype)} for {kv_pages.dtype} on TPU, "
                     f"got {page_size}")
  dtype = common.compute_dtype(q.dtype, kv_pages.dtype)
  min_block = ragged_layout.sublanes(dtype)
  block_q = block_q or common.query_block(num_tokens, dims.group, _TARGET_ROWS, min_block)
  if block_q % min_block or block_q != common.next_pow2(block_q):
    raise ValueError(f"block_q must be a power of two and a multiple of {min_block}, got {block_q}")
  per_chunk = pages_per_chunk or common.pages_per_chunk(page_size)
  padded = common.round_up(num_tokens, block_q)
  num_blocks = padded // block_q
  windows = HeadWindows.of(dims.layout)
  q_TKGH = q.reshape(num_tokens, dims.num_kv_heads, dims.group, head_dim).astype(dtype)
  q_TKGH = jnp.pad(q_TKGH, ((0, padded - num_tokens), (0, 0), (0, 0), (0, 0)))
  q_win = windows.pack_queries(q_TKGH).transpose(1, 2, 0, 3)  # [K, G, T, E]
  live = jnp.arange(cu_q_lens.shape[0]) <= num_seqs
  cu_live = jnp.where(live, cu_q_lens, cu_q_lens[num_seqs])  # Later sequences: empty.
  seq_lo, seq_hi = common.block_seq_ranges(cu_live, num_blocks, block_q)
  seq_hi = jnp.minimum(seq_hi, num_seqs)
  meta = jnp.stack([num_seqs, layer * dims.num_pages]).astype(jnp.int32)
  reaches, rows = reach is not None, dims.group * block_q
  reach = jnp.zeros(padded, jnp.int32) if reach is None else jnp.pad(
      reach, (0, padded - num_tokens))
  block_reach = reach.reshape(num_blocks, block_q).max(axis=1)
  scalars = (meta, page_tables.reshape(-1), cu_live, kv_lens, seq_lo, seq_hi, block_reach)
  # Each query row's reach, rows (g, t) g major as the block's queries: [T' / Tq, R, 1].
  reach_rows = []
  if reaches:
    tiled = jnp.tile(reach.reshape(num_blocks, 1, block_q), (1, dims.group, 1))
    reach_rows = [(tiled.reshape(num_blocks, rows, 1),
                   pl.BlockSpec((None, rows, 1), lambda j, *_: (j, 0, 0)))]
  pages = kv_pages.reshape(-1, page_size, lanes)  # [L * P, Z, Cr]: a free view
  new_rows = _new_row_blocks(k_new, v_new, dims.layout, page_size, kv_scales)
  kernel = functools.partial(_ragged_kernel, sm_scale=sm_scale * kv_scales[0], windows=windows,
                             pages_per_seq=dims.pages_per_seq, sliding_window=sliding_window,
                             v_scale=kv_scales[1], reaches=reaches)
  q_spec = pl.BlockSpec((dims.num_kv_heads, dims.group, block_q, q_win.shape[-1]),
                        lambda j, *_: (0, 0, j, 0))
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  o_win, pages = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(scalars), grid=(num_blocks,),
          in_specs=[q_spec, *[spec for _, spec in reach_rows], hbm, hbm],
          out_specs=[q_spec, hbm],
          scratch_shapes=[pltpu.VMEM((2, per_chunk, page_size, lanes), kv_pages.dtype),
                          pltpu.SemaphoreType.DMA((2,)),
                          pltpu.VMEM((page_size, lanes), kv_pages.dtype),
                          pltpu.VMEM((2, page_size, lanes), kv_pages.dtype),
                          pltpu.SemaphoreType.DMA((3,))]),
      out_shape=[jax.ShapeDtypeStruct(q_win.shape, q.dtype),
                 jax.ShapeDtypeStruct(pages.shape, pages.dtype)],
      input_output_aliases={len(scalars) + len(reach_rows) + 2: 1},
      compiler_params=pltpu.CompilerParams(dimension_semantics=(pltpu.ARBITRARY,)),
      interpret=interpret,
      name="ragged_paged_attention_tpu",
  )(*scalars, q_win, *[x for x, _ in reach_rows], new_rows, pages)
  out = windows.unpack_outputs(o_win.transpose(2, 0, 1, 3))  # [T, K, G, H]
  return out[:num_tokens].reshape(q.shape), pages.reshape(kv_pages.shape)

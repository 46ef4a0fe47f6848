"""Ragged paged attention for GPU (Pallas Triton lowering): one call per layer for a whole step.

Grid: (block of Tq packed tokens, KV head); programs run in any order and in parallel, with no
grid-wide barrier. So, unlike the TPU variant, no program reads what another writes:
  write   each program stores its own tokens' K and V of its KV head into their page rows (a
          row scatter; the kernel has no masked scatter in interpret mode, so padding tokens
          repeat the last real token's store: the same bytes to the same row, a benign race),
          and int8's exponent lanes, which every head's program stores alike (the same race);
  attend  keys before a sequence's new tokens (positions < context) come from its pages, the
          new ones straight from the step's new rows (packed row q_start + position - context,
          quantized like the pages), so the pages' new rows are never read in the call that
          writes them. int8 keys and values are scaled by 2^e per key (kv_quant.py).
Each program loops over the sequences [seq_lo, seq_hi) that overlap its block and, for each,
over chunks of keys from the sliding window's first (or 0) to the block's last position (plus
the most any of its rows reaches past its own, attend_until), with
an online softmax per row and rows of other sequences masked. Page rows are
gathered from the cache viewed as [L * P * Z, Cr / H, H] (a free view: Cr % H == 0 for every
power-of-two H): KV head h's K is lane group h, its V group K + h.
Triton needs power-of-two tensor sides >= 16: G is padded to Gp, Gp * Tq >= 16, C >= 16.
Shape letters: the key in jaxserve/model/__init__.py; R = Gp * Tq rows, C keys per chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import common, ragged_reference

_TARGET_ROWS = 64  # Query rows per program: 64 x H f32 accumulators fit 4 warps.


def check_triton_sizes(page_size: int, head_dim: int):
  if page_size != common.next_pow2(page_size):
    raise ValueError(f"kv_pages page_size must be a power of two on GPU, got {page_size}")
  if head_dim != common.next_pow2(head_dim) or head_dim < 16:
    raise ValueError(f"q head_dim must be a power of two >= 16 on GPU, got {head_dim}")


def chunk_pages(pages_per_chunk: int | None, page_size: int) -> int:
  """Pages per loop step: a power of two, and >= 16 positions (Triton's smallest dot side)."""
  per_chunk = common.next_pow2(pages_per_chunk or common.pages_per_chunk(page_size))
  return max(per_chunk, -(-16 // page_size))


def _ragged_kernel(tables_ref,  # [B, W] int32, the layer's pages (offset by layer * P)
                   cu_ref,  # [B + 1] int32, empty past num_seqs
                   kv_lens_ref,  # [B] int32
                   seq_lo_ref, seq_hi_ref,  # [T / Tq] int32
                   block_reach_ref,  # [T / Tq] int32: the most any of the block's rows reaches
                   src_ref, dest_ref,  # [Tq] int32: token to store, and its cache row
                   q_ref,  # [Gp, Tq, H]
                   # reach_ref [Gp, Tq] int32 (only when `reaches`: each row's reach);
                   # new_ref [T, Cr / H, H], the step's new page rows; pages_ref
                   # [L * P * Z, Cr / H, H] as given (aliased to pages_out_ref); o_ref
                   # [Gp, Tq, H]; pages_out_ref [L * P * Z, Cr / H, H]
                   *refs,
                   sm_scale: float, v_scale: float, num_kv_heads: int, scale_groups: int,
                   page_size: int, chunk_len: int, sliding_window: int | None, reaches: bool):
  reach_ref, refs = (refs[0], refs[1:]) if reaches else (None, refs)
  new_ref, pages_ref, o_ref, pages_out_ref = refs
  block, head = pl.program_id(0), pl.program_id(1)
  last_token = new_ref.shape[0] - 1
  stored = [head, num_kv_heads + head] + [2 * num_kv_heads + g for g in range(scale_groups)]

  @pl.when(cu_ref[cu_ref.shape[0] - 1] > 0)  # No real token: nothing to store.
  def _():
    src, dest = src_ref[...], dest_ref[...]
    for group in stored:
      pages_out_ref[dest, group, :] = new_ref[src, group, :]

  group, block_q, head_dim = q_ref.shape
  rows = group * block_q
  q = q_ref[...].reshape(rows, head_dim)  # [R, H]
  tok = block * block_q + (jnp.arange(rows) % block_q)[:, None]  # [R, 1]
  reach = 0 if reach_ref is None else reach_ref[...].reshape(rows, 1)  # [R, 1]
  block_start, block_end = block * block_q, (block + 1) * block_q

  def seq_body(seq, carry):
    q_start, q_end, kv_len = cu_ref[seq], cu_ref[seq + 1], kv_lens_ref[seq]
    context = kv_len - (q_end - q_start)
    in_seq = (tok >= q_start) & (tok < q_end)  # [R, 1]
    q_pos = context + tok - q_start  # [R, 1]
    first_tok, last_tok = jnp.maximum(q_start, block_start), jnp.minimum(q_end, block_end)
    kv_end = jnp.where(last_tok > first_tok, jnp.minimum(
        context + last_tok - q_start + block_reach_ref[block], kv_len), 0)
    first_chunk = 0
    if sliding_window is not None:  # Chunks wholly before the first row's window are skipped.
      first_key = jnp.maximum(context + first_tok - q_start - sliding_window + 1, 0)
      first_chunk = jnp.where(kv_end > 0, first_key // chunk_len, 0)
    last_page = jnp.maximum(pl.cdiv(kv_len, page_size) - 1, 0)  # Never past the sequence's own.

    def kv_body(chunk, carry):
      key = chunk * chunk_len + jnp.arange(chunk_len)  # [C]
      page = tables_ref[seq, jnp.minimum(key // page_size, last_page)]  # [C]
      cache_row = page * page_size + key % page_size  # [C]
      new_row = jnp.clip(q_start + key - context, 0, last_token)  # [C]
      cached = (key < context)[:, None]  # [C, 1]
      live = (key < kv_len)[:, None]  # Zeroing V past the end keeps 0 * garbage out of PV.
      load = lambda group: jnp.where(cached, pages_ref[cache_row, group, :].astype(jnp.float32),
                                     new_ref[new_row, group, :].astype(jnp.float32))  # [C, H]
      k, v = load(head), load(num_kv_heads + head)  # [C, H] f32
      if scale_groups:  # int8: key c's values times 2^e[c].
        k = k * _exponents(load, num_kv_heads, scale_groups, head, head_dim)
        v = v * _exponents(load, num_kv_heads, scale_groups, num_kv_heads + head, head_dim)
      k, v = k.astype(q.dtype), v.astype(q.dtype)
      v = jnp.where(live, v, jnp.zeros_like(v))
      mask = in_seq & (key[None, :] <= q_pos + reach)  # [R, C]
      if sliding_window is not None:
        mask &= key[None, :] > q_pos - sliding_window
      logits = common.qk_logits(q, k, sm_scale)  # [R, C]
      return common.softmax_step(carry, logits, mask, v)

    return jax.lax.fori_loop(first_chunk, pl.cdiv(kv_end, chunk_len), kv_body, carry)

  init = common.init_softmax(rows, head_dim)
  carry = jax.lax.fori_loop(seq_lo_ref[block], seq_hi_ref[block], seq_body, init)
  out = common.finish_softmax(carry)  # [R, H]
  out = out if v_scale == 1.0 else out * v_scale
  o_ref[...] = out.reshape(group, block_q, head_dim).astype(o_ref.dtype)


def _exponents(load, num_kv_heads: int, scale_groups: int, j, head_dim: int):
  """[C, 1] f32: 2^e of exponent j (K head j, or V head j - K) of every key; j may be traced.
  Picked from the exponent lanes by a masked sum (no dynamic lane index in Triton)."""
  lane = jnp.arange(head_dim)[None, :]  # [1, H]
  total = 0.0
  for g in range(scale_groups):
    exps = load(2 * num_kv_heads + g)  # [C, H]
    total = total + jnp.sum(jnp.where(lane + g * head_dim == j, exps, 0.0), axis=1,
                            keepdims=True)
  return jnp.exp2(total)


def _store_rows(page_tables, cu_live, kv_lens, num_seqs, padded: int, page_size: int):
  """src, dest [T'] int32: the token each row-store takes and the cache row it goes to; padding
  tokens repeat the last real token (see the module docstring)."""
  seq, _ = ragged_reference.token_sequences(cu_live, num_seqs, padded)
  pos = ragged_reference.token_positions(cu_live, kv_lens, seq)  # [T']
  page = page_tables[seq, jnp.clip(pos // page_size, 0, page_tables.shape[1] - 1)]
  dest = page * page_size + pos % page_size  # [T']
  src = jnp.minimum(jnp.arange(padded, dtype=jnp.int32), jnp.maximum(cu_live[num_seqs] - 1, 0))
  return src, dest[src]


@functools.partial(jax.jit, static_argnames=("dims", "sm_scale", "sliding_window", "kv_scales",
                                             "pages_per_chunk", "block_q", "num_warps",
                                             "interpret"))
def ragged_paged_attention(q, k_new, v_new, kv_pages, page_tables, cu_q_lens, kv_lens, num_seqs,
                           layer, *, dims, sm_scale, sliding_window, kv_scales=(1.0, 1.0),
                           reach=None, pages_per_chunk=None, block_q=None, num_warps=4,
                           interpret=False):
  """Checked arguments (ragged.py) -> (out [T, N, H], kv_pages); layer: int32 scalar; reach:
  None or [T] int32 (ragged_reference.token_reach)."""
  check_triton_sizes(dims.page_size, dims.head_dim)
  num_tokens, _, head_dim = q.shape
  reaches = reach is not None
  group = max(common.next_pow2(dims.group), 1)
  block_q = block_q or common.query_block(num_tokens, group, _TARGET_ROWS, max(1, 16 // group))
  if block_q != common.next_pow2(block_q) or block_q * group < 16:
    raise ValueError(f"block_q must be a power of two with block_q * {group} >= 16, got {block_q}")
  chunk_len = chunk_pages(pages_per_chunk, dims.page_size) * dims.page_size
  padded = common.round_up(num_tokens, block_q)
  live = jnp.arange(cu_q_lens.shape[0]) <= num_seqs
  cu_live = jnp.where(live, cu_q_lens, cu_q_lens[num_seqs])  # Later sequences: empty.
  seq_lo, seq_hi = common.block_seq_ranges(cu_live, padded // block_q, block_q)
  seq_hi = jnp.minimum(seq_hi, num_seqs)
  tables = page_tables + layer * dims.num_pages  # [B, W] pages of the merged [L * P] axis
  src, dest = _store_rows(tables, cu_live, kv_lens, num_seqs, padded, dims.page_size)
  dtype = common.compute_dtype(q.dtype, kv_pages.dtype)
  q_TKGH = q.reshape(num_tokens, dims.num_kv_heads, dims.group, head_dim).astype(dtype)
  q_TKGH = jnp.pad(q_TKGH, ((0, padded - num_tokens), (0, 0), (0, group - dims.group), (0, 0)))
  groups = dims.layout.lanes // head_dim
  pages = kv_pages.reshape(-1, groups, head_dim)  # [L * P * Z, Cr / H, H]
  new_rows = ragged_reference.new_rows(k_new, v_new, dims.layout, *kv_scales)  # [T, Cr]
  new_rows = new_rows.reshape(num_tokens, groups, head_dim)
  kernel = functools.partial(_ragged_kernel, sm_scale=sm_scale * kv_scales[0],
                             v_scale=kv_scales[1], num_kv_heads=dims.num_kv_heads,
                             scale_groups=dims.layout.scale_lanes // head_dim,
                             page_size=dims.page_size, chunk_len=chunk_len,
                             sliding_window=sliding_window, reaches=reaches)
  whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  q_spec = pl.BlockSpec((None, group, block_q, head_dim), lambda j, h: (h, 0, j, 0))
  token_spec = pl.BlockSpec((block_q,), lambda j, h: (j,))
  reach = jnp.zeros(padded, jnp.int32) if reach is None else jnp.pad(
      reach, (0, padded - num_tokens))
  small = (tables, cu_live, kv_lens, seq_lo, seq_hi, reach.reshape(-1, block_q).max(axis=1))
  rows = []  # Each row's reach, laid out as its queries: [Gp, T'].
  if reaches:
    rows = [(jnp.broadcast_to(reach, (group, padded)),
             pl.BlockSpec((group, block_q), lambda j, h: (0, j)))]
  o_KGTH, pages = pl.pallas_call(
      kernel,
      grid=(padded // block_q, dims.num_kv_heads),
      in_specs=[*[whole(x.shape) for x in small], token_spec, token_spec, q_spec,
                *[spec for _, spec in rows], whole(new_rows.shape), whole(pages.shape)],
      out_specs=[q_spec, whole(pages.shape)],
      out_shape=[jax.ShapeDtypeStruct((dims.num_kv_heads, group, padded, head_dim), q.dtype),
                 jax.ShapeDtypeStruct(pages.shape, pages.dtype)],
      input_output_aliases={len(small) + len(rows) + 4: 1},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
      interpret=interpret,
      name="ragged_paged_attention_gpu",
  )(*small, src, dest, q_TKGH.transpose(1, 2, 0, 3), *[x for x, _ in rows], new_rows, pages)
  out = o_KGTH.transpose(2, 0, 1, 3)[:num_tokens, :, :dims.group]  # [T, K, G, H]
  return out.reshape(q.shape), pages.reshape(kv_pages.shape)

"""Paged decode attention for GPU (Pallas Triton lowering): flash-decoding with split-K.

Grid: (sequence, KV head, split). A decode batch has too few (sequence, KV head) pairs to fill a
GPU's SMs, so each sequence's pages are also cut into `num_splits` ranges; every program keeps an
online softmax over its range for the G query heads of its KV head, and the wrapper merges the
splits' (max, sum, output) triples. Pages are gathered by row index straight from the caller's
own layout (page_layout.py), its pool viewed as [Y * Z, Ks, H]: a KV head's rows are strided loads
that need no copy, and quantized values are decoded in registers after the load.
Triton needs power-of-two tensor sizes and matmul sides >= 16: G is padded to Gp >= 16 and the
page size and head_dim must be powers of two. Shape letters: the key in
jaxserve/model/__init__.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import common, page_layout


def check_triton_sizes(page_size: int, head_dim: int):
  if page_size != common.next_pow2(page_size):
    raise ValueError(f"k_pages page_size must be a power of two on GPU, got {page_size}")
  if head_dim != common.next_pow2(head_dim) or head_dim < 16:
    raise ValueError(f"q head_dim must be a power of two >= 16 on GPU, got {head_dim}")


def chunk_pages(pages_per_chunk: int | None, page_size: int) -> int:
  """Pages per loop step: a power of two, and >= 16 positions (Triton's smallest dot side)."""
  per_chunk = common.next_pow2(pages_per_chunk or common.pages_per_chunk(page_size))
  return max(per_chunk, -(-16 // page_size))


def gather_chunk(tables_ref, seq, first_page, num_pages, pool_refs, head, *, index, page_size,
                 per_chunk, dtype):
  """K and V [C, H] (dtype, decoded) of pages [first_page, first_page + Q) of `seq` for one
  KV head; pages past the sequence's last re-read that page (real, finite data; the caller
  masks them). pool_refs: K, V pools [Y * Z, Ks, H], then K, V scale pools [Y * Z, Ks] or none."""
  page_index = jnp.minimum(first_page + jnp.arange(per_chunk), num_pages - 1)  # [Q]
  pages = tables_ref[seq, page_index]  # [Q]
  offsets = jnp.arange(page_size)[None, :]  # [1, Z]
  col = index.head_in_slab(head)
  out = []
  for kv in (0, 1):
    slabs = index.slab(pages, kv, head)  # [Q]
    rows = (slabs[:, None] * page_size + offsets).reshape(-1)  # [C]
    scale = pool_refs[2 + kv][rows, col][:, None] if len(pool_refs) == 4 else None  # [C, 1]
    out.append(page_layout.decode_slab(pool_refs[kv][rows, col, :], scale, dtype))
  return out


def _decode_kernel(tables_ref, lengths_ref, q_ref, *refs, sm_scale: float, index,
                   page_size: int, per_chunk: int, pages_per_split: int):
  """tables_ref [B, Wp]; lengths_ref [B]; q_ref [Gp, H] query heads of this KV head; refs: the
  pools (see gather_chunk), then this split's outputs: o [Gp, H] f32 unnormalised, its running
  max m [Gp] and sum l [Gp]."""
  pool_refs, (o_ref, m_ref, l_ref) = refs[:-3], refs[-3:]
  seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = lengths_ref[seq]
  num_pages = pl.cdiv(length, page_size)
  first = split * pages_per_split
  last = jnp.minimum(first + pages_per_split, num_pages)
  end_pos = jnp.minimum(length, last * page_size)  # Positions of this split end here.
  chunk_len = per_chunk * page_size
  q = q_ref[...]  # [Gp, H]
  rows = q.shape[0]

  def body(chunk, carry):
    first_page = first + chunk * per_chunk
    k, v = gather_chunk(tables_ref, seq, first_page, num_pages, pool_refs, head, index=index,
                        page_size=page_size, per_chunk=per_chunk, dtype=q.dtype)  # [C, H] each
    kv_pos = first_page * page_size + jnp.arange(chunk_len)  # [C]
    mask = jnp.broadcast_to((kv_pos < end_pos)[None, :], (rows, chunk_len))  # [Gp, C]
    logits = common.qk_logits(q, k, sm_scale)  # [Gp, C]
    return common.softmax_step(carry, logits, mask, v)

  num_chunks = pl.cdiv(jnp.maximum(last - first, 0), per_chunk)
  m, l, acc = jax.lax.fori_loop(0, num_chunks, body, common.init_softmax(rows, q.shape[1]))
  o_ref[...] = acc
  m_ref[...] = m.reshape(rows)
  l_ref[...] = l.reshape(rows)


def merge_splits(o, m, l):
  """[U, ..., Gp, H], [U, ..., Gp] x2 partial results of U splits -> normalised [..., Gp, H]."""
  m_all = jnp.max(m, axis=0)  # [..., Gp]
  weight = jnp.exp(m - m_all)  # [U, ..., Gp]
  l_all = jnp.sum(l * weight, axis=0)  # [..., Gp]
  o_all = jnp.sum(o * weight[..., None], axis=0)  # [..., Gp, H]
  return o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def _default_splits(num_seqs: int, num_kv_heads: int, num_chunks: int) -> int:
  """Enough programs to cover a large GPU's SMs (~132 on H100/H200) about twice over."""
  return max(1, min(num_chunks, 256 // max(1, num_seqs * num_kv_heads)))


def _flat_pools(pools: page_layout.Pools):
  """The pools as rows [Y * Z, Ks, H] (scales [Y * Z, Ks]): free views, gathered by row."""
  arrays = [pools.k, pools.v]
  if pools.k_scale is not None:
    arrays += [pools.k_scale, pools.v_scale]
  return [x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]) for x in arrays]


@functools.partial(jax.jit, static_argnames=("layout", "sm_scale", "pages_per_chunk",
                                             "num_splits", "num_warps", "interpret"))
def paged_decode_attention(q, k_pages, v_pages, page_tables, lengths, *, k_scale=None,
                           v_scale=None, layout=page_layout.PageLayout.TOKEN_MAJOR, layer=None,
                           sm_scale=None, pages_per_chunk=None, num_splits=None, num_warps=4,
                           interpret=False):
  """q [B, N, H] attends to positions [0, lengths[b]) of its pages; returns [B, N, H].

  k_pages, v_pages (k_scale, v_scale, layer): pages of `layout`, see page_layout.to_pools;
  page_tables [B, W] int32; lengths [B] int32.
  """
  pools = page_layout.to_pools(layout, k_pages, v_pages, k_scale, v_scale, page_tables, layer)
  dims = page_layout.check_decode(q, pools, lengths)
  check_triton_sizes(dims.page_size, dims.head_dim)
  num_seqs, _, head_dim = q.shape
  per_chunk = chunk_pages(pages_per_chunk, dims.page_size)
  num_chunks = -(-dims.pages_per_seq // per_chunk)
  splits = num_splits or _default_splits(num_seqs, dims.num_kv_heads, num_chunks)
  pages_per_split = -(-num_chunks // splits) * per_chunk
  tables = jnp.pad(pools.tables, ((0, 0), (0, splits * pages_per_split - dims.pages_per_seq)))
  rows = max(16, common.next_pow2(dims.group))
  q_BKGH = q.reshape(num_seqs, dims.num_kv_heads, dims.group, head_dim)
  q_BKGH = q_BKGH.astype(pools.dequantized_dtype(q.dtype))
  q_BKGH = jnp.pad(q_BKGH, ((0, 0), (0, 0), (0, rows - dims.group), (0, 0)))
  flat = _flat_pools(pools)
  kernel = functools.partial(_decode_kernel, sm_scale=common.default_scale(sm_scale, head_dim),
                             index=pools.index, page_size=dims.page_size, per_chunk=per_chunk,
                             pages_per_split=pages_per_split)
  whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  partial_shape = (splits, num_seqs, dims.num_kv_heads, rows)
  o, m, l = pl.pallas_call(
      kernel,
      grid=(num_seqs, dims.num_kv_heads, splits),
      in_specs=[whole(tables.shape), whole(lengths.shape),
                pl.BlockSpec((None, None, rows, head_dim), lambda b, k, u: (b, k, 0, 0)),
                *[whole(x.shape) for x in flat]],
      out_specs=[pl.BlockSpec((None, None, None, rows, head_dim), lambda b, k, u: (u, b, k, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda b, k, u: (u, b, k, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda b, k, u: (u, b, k, 0))],
      out_shape=[jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                 jax.ShapeDtypeStruct(partial_shape, jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
      interpret=interpret,
      name="paged_decode_attention_gpu",
  )(tables, lengths, q_BKGH, *flat)
  out = merge_splits(o, m, l)[:, :, :dims.group]  # [B, K, G, H]
  return out.reshape(q.shape).astype(q.dtype)

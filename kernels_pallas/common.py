"""What the TPU and GPU kernels share: argument checks, block sizes and the online-softmax step.

Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

# Finite, so `m_prev - m_new` never becomes inf - inf = nan; exp() of it underflows to 0.
MASK_VALUE = -1e30
KV_DTYPES = (jnp.float32, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class PagedDims:
  """The static sizes of one call, read off the argument shapes."""

  num_heads: int
  num_kv_heads: int
  head_dim: int
  num_pages: int
  page_size: int
  pages_per_seq: int

  @property
  def group(self) -> int:
    return self.num_heads // self.num_kv_heads


def require(ok: bool, message: str):
  if not ok:
    raise ValueError(message)



def check_int_array(x, name: str, shape: tuple[int, ...]):
  require(getattr(x, "shape", None) == shape, f"{name} must have shape {shape}, got "
                                               f"{getattr(x, 'shape', type(x).__name__)}")
  require(x.dtype == jnp.int32, f"{name} must be int32, got {x.dtype}")


def check_paged_args(q, k_pages, v_pages, page_tables, num_seqs: int) -> PagedDims:
  """Checks what decode and prefill share; raises ValueError naming the bad argument."""
  require(q.ndim == 3, f"q must be [tokens, num_heads, head_dim], got shape {q.shape}")
  require(k_pages.ndim == 4,
           f"k_pages must be [num_pages, page_size, num_kv_heads, head_dim], got {k_pages.shape}")
  require(v_pages.shape == k_pages.shape,
           f"v_pages must have k_pages' shape {k_pages.shape}, got {v_pages.shape}")
  require(v_pages.dtype == k_pages.dtype,
           f"v_pages must have k_pages' dtype {k_pages.dtype}, got {v_pages.dtype}")
  require(k_pages.dtype in KV_DTYPES, f"k_pages must be float32 or bfloat16, got {k_pages.dtype}")
  num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
  _, num_heads, q_head_dim = q.shape
  require(q_head_dim == head_dim, f"q head_dim {q_head_dim} != k_pages head_dim {head_dim}")
  require(num_heads % num_kv_heads == 0,
           f"q num_heads {num_heads} must be a multiple of k_pages num_kv_heads {num_kv_heads}")
  require(page_tables.ndim == 2, f"page_tables must be 2-D, got shape {page_tables.shape}")
  check_int_array(page_tables, "page_tables", (num_seqs, page_tables.shape[1]))
  return PagedDims(num_heads, num_kv_heads, head_dim, num_pages, page_size, page_tables.shape[1])


def check_decode_args(q, k_pages, v_pages, page_tables, lengths) -> PagedDims:
  dims = check_paged_args(q, k_pages, v_pages, page_tables, q.shape[0] if q.ndim else -1)
  check_int_array(lengths, "lengths", (q.shape[0],))
  return dims


def check_prefill_args(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens) -> PagedDims:
  require(kv_lens.ndim == 1, f"kv_lens must be 1-D [num_seqs], got shape {kv_lens.shape}")
  num_seqs = kv_lens.shape[0]
  dims = check_paged_args(q, k_pages, v_pages, page_tables, num_seqs)
  check_int_array(kv_lens, "kv_lens", (num_seqs,))
  check_int_array(cu_q_lens, "cu_q_lens", (num_seqs + 1,))
  return dims


def default_scale(sm_scale: float | None, head_dim: int) -> float:
  return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def pages_per_chunk(page_size: int, chunk_tokens: int = 128) -> int:
  """Pages fetched per inner-loop step: about `chunk_tokens` KV positions, at least one page."""
  return max(1, chunk_tokens // page_size)


def query_block(num_tokens: int, group: int, target_rows: int, min_block: int) -> int:
  """Tokens per prefill query block: the largest power of two with block * group <= target_rows,
  no longer than the (padded) token count, and at least min_block (the tiling's row multiple)."""
  block = 1 << max(0, (target_rows // group).bit_length() - 1)
  return max(min_block, min(block, next_pow2(num_tokens)))


def block_seq_ranges(cu_q_lens, num_blocks: int, block_q: int):
  """For each query block, the sequences [seq_lo, seq_hi) whose tokens fall inside it."""
  starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q  # [num_blocks]
  seq_lo = jnp.searchsorted(cu_q_lens[1:], starts, side="right")  # First sequence ending past it.
  seq_hi = jnp.searchsorted(cu_q_lens[:-1], starts + block_q, side="left")  # Starting before its end.
  return seq_lo.astype(jnp.int32), seq_hi.astype(jnp.int32)


def init_softmax(rows: int, width: int):
  """(running max, running sum, unnormalised output) for `rows` query rows."""
  return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
          jnp.zeros((rows, width), jnp.float32))


def softmax_step(carry, logits, mask, v):
  """One flash-attention step over a chunk of C keys; masked entries contribute exactly 0.

  carry: ([R, 1], [R, 1], [R, Hv]) f32; logits [R, C] f32; mask [R, C] bool; v [C, Hv].
  """
  m_prev, l_prev, acc_prev = carry
  logits = jnp.where(mask, logits, MASK_VALUE)  # [R, C]
  m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))  # [R, 1]
  alpha = jnp.exp(m_prev - m_new)  # [R, 1]
  # The where matters for rows with no valid key yet: there exp(MASK - MASK) would be 1.
  p = jnp.where(mask, jnp.exp(logits - m_new), 0.0)  # [R, C]
  l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)  # [R, 1]
  pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                       preferred_element_type=jnp.float32)  # [R, Hv]
  return m_new, l_new, alpha * acc_prev + pv


def qk_logits(q, k, sm_scale: float):
  """[R, Hv] x [C, Hv] -> [R, C] scaled f32 logits (K used untransposed: an NT matmul)."""
  logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return logits * sm_scale


def finish_softmax(carry):
  """The normalised output; rows that saw no valid key (length 0, padding) come out as 0."""
  _, l, acc = carry
  return acc / jnp.where(l > 0, l, 1.0)  # [R, Hv]; acc is 0 wherever l is.


def compute_dtype(q_dtype, kv_dtype):
  """The one dtype both matmul operands are cast to: bf16 only when Q and K/V both are."""
  return jnp.promote_types(q_dtype, kv_dtype)

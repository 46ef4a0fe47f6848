"""What the ragged kernel's TPU and GPU variants share: argument checks, block sizes and the
online-softmax step.

Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# Finite, so `m_prev - m_new` never becomes inf - inf = nan; exp() of it underflows to 0.
MASK_VALUE = -1e30


def require(ok: bool, message: str):
  if not ok:
    raise ValueError(message)


def check_int_array(x, name: str, shape: tuple[int, ...]):
  require(getattr(x, "shape", None) == shape, f"{name} must have shape {shape}, got "
                                               f"{getattr(x, 'shape', type(x).__name__)}")
  require(x.dtype == jnp.int32, f"{name} must be int32, got {x.dtype}")


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
  # Starting before its end.
  seq_hi = jnp.searchsorted(cu_q_lens[:-1], starts + block_q, side="left")
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
  """The one dtype both matmul operands are cast to: bf16 only when Q and K/V both are; Q's
  own for 8-bit K/V, which is dequantized to it."""
  if jnp.dtype(kv_dtype).itemsize == 1:
    return jnp.dtype(q_dtype)
  return jnp.promote_types(q_dtype, kv_dtype)

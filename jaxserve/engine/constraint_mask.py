"""Constrained decoding, device side: the host's allowed-token bitmask applied to the logits.

The mask is an input array like every other sampling setting, so a batch that mixes constrained
and unconstrained rows, or any two masks, runs the same compiled step. A row of all ones
(constraint.ALL_ALLOWED in every word) is an unconstrained row: its logits pass through unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
  """logits [B, V] float32, bitmask [B, ceil(V/32)] int32 -> [B, V], disallowed tokens at -inf.

  Token t is allowed in row b when bit t % 32 of bitmask[b, t // 32] is set (llguidance's and
  xgrammar's packing).
  """
  num_rows, vocab_size = logits.shape
  num_words = -(-vocab_size // 32)
  if bitmask.shape != (num_rows, num_words) or bitmask.dtype != jnp.int32:
    raise ValueError(f"bitmask must be int32 [{num_rows}, {num_words}] for logits "
                     f"{list(logits.shape)}, got {bitmask.dtype} {list(bitmask.shape)}")
  bits = jnp.arange(32, dtype=jnp.int32)  # [32]
  # The shift is arithmetic, but `& 1` keeps only the bit asked for, so bit 31 reads true too.
  allowed = (bitmask[:, :, None] >> bits[None, None, :]) & 1  # [B, ceil(V/32), 32]
  allowed = allowed.reshape(num_rows, num_words * 32)[:, :vocab_size]  # [B, V]
  return jnp.where(allowed.astype(bool), logits, -jnp.inf)

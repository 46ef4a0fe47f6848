"""Prefill: one chunk of one sequence, padded to a length bucket, in one compiled function."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxserve.model.attention import AttentionMetadata, AttentionSpec
from jaxserve.engine.decode import DecodeState
from jaxserve.model.kv_cache import SCRATCH_PAGE, KVCache
from jaxserve.engine.sample import sample


def prefill_step(graphdef, params, cache: KVCache, state: DecodeState, tokens, start_pos, true_len,
                 page_table, slot, is_last, stop_ids, *, attn: AttentionSpec):
  """Writes the K/V of tokens[:true_len] at positions start_pos.. and samples the next token.

  tokens [T] (padded), page_table [W], scalars start_pos, true_len, slot, is_last (all arrays:
  only T and W set shapes). When is_last, `slot` is set to decode from the sampled token.
  Returns (cache, state, Sampled [1]).
  """
  T, Z = tokens.shape[0], cache.page_size
  positions = start_pos + jnp.arange(T, dtype=jnp.int32)  # [T]
  real = jnp.arange(T) < true_len
  page = jnp.where(real, page_table[jnp.minimum(positions // Z, page_table.shape[0] - 1)], SCRATCH_PAGE)
  meta = AttentionMetadata(
      positions=positions[None],
      cache_index=(page * Z + positions % Z)[None],
      page_tables=page_table[None],
      kv_lens=(start_pos + true_len)[None],
      q_lens=true_len[None])
  logits, cache = nnx.merge(graphdef, params)(tokens[None], cache, meta, attn)  # [1, V]
  next_pos = start_pos + true_len  # Where the sampled token will sit.
  sampled = sample(logits, state.sampling.row(slot), next_pos[None], stop_ids)
  return cache, state.insert(slot, sampled.tokens[0], next_pos, is_last), sampled

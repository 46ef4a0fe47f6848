"""Prefill: one chunk of one sequence, padded to a length bucket, in one compiled function.

Two variants share the forward: `prefill_step` keeps the last real position's logits only, and
`prompt_logprobs_step` (compiled for the same buckets at warm-up) also scores every position of
the chunk against the prompt's next token, for requests that ask for prompt logprobs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.engine.decode import DecodeState
from jaxserve.engine.sample import NUM_TOP_LOGPROBS, sample
from jaxserve.model.attention import AttentionMetadata, AttentionSpec
from jaxserve.model.kv_cache import SCRATCH_PAGE, KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
  """Per chunk position t: how likely the prompt's token at t + 1 was, given the tokens to t."""

  logprobs: jax.Array  # [T] float32: log-probability of targets[t] under the full distribution
  ranks: jax.Array  # [T] int32: 1 + how many tokens were more likely than targets[t]
  top_ids: jax.Array  # [T, min(NUM_TOP_LOGPROBS, V)] int32, most likely first
  top_logprobs: jax.Array  # [T, min(NUM_TOP_LOGPROBS, V)] float32


def prefill_step(graphdef, params, cache: KVCache, state: DecodeState, tokens, start_pos, true_len,
                 page_table, slot, is_last, bitmask, stop_ids, *, attn: AttentionSpec):
  """Writes the K/V of tokens[:true_len] at positions start_pos.. and samples the next token.

  tokens [T] (padded), page_table [W], scalars start_pos, true_len, slot, is_last, bitmask
  [1, ceil(V/32)] int32 (the allowed next tokens) (all arrays: only T and W set shapes). When is_last, `slot` is set to decode from the sampled token.
  Returns (cache, state, Sampled [1]).
  """
  meta = _metadata(tokens, start_pos, true_len, page_table, cache.page_size)
  logits, cache = nnx.merge(graphdef, params)(tokens[None], cache, meta, attn)  # [1, V]
  return (cache, *_sample_next(state, logits, start_pos, true_len, slot, is_last, bitmask, stop_ids))


def prompt_logprobs_step(graphdef, params, cache: KVCache, state: DecodeState, tokens, start_pos,
                         true_len, page_table, slot, is_last, bitmask, stop_ids, targets, *,
                         attn: AttentionSpec):
  """`prefill_step`, plus targets [T] (the prompt token after each position; padding past the
  prompt's end is ignored) -> (cache, state, Sampled [1], PromptLogprobs [T])."""
  meta = _metadata(tokens, start_pos, true_len, page_table, cache.page_size)
  logits, cache = nnx.merge(graphdef, params)(tokens[None], cache, meta, attn, last_only=False)
  logits = logits[0]  # [T, V]
  last = jax.lax.dynamic_slice_in_dim(logits, jnp.maximum(true_len - 1, 0), 1)  # [1, V]
  state, sampled = _sample_next(state, last, start_pos, true_len, slot, is_last, bitmask, stop_ids)
  logprobs = jax.nn.log_softmax(logits, axis=-1)  # [T, V]
  chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)  # [T, 1]
  ranks = 1 + jnp.sum(logprobs > chosen, axis=-1, dtype=jnp.int32)  # [T]
  top_lp, top_ids = jax.lax.top_k(logprobs, min(NUM_TOP_LOGPROBS, logits.shape[-1]))  # [T, N]
  return cache, state, sampled, PromptLogprobs(chosen[:, 0], ranks, top_ids.astype(jnp.int32), top_lp)


def _metadata(tokens, start_pos, true_len, page_table, Z: int) -> AttentionMetadata:
  T = tokens.shape[0]
  positions = start_pos + jnp.arange(T, dtype=jnp.int32)  # [T]
  real = jnp.arange(T) < true_len
  page = jnp.where(real, page_table[jnp.minimum(positions // Z, page_table.shape[0] - 1)], SCRATCH_PAGE)
  return AttentionMetadata(
      positions=positions[None],
      cache_index=(page * Z + positions % Z)[None],
      page_tables=page_table[None],
      kv_lens=(start_pos + true_len)[None],
      q_lens=true_len[None])


def _sample_next(state: DecodeState, logits, start_pos, true_len, slot, is_last, bitmask, stop_ids):
  """logits [1, V] of the chunk's last real position -> (state, Sampled [1])."""
  next_pos = start_pos + true_len  # Where the sampled token will sit.
  sampled = sample(logits, state.sampling.row(slot), next_pos[None], stop_ids, bitmask)
  return state.insert(slot, sampled.tokens[0], next_pos, is_last), sampled

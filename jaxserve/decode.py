"""Decode: one token for every slot, in one fixed-shape compiled step.

The step reads each slot's input token and position from `DecodeState` on the device and writes
the sampled ones back, so the host can dispatch step n+1 before step n's tokens reach it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.attention import AttentionMetadata
from jaxserve.config import AttentionBackend
from jaxserve.kv_cache import SCRATCH_PAGE, KVCache
from jaxserve.sample import SamplingState, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  tokens: jax.Array  # [S] int32: each slot's next input token (the last one sampled)
  positions: jax.Array  # [S] int32: where that token sits (= KV entries already written)
  sampling: SamplingState

  @classmethod
  def create(cls, num_slots: int, vocab_size: int) -> DecodeState:
    zeros = lambda: jnp.zeros(num_slots, jnp.int32)  # Distinct buffers: both are donated.
    return cls(zeros(), zeros(), SamplingState.create(num_slots, vocab_size))

  def insert(self, slot, token, position, is_last) -> DecodeState:
    """After a prompt's last chunk: `slot` decodes from `token` at `position`."""
    hit = (jnp.arange(self.tokens.shape[0]) == slot) & is_last  # [S]
    return DecodeState(
        tokens=jnp.where(hit, token, self.tokens),
        positions=jnp.where(hit, position, self.positions),
        sampling=self.sampling.count(jnp.full_like(self.tokens, token), hit))


def decode_step(graphdef, params, cache: KVCache, state: DecodeState, block_tables, active, stop_ids,
                *, backend: AttentionBackend):
  """block_tables [S, W], active [S] bool -> (cache, state, Sampled [S])."""
  S, Z = state.tokens.shape[0], cache.page_size
  pos = state.positions  # [S]
  page = jnp.take_along_axis(block_tables, jnp.minimum(pos // Z, block_tables.shape[1] - 1)[:, None], 1)[:, 0]
  page = jnp.where(active, page, SCRATCH_PAGE)
  meta = AttentionMetadata(
      positions=pos[:, None],
      slot_mapping=(page * Z + pos % Z)[:, None],
      block_tables=block_tables,
      kv_lens=jnp.where(active, pos + 1, 0),
      q_lens=jnp.ones(S, jnp.int32))
  logits, cache = nnx.merge(graphdef, params)(state.tokens[:, None], cache, meta, backend)  # [S, V]
  sampled = sample(logits, state.sampling, pos + 1, stop_ids)
  state = DecodeState(
      tokens=jnp.where(active, sampled.tokens, state.tokens),
      positions=jnp.where(active, pos + 1, pos),
      sampling=state.sampling.count(sampled.tokens, active))
  return cache, state, sampled

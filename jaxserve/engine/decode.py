"""Decode: one token for each decoding slot, in one fixed-shape compiled step.

The step reads each slot's input token and position from `DecodeState` on the device and writes
the sampled ones back, so the host can dispatch step n+1 before step n's tokens reach it.

It runs the model on B rows, B a compiled batch bucket (`EngineConfig.decode_batch_buckets`):
the rows name the slots that decode, so two requests in 16 slots cost a batch of 2, not 16.
Padding rows name slot S (out of range): they read slot S-1's state, write to the scratch page,
and every write back to the state drops them. Under data parallelism (`in_place`) the slots are
split over devices by position, so B = S and row i is slot i: no gather, no scatter, and no
device needs another's slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.engine.sample import SamplingState, sample
from jaxserve.model.attention import AttentionMetadata, AttentionSpec
from jaxserve.model.kv_cache import SCRATCH_PAGE, KVCache


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


def decode_step(graphdef, params, cache: KVCache, state: DecodeState, rows, page_tables, bitmask,
                stop_ids, *, attn: AttentionSpec, in_place: bool = False):
  """rows [B] int32 (slots; S = padding), page_tables [B, W], bitmask [B, ceil(V/32)] int32 (row
  b's allowed tokens) -> (cache, state, Sampled [S]).

  The sampled values come back per slot, [S, ...]: rows that did not decode hold zeros."""
  S, B, Z = state.tokens.shape[0], rows.shape[0], cache.page_size
  active = rows < S  # [B]
  if in_place:
    take = lambda x: x
    put = lambda x, new: jnp.where(active.reshape((S,) + (1,) * (x.ndim - 1)), new, x)
  else:
    mine = jnp.minimum(rows, S - 1)  # [B]: safe to gather with.
    take = lambda x: x[mine]  # [S, ...] -> [B, ...]
    put = lambda x, new: x.at[rows].set(new, mode="drop")  # [B, ...] into [S, ...]
  pos = take(state.positions)  # [B]
  sampling = jax.tree.map(take, state.sampling)  # [B, ...] on every leaf
  page = jnp.take_along_axis(page_tables, jnp.minimum(pos // Z, page_tables.shape[1] - 1)[:, None], 1)[:, 0]
  page = jnp.where(active, page, SCRATCH_PAGE)
  meta = AttentionMetadata(
      positions=pos[:, None],
      cache_index=(page * Z + pos % Z)[:, None],
      page_tables=page_tables,
      kv_lens=jnp.where(active, pos + 1, 0),
      q_lens=jnp.ones(B, jnp.int32))
  logits, cache = nnx.merge(graphdef, params)(take(state.tokens)[:, None], cache, meta, attn)  # [B, V]
  sampled = sample(logits, sampling, pos + 1, stop_ids, bitmask)
  counts = sampling.count(sampled.tokens, active).output_counts  # [B, V]
  state = DecodeState(
      tokens=put(state.tokens, sampled.tokens),
      positions=put(state.positions, pos + 1),
      sampling=dataclasses.replace(state.sampling, output_counts=put(state.sampling.output_counts, counts)))
  return cache, state, jax.tree.map(lambda x: put(jnp.zeros((S,) + x.shape[1:], x.dtype), x), sampled)

"""Speculative decoding on the device: verify each proposed run in the step that computes it.

A verified chunk is the sequence's last token followed by its k' <= k proposals, packed like a
prefill chunk (engine/step_args.py); the step reads that token and its position from the slot's
decode state (engine/step.py), so they may be the outcome of a run the host has not read yet.
The step keeps the last layer's output at every position and, for each verified chunk, picks
the model's own token after each of its k' + 1 positions with the sequence's settings
(engine/sample.py). The proposals are accepted up to the first one that is
not the model's token; the token the model picks at that point comes on top, so a run gives
a + 1 tokens for a accepted proposals, and at least the one a decode would have given.

The KV of every position was written; the sequence's position moves only past the accepted
ones (step.py writes it into the decode state), so the rejected positions' KV is never read and
is overwritten by the tokens that do come there. vLLM's rejection sampler and tpu-inference's
spec decode verify the same way for greedy requests (argmax equal to the proposal).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.engine.sample import sample
from jaxserve.engine.sampling_state import SamplingState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verified:
  accepted: jax.Array  # [Bp] int32: proposals accepted (0 for a chunk that is not verified)
  next_token: jax.Array  # [Bp] int32: the model's token after the accepted ones
  is_verified: jax.Array  # [Bp] bool
  packed: jax.Array  # [Bp, 1 + (k + 1) * (2 + 2 * n)] int32: accepted, then step.pack_sampled's
  # columns at each of the k + 1 positions
  counts: jax.Array  # [Bp, V] int32: the accepted proposals, counted (for the penalties)


def verify(head, hidden, rows: SamplingState, starts, live, args, stop_ids, pack) -> Verified:
  """head: the model's head, hidden [T, D] the last layer's output at every packed row, rows
  [Bp, ...] the prefill sequences' sampling settings, starts [Bp] their first positions, live
  [Bp], args the step's StepArgs (verify_rows [Bp, k + 1], verify_drafts [Bp, k]), pack:
  step.pack_sampled."""
  drafts = args.verify_drafts  # [Bp, k]
  Bp, K1 = args.verify_rows.shape
  is_verified = live & (drafts[:, 0] >= 0)  # [Bp]
  logits = head(hidden[args.verify_rows.reshape(-1)])  # [Bp * (k + 1), V]
  each = lambda x: jnp.repeat(x, K1, axis=0)  # [Bp, ...] -> [Bp * (k + 1), ...]
  rows = jax.tree.map(each, rows).plain_where_not(each(is_verified))
  # The penalties at position i count the proposals before it, as if each had been sampled.
  V = rows.output_counts.shape[1]
  before = jnp.cumsum(jax.nn.one_hot(drafts, V, dtype=jnp.int32), axis=1)  # [Bp, k, V]
  before = jnp.concatenate([jnp.zeros_like(before[:, :1]), before], axis=1)  # [Bp, k + 1, V]
  rows = dataclasses.replace(rows, output_counts=rows.output_counts + before.reshape(-1, V))
  # Position i of a verified chunk is the sequence's position start + i; its token goes after.
  positions = (starts[:, None] + 1 + jnp.arange(K1)[None, :]).reshape(-1)
  sampled = sample(logits, rows, positions, stop_ids)
  tokens = sampled.tokens.reshape(Bp, K1)  # [Bp, k + 1]
  agree = (tokens[:, :-1] == drafts).astype(jnp.int32)  # [Bp, k]
  accepted = jnp.where(is_verified, jnp.sum(jnp.cumprod(agree, axis=1), axis=1), 0)  # [Bp]
  next_token = jnp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]
  packed = jnp.concatenate([accepted[:, None], pack(sampled).reshape(Bp, -1)], axis=1)
  counts = jnp.take_along_axis(before, accepted[:, None, None], axis=1)[:, 0]  # [Bp, V]
  return Verified(accepted.astype(jnp.int32), next_token, is_verified, packed, counts)

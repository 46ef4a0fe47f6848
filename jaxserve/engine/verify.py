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
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.batching.plan import PrefillChunk
from jaxserve.config import LogprobsMode
from jaxserve.engine.sample import Sampled, sample
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


def sample_verifying(head, hidden, rows: SamplingState, positions, kv_lens, sample_rows, live,
                     args, stop_ids, pack, logprobs_mode: LogprobsMode
                     ) -> tuple[Sampled, Verified]:
  """The sampling of a verifying step, one head pass and one sampler pass over the decode rows
  and every verified position: (Sampled [B], each sequence's token as sample() gives it, and
  Verified). head: the model's head; hidden [T, D] the last layer's output at every packed row;
  rows [B, ...] every sequence's sampling settings; positions [T] each packed row's position;
  kv_lens, sample_rows and live [B]; args the step's StepArgs (verify_rows [Bp, k + 1],
  verify_drafts [Bp, k]); pack: step.pack_sampled; logprobs_mode: sample()'s.

  On CPU a head pass costs about as much for 2 rows as for 5 (a 5-row head took ~4x a 1-row
  one, profile_decode.py --verify), so the rows that sample (a prompt's last row is its chunk's last
  verify row, verify_args) share one pass with the verified positions."""
  Bd, (Bp, K1) = args.decode_slots.shape[0], args.verify_rows.shape
  drafts = args.verify_drafts  # [Bp, k]
  is_verified = live[Bd:] & (drafts[:, 0] >= 0)  # [Bp]
  picks = jnp.concatenate([sample_rows[:Bd], args.verify_rows.reshape(-1)])  # [Bd + Bp * K1]
  logits = head(hidden[picks])  # [Bd + Bp * K1, V]
  each = lambda x: jnp.repeat(x, K1, axis=0)  # [Bp, ...] -> [Bp * K1, ...]
  rows_at = lambda x: jnp.concatenate([x[:Bd], each(x[Bd:])])  # [B, ...] -> [Bd + Bp * K1, ...]
  # The penalties at position i count the proposals before it, as if each had been sampled
  # (no proposals: zeros, so a prompt's row is its own).
  V = rows.output_counts.shape[1]
  before = jnp.cumsum(jax.nn.one_hot(drafts, V, dtype=jnp.int32), axis=1)  # [Bp, k, V]
  before = jnp.concatenate([jnp.zeros_like(before[:, :1]), before], axis=1)  # [Bp, K1, V]
  rows = jax.tree.map(rows_at, rows)
  added = jnp.concatenate([jnp.zeros((Bd, V), jnp.int32), before.reshape(-1, V)])
  rows = dataclasses.replace(rows, output_counts=rows.output_counts + added)
  # Each verified row's token goes after it; a prompt's last row samples at kv_len as always.
  at = jnp.concatenate([kv_lens[:Bd], positions[args.verify_rows.reshape(-1)] + 1])
  sampled = sample(logits, rows, at, stop_ids, rows_at(args.bitmask), logprobs_mode=logprobs_mode)
  last = lambda x: jnp.concatenate([x[:Bd], x[Bd:].reshape((Bp, K1) + x.shape[1:])[:, -1]])
  verified = _accept(jax.tree.map(lambda x: x[Bd:], sampled), drafts, is_verified, before, pack)
  return jax.tree.map(last, sampled), verified


def _accept(sampled: Sampled, drafts, is_verified, before, pack) -> Verified:
  """sampled [Bp * K1] at every verified position, drafts [Bp, k], is_verified [Bp], before
  [Bp, K1, V] the proposals counted before each position -> Verified."""
  Bp, K1 = before.shape[:2]
  tokens = sampled.tokens.reshape(Bp, K1)  # [Bp, k + 1]
  agree = (tokens[:, :-1] == drafts).astype(jnp.int32)  # [Bp, k]
  accepted = jnp.where(is_verified, jnp.sum(jnp.cumprod(agree, axis=1), axis=1), 0)  # [Bp]
  next_token = jnp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]
  packed = jnp.concatenate([accepted[:, None], pack(sampled).reshape(Bp, -1)], axis=1)
  counts = jnp.take_along_axis(before, accepted[:, None, None], axis=1)[:, 0]  # [Bp, V]
  return Verified(accepted.astype(jnp.int32), next_token, is_verified, packed, counts)


def verify_args(chunks: Sequence[PrefillChunk], Bd: int, Bp: int, k: int
                ) -> dict[str, np.ndarray]:
  """The host side: verify_rows [Bp, k + 1] and verify_drafts [Bp, k] (StepArgs) for `chunks`,
  packed from row Bd; k: num_speculative_tokens."""
  rows, drafts = np.full((Bp, k + 1), Bd, np.int32), np.full((Bp, k), -1, np.int32)
  at = Bd
  for j, ch in enumerate(chunks):
    n, d = len(ch.token_ids), ch.num_drafts
    if d > k:
      raise ValueError(f"a chunk of {d} proposals: at most {k} (num_speculative_tokens)")
    rows[j] = at + n - 1
    rows[j, :d + 1] = at + n - 1 - d + np.arange(d + 1)
    drafts[j, :d] = ch.token_ids[n - d:]
    at += n
  return dict(verify_rows=rows, verify_drafts=drafts)

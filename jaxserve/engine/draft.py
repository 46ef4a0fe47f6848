"""Speculative decoding's draft model on the device (SpeculativeConfig(method="draft")): a
smaller model with the target's tokenizer proposes each verified chunk's tokens inside the step
that verifies them.

The draft keeps its KV in page groups of its own (its layers and heads, `KVCache.draft`, beside
the target's groups in the one cache), addressed by the target's page tables: the same pages
and positions, so no second allocator, and each page costs both models' KV
(capacity.num_kv_pages). To keep that KV whole, the draft runs
over every token the target runs over, in every step (`follow`): prompt chunks, decode rows,
verified runs. Rejected positions need nothing: the sequence's length rolls back and the tokens
that come there later overwrite them, in both caches.

In a verifying step the host sends each verified chunk as its last known token and d <= k
placeholders (batching/speculative.py). `propose` runs the draft k times, one token per verified
sequence each time (pass i reads the run's token i at position start + i and samples proposal
i + 1, with the request's own settings and randomness), then writes the proposals over the
placeholders, before the target runs. A position's random draw depends only on the request's
seed and the position (engine/sample.py), so a draft that is the model itself proposes exactly
the model's tokens, sampled ones included. Whatever the draft proposes, verification
(engine/verify.py) keeps the target's own token at each position: the output is the tokens of
decoding one at a time, and the draft sets only how many come per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import kv_spec
from jaxserve.engine.sample import sample
from jaxserve.engine.sampling_state import SamplingState
from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.kv_cache import SCRATCH_PAGE, KVCache


def create_cache(model: ModelConfig, config: EngineConfig, draft: ModelConfig | None) -> KVCache:
  """The engine's cache: the target's groups (kv_spec.create), with the draft's beside them."""
  cache = kv_spec.create(model, config)
  return cache if draft is None else cache.with_draft(kv_spec.create_one_group(draft, config))


def check_draft(config: EngineConfig, target: ModelConfig, draft: ModelConfig | None) -> None:
  """Raises ValueError for a draft model the engine cannot run beside `target`, or for a
  config that asks for one and has none (or the other way round)."""
  spec = config.speculative
  wants = spec is not None and spec.method == "draft"
  if wants != (draft is not None):
    raise ValueError('SpeculativeConfig(method="draft") needs a draft model: Engine(..., '
                     "draft=...); LLM and serve load its draft_model" if wants else
                     'a draft model was given, but the config does not ask for method "draft"')
  if draft is None:
    return
  if draft.vocab_size != target.vocab_size:
    raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the "
                     f"target's ({target.vocab_size}): a draft must share the target's tokenizer")
  if config.tp * config.dp * config.ep > 1:
    raise ValueError("the draft-model method runs on one device: no tp, dp or ep yet")
  if any(draft.local_layers) or kv_spec.num_window_pages(target, config):
    raise ValueError("the draft-model method does not run with window pages or a draft with "
                     "sliding-window layers (speculation is off with window pages)")


def propose(model, cache: KVCache, rows: SamplingState, tokens, starts, live, tables, args,
            stop_ids, attn):
  """The draft's proposals for the step's verified chunks, written over their placeholders.

  model: the draft (merged); rows [Bp, ...] the prefill sequences' sampling settings, starts,
  live [Bp] and tables [Bp, W] theirs; tokens [T] the step's packed tokens; args its StepArgs
  (verify_rows [Bp, k + 1], verify_drafts [Bp, k]: the host's placeholders, -1 past each
  chunk's d). -> (tokens [T] with the proposals in, args with them as verify_drafts, cache)."""
  num_drafts = jnp.sum(args.verify_drafts >= 0, axis=1)  # [Bp]: d of each chunk
  verified = live & (num_drafts > 0)  # [Bp]
  Bp, k = args.verify_drafts.shape
  V = rows.output_counts.shape[1]

  def one_pass(carry, i):
    token, cache, counts = carry  # [Bp], the draft's KV, [Bp, V] the proposals so far
    on = verified & (i < num_drafts)  # [Bp]: sequences with a proposal i + 1 to make
    meta = _one_token_metadata(starts + i, on, tables, cache.page_size, args.block_rows.shape[1])
    logits, cache = model(token[None], cache, meta, attn)  # [Bp, V]
    # As verify.py samples the target's token there: the position after, penalties counting
    # the proposals before it.
    st = dataclasses.replace(rows, output_counts=rows.output_counts + counts)
    new = jnp.where(on, sample(logits, st, starts + i + 1, stop_ids).tokens, -1)  # [Bp]
    counts = counts + jax.nn.one_hot(new, V, dtype=jnp.int32)  # -1: a row of zeros
    return (jnp.where(on, new, token), cache, counts), new

  first = tokens[args.verify_rows[:, 0]]  # [Bp]: each chunk's last known token
  carry = (first, cache, jnp.zeros((Bp, V), jnp.int32))
  (_, cache, _), drafts = jax.lax.scan(one_pass, carry, jnp.arange(k))
  drafts = drafts.T  # [Bp, k]
  at = jnp.where(drafts >= 0, args.verify_rows[:, 1:], tokens.shape[0])  # Past T: dropped.
  tokens = tokens.at[at.reshape(-1)].set(drafts.reshape(-1), mode="drop")
  return tokens, args._replace(verify_drafts=drafts), cache


def follow(model, cache: KVCache, tokens, meta: AttentionMetadata, attn) -> KVCache:
  """The draft's KV of every token of the step (tokens [T], the target's metadata)."""
  _, cache = model(tokens[None], cache, meta, attn, hidden=True)
  return cache


def _one_token_metadata(positions, on, tables, Z: int, Tb: int) -> AttentionMetadata:
  """One query token per sequence at `positions` [B] (decode rows); rows not `on` write to the
  scratch page and read one position."""
  B = positions.shape[0]
  column = jnp.minimum(positions // Z, tables.shape[1] - 1)
  page = jnp.where(on, jnp.take_along_axis(tables, column[:, None], axis=1)[:, 0], SCRATCH_PAGE)
  rows = jnp.arange(B, dtype=jnp.int32)
  return AttentionMetadata(
      positions=jnp.where(on, positions, 0)[None], cache_index=(page * Z + positions % Z)[None],
      page_tables=tables, kv_lens=jnp.where(on, positions + 1, 1),
      cu_q_lens=jnp.arange(B + 1, dtype=jnp.int32), sample_rows=rows,
      block_rows=jnp.zeros((0, Tb), jnp.int32), block_seq=jnp.zeros(0, jnp.int32),
      num_decode_rows=B)

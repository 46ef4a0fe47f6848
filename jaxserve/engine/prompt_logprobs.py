"""Prompt logprobs: how likely each prompt token was given the ones before it (echo, lm-eval).

A prefill-only step whose chunks ask for them keeps the logits of every packed position and
scores each against the prompt's next token (engine/step.py; the variant is compiled at warm-up
for every prefill bucket).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.engine.sample import NUM_TOP_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
  """Per packed position t: how likely the prompt's token at t + 1 was, given the tokens to t."""

  logprobs: jax.Array  # [T] float32: log-probability of targets[t] under the full distribution
  ranks: jax.Array  # [T] int32: 1 + how many tokens were more likely than targets[t]
  top_ids: jax.Array  # [T, min(NUM_TOP_LOGPROBS, V)] int32, most likely first
  top_logprobs: jax.Array  # [T, min(NUM_TOP_LOGPROBS, V)] float32


SCORE_BLOCK = 64  # Positions scored at once: a block's [64, V] logits, not [T, V].


def score_prompt(head, hidden, targets) -> PromptLogprobs:
  """hidden [T, D] (the last layer's output), head: [..., D] -> logits [..., V] float32 (the
  model's `head`), targets [T] int32 (padding rows are scored and ignored). Scored SCORE_BLOCK
  rows at a time when T is a multiple of it (row by row, so the same numbers): a large
  vocabulary's [T, V] logits and log-softmax would otherwise dwarf the step's other temp memory."""
  T = hidden.shape[0]
  if T <= SCORE_BLOCK or T % SCORE_BLOCK:
    return _score(head(hidden), targets)
  blocks = (hidden.reshape(T // SCORE_BLOCK, SCORE_BLOCK, -1), targets.reshape(-1, SCORE_BLOCK))
  scored = jax.lax.map(lambda block: _score(head(block[0]), block[1]), blocks)
  return jax.tree.map(lambda x: x.reshape(T, *x.shape[2:]), scored)


def _score(logits, targets) -> PromptLogprobs:
  logprobs = jax.nn.log_softmax(logits, axis=-1)  # [T, V]
  chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)  # [T, 1]
  ranks = 1 + jnp.sum(logprobs > chosen, axis=-1, dtype=jnp.int32)  # [T]
  # [T, min(NUM_TOP_LOGPROBS, V)] each, most likely first
  top_lp, top_ids = jax.lax.top_k(logprobs, min(NUM_TOP_LOGPROBS, logits.shape[-1]))
  return PromptLogprobs(chosen[:, 0], ranks, top_ids.astype(jnp.int32), top_lp)

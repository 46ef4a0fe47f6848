"""Per-slot sampling state: every request's sampling settings as one row of device arrays.

A request's SamplingParams become a SamplingRow (host numpy values) when it is admitted; rows
are stacked into a SamplingState, whose leaves are [Bs, ...] arrays in the decode state (one row
per decode slot) and [B, ...] as sample() reads them (one per row of a step). Every setting is a
value, never a shape, so no request can trigger a recompile. engine/sample.py reads the state.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingState:
  """One row per decode slot (shape letters: the key in jaxserve/model/__init__.py)."""

  temperature: jax.Array  # [Bs] float32; 0 = greedy
  top_k: jax.Array  # [Bs] int32; 0 = off
  top_p: jax.Array  # [Bs] float32
  min_p: jax.Array  # [Bs] float32
  repetition_penalty: jax.Array  # [Bs] float32
  presence_penalty: jax.Array  # [Bs] float32
  frequency_penalty: jax.Array  # [Bs] float32
  seed: jax.Array  # [Bs, 2] uint32: a 64-bit seed as two words
  ignore_eos: jax.Array  # [Bs] bool
  want_logprobs: jax.Array  # [Bs] bool
  has_bias: jax.Array  # [Bs] bool: logit_bias or allowed_token_ids set (else logit_bias is zeros)
  prompt_mask: jax.Array  # [Bs, V] bool: token ids in the prompt (repetition penalty)
  output_counts: jax.Array  # [Bs, V] int32: times each token was generated (all penalties)
  # [Bs, V] float32: added to the logits (logit_bias; -inf outside allowed_token_ids). Zeros for
  # a request without either, and x + 0.0 == x, so its tokens are those of no bias at all.
  logit_bias: jax.Array

  @classmethod
  def create(cls, num_slots: int, vocab_size: int) -> SamplingState:
    rows = SamplingRow.from_params(SamplingParams(), seed=0, prompt_ids=(), output_ids=(),
                                   vocab_size=vocab_size)
    return jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x)[None], num_slots, axis=0),
                        rows.as_state())

  def plain_where_not(self, samples) -> SamplingState:
    """Rows where samples [B] is False (padding, a prompt chunk that samples nothing) made
    greedy, unfiltered and unpenalized: their tokens are thrown away, and a row left with a
    temperature would send the whole batch down the slow draw."""
    off = ~samples
    plain = lambda x, value: jnp.where(off, jnp.asarray(value, x.dtype), x)
    return dataclasses.replace(
        self, temperature=plain(self.temperature, 0), top_k=plain(self.top_k, 0),
        top_p=plain(self.top_p, 1), min_p=plain(self.min_p, 0),
        repetition_penalty=plain(self.repetition_penalty, 1),
        presence_penalty=plain(self.presence_penalty, 0),
        frequency_penalty=plain(self.frequency_penalty, 0),
        want_logprobs=self.want_logprobs & samples, has_bias=self.has_bias & samples)


@dataclasses.dataclass(frozen=True)
class SamplingRow:
  """One request's sampling settings as host numpy values, ready to become a state row."""

  values: dict

  @classmethod
  def from_params(cls, p: SamplingParams, seed: int, prompt_ids, output_ids,
                  vocab_size: int) -> SamplingRow:
    prompt_mask = np.zeros(vocab_size, bool)
    prompt_mask[np.asarray(prompt_ids, np.int64)] = True
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=vocab_size).astype(np.int32)
    # Every sampler setting becomes a [Bs] array of its type: top_k an int32 (capped at V), the
    # rest float32.
    values = {f: np.float32(getattr(p, f)) for f in SamplingParams.SAMPLER_FIELDS}
    values["top_k"] = np.int32(min(p.top_k, vocab_size))
    return cls(dict(
        values,
        seed=np.array([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF], np.uint32),
        ignore_eos=np.bool_(p.ignore_eos), want_logprobs=np.bool_(p.logprobs > 0),
        has_bias=np.bool_(bool(p.logit_bias) or p.allowed_token_ids is not None),
        prompt_mask=prompt_mask, output_counts=counts[:vocab_size],
        logit_bias=_bias_row(p, vocab_size)))

  def as_state(self) -> SamplingState:
    return SamplingState(**self.values)


def _bias_row(p: SamplingParams, vocab_size: int) -> np.ndarray:
  """[V] float32: p.logit_bias at its ids, -inf outside p.allowed_token_ids (ids past the
  vocabulary are the gateway's to refuse; here they are dropped)."""
  row = np.zeros(vocab_size, np.float32)
  if p.allowed_token_ids is not None:
    row[:] = -np.inf
    allowed = np.asarray(p.allowed_token_ids, np.int64)
    row[allowed[allowed < vocab_size]] = 0.0
  for token, bias in p.logit_bias:
    if token < vocab_size:
      row[token] += np.float32(bias)
  return row

"""On-device sampling: every request's settings are rows of arrays, so none can trigger a recompile.

The constraint mask first (a row's allowed-token bitmask from its grammar, engine/constraint_mask.py;
all ones for an unconstrained row, which leaves its logits exactly as they were), so the reported
logprobs are those of the masked distribution; then penalties and the logit bias, then greedy or temperature sampling with top-k / top-p / min-p
filtering. Filtering and random draws run only when some row asks for them (a `lax.cond`, not a
Python branch).
Randomness comes from (seed, position), so a seeded request samples the same tokens whatever else
shares its batch, and again after a preemption.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import SamplingParams
from jaxserve.engine.constraint_mask import apply_token_bitmask

NUM_TOP_LOGPROBS = SamplingParams.MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingState:
  """One row per decode slot."""

  temperature: jax.Array  # [S] float32; 0 = greedy
  top_k: jax.Array  # [S] int32; 0 = off
  top_p: jax.Array  # [S] float32
  min_p: jax.Array  # [S] float32
  repetition_penalty: jax.Array  # [S] float32
  presence_penalty: jax.Array  # [S] float32
  frequency_penalty: jax.Array  # [S] float32
  seed: jax.Array  # [S, 2] uint32: a 64-bit seed as two words
  ignore_eos: jax.Array  # [S] bool
  want_logprobs: jax.Array  # [S] bool
  prompt_mask: jax.Array  # [S, V] bool: token ids in the prompt (repetition penalty)
  output_counts: jax.Array  # [S, V] int32: times each token was generated (all penalties)
  # [S, V] float32: added to the logits (logit_bias; -inf outside allowed_token_ids). Zeros for
  # a request without either, and x + 0.0 == x, so its tokens are those of no bias at all.
  logit_bias: jax.Array

  @classmethod
  def create(cls, num_slots: int, vocab_size: int) -> SamplingState:
    rows = SamplingRow.from_params(SamplingParams(), seed=0, prompt_ids=(), output_ids=(), vocab_size=vocab_size)
    return jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x)[None], num_slots, axis=0), rows.as_state())

  def row(self, slot) -> SamplingState:
    """The one-row state of `slot`, [1, ...] on every leaf."""
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1), self)

  def set_row(self, slot, row: SamplingState) -> SamplingState:
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), slot, 0), self, row)

  def count(self, tokens, active) -> SamplingState:
    """Adds one generated `tokens` [S] to each active slot's counts."""
    counts = self.output_counts.at[jnp.arange(tokens.shape[0]), tokens].add(active.astype(jnp.int32))
    return dataclasses.replace(self, output_counts=counts)


@dataclasses.dataclass(frozen=True)
class SamplingRow:
  """One request's sampling settings as host numpy values, ready to become a state row."""

  values: dict

  @classmethod
  def from_params(cls, p: SamplingParams, seed: int, prompt_ids, output_ids, vocab_size: int) -> SamplingRow:
    prompt_mask = np.zeros(vocab_size, bool)
    prompt_mask[np.asarray(prompt_ids, np.int64)] = True
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=vocab_size).astype(np.int32)
    # Every sampler setting becomes a [S] array of its type: top_k an int32 (capped at V), the
    # rest float32.
    values = {f: np.float32(getattr(p, f)) for f in SamplingParams.SAMPLER_FIELDS}
    values["top_k"] = np.int32(min(p.top_k, vocab_size))
    return cls(dict(
        values,
        seed=np.array([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF], np.uint32),
        ignore_eos=np.bool_(p.ignore_eos), want_logprobs=np.bool_(p.logprobs > 0),
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampled:
  tokens: jax.Array  # [B] int32
  logprobs: jax.Array  # [B] float32: log-probability of each chosen token under the model
  top_ids: jax.Array  # [B, min(NUM_TOP_LOGPROBS, V)] int32 (zeros unless some row asked)
  top_logprobs: jax.Array  # [B, min(NUM_TOP_LOGPROBS, V)] float32


def sample(logits, st: SamplingState, positions, stop_ids, bitmask=None) -> Sampled:
  """logits [B, V] float32, one state row per b, positions [B], stop_ids [E], bitmask [B, ceil(V/32)]
  int32 (None: no row is constrained) -> Sampled."""
  if bitmask is not None:  # [B, V]; a step with no constrained row skips the pass.
    logits = jax.lax.cond(jnp.any(bitmask != -1), apply_token_bitmask, lambda x, _: x, logits,
                          bitmask)
  raw_logprobs = jax.nn.log_softmax(logits, axis=-1)  # [B, V]
  logits = _penalize(logits, st) + st.logit_bias
  # ignore_eos (for benchmarks): the end-of-sequence ids can never be drawn.
  eos = jnp.zeros(logits.shape[-1], bool).at[stop_ids].set(True)  # [V]
  logits = jnp.where(st.ignore_eos[:, None] & eos[None, :], -jnp.inf, logits)

  greedy = st.temperature == 0  # [B]
  scaled = logits / jnp.where(greedy, 1.0, st.temperature)[:, None]
  needs_filter = (st.top_k > 0) | (st.top_p < 1) | (st.min_p > 0)
  scaled = jax.lax.cond(jnp.any(needs_filter & ~greedy), _filter, lambda x, _: x, scaled, st)
  # Random draws cost as much as a small matmul on CPU: skip them when every row is greedy.
  drawn = jax.lax.cond(jnp.all(greedy), lambda *_: jnp.zeros_like(positions), _draw, scaled, st.seed,
                       positions)
  tokens = jnp.where(greedy, jnp.argmax(logits, -1), drawn).astype(jnp.int32)

  chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
  n = min(NUM_TOP_LOGPROBS, logits.shape[-1])
  top_lp, top_ids = jax.lax.cond(
      jnp.any(st.want_logprobs),
      lambda lp: tuple(jax.lax.top_k(lp, n)),
      lambda lp: (jnp.zeros((lp.shape[0], n), lp.dtype), jnp.zeros((lp.shape[0], n), jnp.int32)),
      raw_logprobs)
  return Sampled(tokens, chosen, top_ids.astype(jnp.int32), top_lp)


def _draw(scaled, seeds, positions):
  """Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits). [B, V] -> [B]."""

  def one(row, seed, position):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), position)
    return jnp.argmax(row + jax.random.gumbel(key, row.shape)).astype(positions.dtype)

  return jax.vmap(one)(scaled, seeds, positions)


def _penalize(logits, st: SamplingState):
  """Repetition penalty (Hugging Face: over prompt and output), presence and frequency (OpenAI)."""
  counts = st.output_counts.astype(jnp.float32)  # [B, V]
  seen = st.prompt_mask | (st.output_counts > 0)
  rep = st.repetition_penalty[:, None]
  logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
  logits = logits - st.presence_penalty[:, None] * (counts > 0) - st.frequency_penalty[:, None] * counts
  return logits


def _filter(logits, st: SamplingState, iters: int = 32):
  """Masks to -inf what top-k, then top-p, then min-p remove. logits [B, V] (temperature-scaled).

  Thresholds are found by bisection rather than a sort: on CPU a 49k-wide sort per row costs
  ~10x more. Tokens tied at a threshold are all kept.
  """
  k = jnp.where(st.top_k > 0, st.top_k, logits.shape[-1])[:, None]  # [B, 1]
  # top-k bisects over the logits' order-preserving uint32 keys, not their values: 32 halvings
  # of [0, 2**32) end on the k-th largest key exactly, whatever the row holds (-inf from
  # ignore_eos or a logit bias, or a range of 1e38 that float halvings would not resolve).
  keys = _order_keys(logits)  # [B, V] uint32
  lo = jnp.zeros_like(keys[:, :1])  # [B, 1]: every key is >= 0, so ok(lo) holds.
  hi = jnp.max(keys, -1, keepdims=True)
  kth = _bisect_int(lambda t: jnp.sum(keys >= t, -1, keepdims=True) >= k, lo, hi, iters)
  in_top_k = keys >= kth  # [B, V]
  probs = jax.nn.softmax(jnp.where(in_top_k, logits, -jnp.inf), axis=-1)  # [B, V]
  top = jnp.max(probs, -1, keepdims=True)
  # top-p: the largest t whose tokens (probability >= t) hold at least p of the mass.
  mass = lambda t: jnp.sum(jnp.where(probs >= t, probs, 0), -1, keepdims=True)
  nucleus = _bisect(lambda t: mass(t) >= st.top_p[:, None], jnp.zeros_like(top), top, iters)
  # in_top_k again: when the kept mass rounds below top_p (1.0 is enough), nucleus ends at 0,
  # which the probability 0 of every token top-k removed would pass.
  keep = in_top_k & (probs >= nucleus) & (probs >= st.min_p[:, None] * top)
  needs_filter = ((st.top_k > 0) | (st.top_p < 1) | (st.min_p > 0))[:, None]
  return jnp.where(needs_filter & ~keep, -jnp.inf, logits)


def _order_keys(x):
  """float32 [...] -> uint32 [...] in the same order (-inf lowest): IEEE bits, with negatives'
  bits flipped and positives' sign bit set."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _bisect_int(ok, lo, hi, iters: int):
  """The largest integer t in [lo, hi] with ok(t), for ok true at lo and monotone decreasing in
  t; exact after `iters` >= log2(hi - lo + 1) halvings. Unsigned: hi - lo never overflows."""

  def halve(_, bounds):
    lo, hi = bounds
    span = hi - lo
    mid = lo + span // 2 + (span & 1)  # The upper middle, so lo = mid always makes progress.
    good = ok(mid) & (span > 0)
    return jnp.where(good, mid, lo), jnp.where(good | (span == 0), hi, mid - 1)

  return jax.lax.fori_loop(0, iters, halve, (lo, hi))[0]


def _bisect(ok, lo, hi, iters: int):
  """The largest t in [lo, hi] with ok(t), for ok true at lo and monotone decreasing in t."""

  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) / 2
    good = ok(mid)
    return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

  return jax.lax.fori_loop(0, iters, halve, (lo, hi))[0]

"""top-k, then top-p, then min-p over the whole vocabulary: the thresholds that engine/sample.py's
candidate path finds among a few hundred tokens, found here for every token of a row, by
bisection (engine/bisection.py), never a sort. `filter_scaled` is the distribution a sampled row
draws from when the candidates are not enough, and the one its processed logprobs report
(config/sampling.py LogprobsMode).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxserve.engine.bisection import bisect, bisect_int, order_keys
from jaxserve.engine.sampling_state import SamplingState


def needs_filter(st: SamplingState):
  """[B]: the rows that top-k, top-p or min-p filter."""
  return (st.top_k > 0) | (st.top_p < 1) | (st.min_p > 0)


def masked_sum(x, mask):
  """x [B, N] summed where mask -> [B, 1]."""
  return jnp.sum(jnp.where(mask, x, 0), -1, keepdims=True)


def nucleus_threshold(probs, top, rest_mass, st: SamplingState, iters: int = 32):
  """top-p's threshold [B, 1]: the largest t whose tokens (probability >= t) hold at least p of
  the mass, over the candidates' probs [B, Vc] plus rest_mass(t) from the other tokens; 0 (keep
  all) at p = 1, and below `top`, the largest probability."""
  mass = lambda t: masked_sum(probs, probs >= t) + rest_mass(t)
  nucleus = bisect(lambda t: mass(t) >= st.top_p[:, None], jnp.zeros_like(top), top, iters)
  return jnp.where(st.top_p[:, None] < 1, nucleus, 0)


def filter_scaled(logits, scaled, idx, rest, st: SamplingState, iters: int = 32):
  """Masks to -inf what top-k, then top-p, then min-p remove. scaled [B, V] (temperature-scaled).

  Thresholds are found by bisection (engine/bisection.py), not a sort. Sums add the candidates
  (sample.py's `_candidates`) and the rest apart, as its `_fast_draw` does."""
  V = scaled.shape[-1]
  off = (st.top_k <= 0)[:, None]
  k = jnp.where(off, V, st.top_k[:, None])  # [B, 1]
  # top-k bisects over the logits' order keys, not their values: exact whatever the row holds.
  keys = order_keys(scaled)  # [B, V] uint32
  lo = jnp.zeros_like(keys[:, :1])  # [B, 1]: every key is >= 0, so ok(lo) holds.
  hi = jnp.max(keys, -1, keepdims=True)
  kth = bisect_int(lambda t: jnp.sum(keys >= t, -1, keepdims=True) >= k, lo, hi, iters)
  in_top_k = off | (keys >= kth)  # [B, V]
  m = jnp.max(scaled, -1, keepdims=True)
  e = jnp.where(in_top_k, jnp.exp(scaled - m), 0)  # [B, V]
  safe = jnp.minimum(idx, V - 1)
  head = (idx < V) & (jnp.take_along_axis(logits, safe, 1) > rest[:, None])  # [B, Vc]
  cand = jnp.take_along_axis(scaled, safe, 1)
  e_head = jnp.where(head & (off | (order_keys(cand) >= kth)), jnp.exp(cand - m), 0)  # [B, Vc]
  tail = logits <= rest[:, None]  # [B, V]: the tokens not in the candidates' head
  z = masked_sum(e_head, True) + masked_sum(e, tail)
  probs = e / z  # [B, V]
  probs_rest = jnp.where(tail, probs, 0)
  top = jnp.max(probs, -1, keepdims=True)
  rest_mass = lambda t: masked_sum(probs_rest, probs_rest >= t)
  nucleus = nucleus_threshold(e_head / z, top, rest_mass, st, iters)
  # in_top_k again: when the kept mass rounds below top_p (1.0 is enough), nucleus ends at 0,
  # which the probability 0 of every token top-k removed would pass.
  keep = in_top_k & (probs >= nucleus) & (probs >= st.min_p[:, None] * top)
  return jnp.where(needs_filter(st)[:, None] & ~keep, -jnp.inf, scaled)

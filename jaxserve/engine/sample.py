"""On-device sampling: every request's settings are rows of arrays, so none can trigger a recompile.

The rows are engine/sampling_state.py's SamplingState; the random noise is engine/gumbel.py's.
The constraint mask first (a row's allowed-token bitmask from its grammar,
engine/constraint_mask.py; all ones for an unconstrained row, which leaves its logits exactly as
they were), so the reported logprobs are those of the masked distribution; then penalties and the
logit bias, then greedy or temperature sampling with top-k / top-p / min-p filtering
(engine/sample_filter.py). Filtering and random draws run only when some row asks for them (a
`lax.cond`, not a Python branch). The logprobs reported are the engine's LogprobsMode's
(config/sampling.py, vLLM's --logprobs-mode): the raw distribution's, or the processed one's that
the token was drawn from, as logprobs or as logits.
Randomness comes from (seed, position), so a seeded request samples the same tokens whatever else
shares its batch, and again after a preemption.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import LogprobsMode, SamplingParams
from jaxserve.engine.bisection import bisect_int, order_keys
from jaxserve.engine.constraint_mask import apply_token_bitmask
from jaxserve.engine.gumbel import GUMBEL_MAX, gumbel_at, gumbel_draw, is_jax_gumbel
from jaxserve.engine.sample_filter import filter_scaled, masked_sum, needs_filter, nucleus_threshold
from jaxserve.engine.sampling_state import SamplingState

NUM_TOP_LOGPROBS = SamplingParams.MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampled:
  tokens: jax.Array  # [B] int32
  # [B] float32: each chosen token's log-probability (or logit) as the LogprobsMode says.
  logprobs: jax.Array
  top_ids: jax.Array  # [B, min(NUM_TOP_LOGPROBS, V)] int32 (zeros unless some row asked)
  top_logprobs: jax.Array  # [B, min(NUM_TOP_LOGPROBS, V)] float32, as `logprobs`


def sample(logits, st: SamplingState, positions, stop_ids, bitmask=None, *,
           logprobs_mode: LogprobsMode = LogprobsMode.RAW_LOGPROBS) -> Sampled:
  """logits [B, V] float32, one state row per b, positions [B], stop_ids [Vs], bitmask
  [B, ceil(V/32)] int32 (each row's allowed tokens; None: no row is constrained) -> Sampled.
  logprobs_mode (static: it picks the code): what the logprobs report.

  Each [B, V] pass costs about a millisecond at B = 64 on CPU, so only what some row uses runs:
  penalties, the logit bias, random draws and logprobs each sit behind a `lax.cond`, greedy rows
  cost a max and an argmax, and sampled rows draw among a few hundred candidates (`_draw`).
  """
  if bitmask is not None:  # [B, V]; a step with no constrained row skips the pass.
    logits = jax.lax.cond(jnp.any(bitmask != -1), apply_token_bitmask, lambda x, _: x, logits,
                          bitmask)
  # One _sample after the cond, not one in each branch (XLA compiles both branches: two samplers
  # took ~1.4x the compile). The price: the plain branch copies [B, V], as the raw logits stay.
  adjusted = jax.lax.cond(jnp.any(_has_penalty(st) | st.has_bias),
                          lambda x: _penalize(x, st) + st.logit_bias, lambda x: x, logits)
  return _sample(adjusted, logits, st, positions, stop_ids, logprobs_mode)


def _sample(logits, raw, st: SamplingState, positions, stop_ids, mode: LogprobsMode) -> Sampled:
  """sample() on the penalized and biased logits [B, V]; raw [B, V] gives the raw logprobs."""
  # ignore_eos (for benchmarks): the end-of-sequence ids can never be drawn. Each consumer bans
  # them on the fly (`_ban`), so that no banned copy of [B, V] is written.
  eos = jnp.zeros(logits.shape[-1], bool).at[stop_ids].set(True)  # [V]
  greedy = st.temperature == 0  # [B]
  drawn = jax.lax.cond(jnp.all(greedy), lambda *_: jnp.zeros_like(positions), _draw,
                       logits, eos, stop_ids, st, positions)
  best = jax.lax.cond(jnp.any(greedy), _argmax, lambda *_: jnp.zeros_like(positions),
                      logits, eos, stop_ids, st.ignore_eos)
  tokens = jnp.where(greedy, best, drawn).astype(jnp.int32)
  n = min(NUM_TOP_LOGPROBS, logits.shape[-1])
  # Logprobs only when some row asks: the runner reads them for those rows alone.
  reported = lambda: _processed(logits, eos, stop_ids, st) if mode.processed else raw
  B = tokens.shape[0]
  chosen, top_lp, top_ids = jax.lax.cond(
      jnp.any(st.want_logprobs), lambda: _logprobs(reported(), tokens, n, mode.logits),
      lambda: (jnp.zeros(B, jnp.float32), jnp.zeros((B, n), jnp.float32),
               jnp.zeros((B, n), jnp.int32)))
  return Sampled(tokens, chosen, top_ids.astype(jnp.int32), top_lp)


def _logprobs(values, tokens, n: int, logits: bool):
  """Of the logits values [B, V]: the chosen token's logprob [B] and the top n [B, n] (the
  values themselves when `logits`)."""
  lp = values if logits else jax.nn.log_softmax(values, axis=-1)  # [B, V]
  top_lp, top_ids = jax.lax.top_k(lp, n)
  return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], top_lp, top_ids


def _processed(logits, eos, stop_ids, st: SamplingState):
  """[B, V]: the logits each row's token is drawn from. The penalized and biased logits, the
  stop ids banned where ignore_eos, divided by the temperature, -inf where top-k, top-p and
  min-p remove a token: `_full_draw`'s, which the candidate path's draw agrees with. A greedy
  row's: temperature 1 and nothing removed (vLLM's, whose greedy rows filter nothing)."""
  greedy = st.temperature == 0  # [B]
  banned = _ban(logits, eos, st.ignore_eos)
  scaled = banned / jnp.where(greedy, 1.0, st.temperature)[:, None]
  idx, rest = _candidates(logits, eos, stop_ids, st.ignore_eos)
  filtered = jax.lax.cond(jnp.any(needs_filter(st) & ~greedy), filter_scaled, lambda *a: a[1],
                          banned, scaled, idx, rest, st)
  return jnp.where(greedy[:, None], banned, filtered)


def _ban(x, eos, ignore_eos):
  """x [B, ...] with -inf at the stop ids (eos [...] bool, the same trailing shape or gathered)
  of the rows that ignore them."""
  return jnp.where(ignore_eos.reshape((-1,) + (1,) * (x.ndim - 1)) & eos, -jnp.inf, x)


def _group_max(x, axis: int, groups, eos_groups, ignore_eos):
  """The max over `axis` of x [B, ...] for every group, the banned stop ids left out: the raw
  max (one pass, no banned copy of [B, V] written), then the groups `groups` [Vs] that hold a
  stop id redone from their few values. eos_groups: eos laid out as x[0]."""
  m = jnp.max(x, axis)  # [B, groups]
  redo = jnp.max(_ban(jnp.take(x, groups, axis=3 - axis),
                      jnp.take(eos_groups, groups, axis=2 - axis), ignore_eos), axis)  # [B, Vs]
  return m.at[:, groups].set(redo, mode="drop")


def _argmax(x, eos, stop_ids, ignore_eos, block: int = 128):
  """jnp.argmax(_ban(x), -1) (the first maximum), blockwise: the first block holding the max,
  then the first max in it. XLA:CPU's variadic argmax reduction over [B, V] runs ~40x slower
  than this max over blocks. (Its fused max drops NaN: NaN logits, a broken model's, get some
  token, not jnp.argmax's first NaN.) [B, V] -> [B] int32."""
  B, V = x.shape
  pad = lambda a, value: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, -V % block)],
                                 constant_values=value)
  blocks = pad(x, -jnp.inf).reshape(B, -1, block)  # [B, V / block, block]
  eos_blocks = pad(eos, False).reshape(-1, block)
  first = jnp.argmax(_group_max(blocks, 2, stop_ids // block, eos_blocks, ignore_eos), -1)  # [B]
  row = jnp.take_along_axis(blocks, first[:, None, None], 1)[:, 0]  # [B, block]
  inside = jnp.argmax(_ban(row, eos_blocks[first], ignore_eos), -1)
  return (first * block + inside).astype(jnp.int32)


def _has_penalty(st: SamplingState):
  return (st.repetition_penalty != 1) | (st.presence_penalty != 0) | (st.frequency_penalty != 0)


def _penalize(logits, st: SamplingState):
  """Repetition penalty (Hugging Face: over prompt and output), presence and frequency (OpenAI)."""
  counts = st.output_counts.astype(jnp.float32)  # [B, V]
  seen = st.prompt_mask | (st.output_counts > 0)
  rep = st.repetition_penalty[:, None]
  logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
  logits = (logits - st.presence_penalty[:, None] * (counts > 0)
            - st.frequency_penalty[:, None] * counts)
  return logits


def _draw(logits, eos, stop_ids, st: SamplingState, positions):
  """Sampled rows' tokens [B] (greedy rows' are ignored): a draw from softmax(logits / T) after
  top-k, then top-p, then min-p (tokens tied at a threshold all kept).

  The candidate path filters and draws among the tokens above `rest` (about NUM_CANDIDATE_GROUPS
  of them, `_candidates`) and says per row whether that is exact: whether every token at or below
  `rest` is filtered out (or could not win the draw), and whether the thresholds found among the
  candidates are those the whole row gives. When a row is not, `_full_draw` does the whole
  vocabulary.
  Both paths sum candidates and the rest apart, so their probabilities agree bit for bit.
  """
  greedy = st.temperature == 0
  temperature = jnp.where(greedy, 1.0, st.temperature)[:, None]  # [B, 1]
  idx, rest = _candidates(logits, eos, stop_ids, st.ignore_eos)  # [B, Vc], [B]
  tokens, fits = _fast_draw(logits, eos, temperature, idx, rest, st, positions)
  # Only the raw logits and [V] enter the branch: a banned or scaled [B, V] would be written out.
  return jax.lax.cond(jnp.all(fits | greedy), lambda *_: tokens, _full_draw,
                      logits, eos, temperature, idx, rest, st, positions)


# Tokens are grouped by id modulo V / _GROUP_SIZE (a strided group's max vectorises); the top
# NUM_CANDIDATE_GROUPS groups' tokens are the candidates, and every other token is at or below
# the smallest of their maxima.
NUM_CANDIDATE_GROUPS = 64
_GROUP_SIZE = 16


def _candidates(logits, eos, stop_ids, ignore_eos):
  """(ids [B, Vc], rest [B]): every token whose (banned, `_ban`) logit is above rest[b] is among
  ids[b]; ids >= V are padding. Small vocabularies are candidates whole (rest = -inf)."""
  B, V = logits.shape
  groups = -(-V // _GROUP_SIZE)
  if groups <= NUM_CANDIDATE_GROUPS:
    return jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (B, V)), jnp.full((B,), -jnp.inf)
  padded = jnp.pad(logits, ((0, 0), (0, groups * _GROUP_SIZE - V)), constant_values=-jnp.inf)
  eos_groups = jnp.pad(eos, (0, groups * _GROUP_SIZE - V)).reshape(_GROUP_SIZE, groups)
  # [B, groups]: group g = g, g + groups, ...
  group_max = _group_max(padded.reshape(B, _GROUP_SIZE, groups), 1, stop_ids % groups,
                         eos_groups, ignore_eos)
  top, ids = jax.lax.top_k(group_max, NUM_CANDIDATE_GROUPS)
  # A reduction, not top[:, -1]: slicing top_k's values makes XLA:CPU sort the whole row instead.
  rest = jnp.min(top, -1)
  # [B, NUM_CANDIDATE_GROUPS, _GROUP_SIZE]: the tokens of each chosen group.
  ids = ids[:, :, None] + groups * jnp.arange(_GROUP_SIZE, dtype=jnp.int32)
  return ids.reshape(B, -1), rest


def _fast_draw(logits, eos, temperature, idx, rest, st: SamplingState, positions):
  """(tokens [B], fits [B]): the draw among the candidates, and whether it is the whole row's.
  Nothing here reads [B, V] but the candidates' gather (and one pass when top-k is off)."""
  V = logits.shape[-1]
  safe = jnp.minimum(idx, V - 1)
  picked = _ban(jnp.take_along_axis(logits, safe, 1), eos[safe], st.ignore_eos)  # [B, Vc]
  head = (idx < V) & (picked > rest[:, None])
  cand = picked / temperature  # The same division as the whole row's scaled logits.
  rest_scaled = rest / temperature[:, 0]
  off = (st.top_k <= 0)[:, None]  # [B, 1]
  filtering = needs_filter(st)[:, None]
  kth, rest_key, in_top_k = _top_k(cand, head, off, rest_scaled, st.top_k, V)
  m = jnp.max(jnp.where(head, cand, -jnp.inf), -1, keepdims=True)  # [B, 1]: the row's max
  e = jnp.where(in_top_k, jnp.exp(cand - m), 0)
  z_rest = _rest_mass(logits, eos, temperature, rest, m,
                      off & filtering & (st.temperature > 0)[:, None], st.ignore_eos)
  probs = e / (masked_sum(e, True) + z_rest)
  top = jnp.max(probs, -1, keepdims=True)
  nucleus = nucleus_threshold(probs, top, lambda t: 0.0, st)
  keep = jnp.where(filtering,
                   in_top_k & (probs >= nucleus) & (probs >= st.min_p[:, None] * top), head)
  # A bound on every other token's probability (1 + 2**-20: exp need not be exactly monotone).
  p_rest = jnp.exp(rest_scaled[:, None] - m) / (masked_sum(e, True) + z_rest) * (1 + 2**-20)
  exact = ~filtering | ((off | (kth > rest_key))
                        & (~off | (st.top_p[:, None] >= 1) | (p_rest < nucleus)))
  rest_out = filtering & (~off | (p_rest < nucleus) | (p_rest < st.min_p[:, None] * top))
  rest_out |= (rest_scaled == -jnp.inf)[:, None]
  tokens, rest_loses = _gumbel_max(cand, keep, idx, safe, rest_scaled, st.seed, positions, V)
  fits = exact & jnp.any(keep, -1, keepdims=True) & (rest_out | rest_loses) & is_jax_gumbel()
  return tokens.astype(positions.dtype), fits[:, 0]


def _top_k(cand, head, off, rest_scaled, top_k, V: int):
  """top-k among the candidates cand [B, Vc] (exact when the k-th largest lies above every other
  token) -> (kth [B, 1] and rest_key [B, 1], order keys; in_top_k [B, Vc])."""
  keys = jnp.where(head, order_keys(cand), 0)
  k = jnp.where(off, V, top_k[:, None])
  kth = bisect_int(lambda t: jnp.sum(keys >= t, -1, keepdims=True) >= k,
                   jnp.zeros_like(keys[:, :1]), jnp.max(keys, -1, keepdims=True), 32)
  rest_key = order_keys(rest_scaled)[:, None]
  return kth, rest_key, head & (off | (keys >= kth))


def _rest_mass(logits, eos, temperature, rest, m, tail_rows, ignore_eos):
  """[B, 1]: the mass exp(x - m) of tail_rows' tokens at or below `rest`. With top-k off the
  rest is in the softmax's sum: one pass over [B, V], only when a row needs it."""
  banned = lambda: _ban(logits, eos, ignore_eos)
  return jax.lax.cond(
      jnp.any(tail_rows),
      lambda: masked_sum(jnp.exp(banned() / temperature - m),
                          (banned() <= rest[:, None]) & tail_rows),
      lambda: jnp.zeros_like(m))


def _gumbel_max(cand, keep, idx, safe, rest_scaled, seed, positions, V: int):
  """The draw among the kept candidates -> (tokens [B], [B, 1]: no other token can win)."""
  perturbed = jnp.where(keep, cand + gumbel_at(seed, positions, safe, V), -jnp.inf)
  best = jnp.max(perturbed, -1, keepdims=True)
  # Others' perturbed logits are at most rest + GUMBEL_MAX: above that, the draw is a candidate.
  rest_loses = best > rest_scaled[:, None] + GUMBEL_MAX
  tokens = jnp.min(jnp.where(keep & (perturbed == best), idx, V), -1)  # argmax's first maximum
  return tokens, rest_loses


def _full_draw(logits, eos, temperature, idx, rest, st: SamplingState, positions):
  logits = _ban(logits, eos, st.ignore_eos)
  scaled = logits / temperature
  greedy = st.temperature == 0
  filtered = jax.lax.cond(jnp.any(needs_filter(st) & ~greedy), filter_scaled, lambda *a: a[1],
                          logits, scaled, idx, rest, st)
  return gumbel_draw(filtered, st.seed, positions)

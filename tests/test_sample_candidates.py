"""The candidate draw (sample.py's fast path) against the whole-vocabulary one: same tokens, same
seeds, wherever it says it fits, over random rows with ties, -inf, top_k past the candidates and
top_p near 1."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import SamplingParams
from jaxserve.engine import gumbel
from jaxserve.engine import sample as sample_lib
from jaxserve.engine.sampling_state import SamplingRow


def _state(params, vocab, seeds):
  rows = [SamplingRow.from_params(p, s, (), (), vocab).as_state() for p, s in zip(params, seeds)]
  return jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *rows)


STOPS = (0, 7, 4000)  # The stop ids: rows with ignore_eos ban them, and some rows peak on 7.


@jax.jit
def _both(logits, st, positions):
  """(candidate tokens, fits, whole-vocabulary tokens) for every row."""
  stop_ids = jnp.asarray(STOPS, jnp.int32)
  eos = jnp.zeros(logits.shape[-1], bool).at[stop_ids].set(True)
  temperature = jnp.where(st.temperature == 0, 1.0, st.temperature)[:, None]
  idx, rest = sample_lib._candidates(logits, eos, stop_ids, st.ignore_eos)
  fast, fits = sample_lib._fast_draw(logits, eos, temperature, idx, rest, st, positions)
  return fast, fits, sample_lib._full_draw(logits, eos, temperature, idx, rest, st, positions)


def _rows(rng, n, vocab):
  """Logits of several kinds: smooth, peaked, integer ties, -inf runs, a row all -inf but one."""
  kinds = []
  for i in range(n):
    kind = i % 5
    x = rng.normal(size=vocab) * (1.0, 4.0, 2.0, 3.0, 1.0)[kind]
    if kind == 2:
      x = np.round(x)  # many ties, at every threshold
    if kind == 3:
      x[rng.random(vocab) < 0.9] = -np.inf
    if kind == 4 and i % 10 == 4:
      x[:] = -np.inf
      x[rng.integers(vocab)] = 0.0
    if i % 7 == 1:
      x[7] = x.max() + 5.0  # A stop id on top: banned where the row ignores EOS.
    kinds.append(x)
  return np.stack(kinds).astype(np.float32)


SETTINGS = [{"top_k": k, "top_p": p, "min_p": m} for k, p, m in itertools.product(
    (0, 1, 7, 50, 60, 300, 5000), (1.0, 0.5, 0.9, 0.999, 0.9999999), (0.0, 0.05))]


@pytest.mark.parametrize("vocab", [4096, 4099])
def test_candidate_draw_equals_the_whole_vocabulary_draw(vocab):
  rng = np.random.default_rng(vocab)
  n = len(SETTINGS) * 2
  params = [SamplingParams(temperature=(0.5, 1.0, 2.0)[i % 3], ignore_eos=i % 4 < 2,
                           **SETTINGS[i % len(SETTINGS)]) for i in range(n)]
  logits = jnp.asarray(_rows(rng, n, vocab))
  fitted = 0
  for seed in range(3):
    st = _state(params, vocab, [seed * 1000 + i for i in range(n)])
    positions = jnp.arange(n, dtype=jnp.int32) + seed
    fast, fits, full = (np.asarray(x) for x in _both(logits, st, positions))
    np.testing.assert_array_equal(fast[fits], full[fits])
    fitted += fits.sum()
    # top_k past the candidates (about 64 here) never fits: the k-th token is not among them.
    big_k = np.array([p.top_k > 1000 for p in params])
    assert not fits[big_k].any()
  assert fitted > n  # Most rows fit: the test compares something.


def test_unfiltered_rows_fit_when_the_rest_cannot_win():
  """No top-k/top-p/min-p: the whole vocabulary is kept, and the candidate draw is exact only when
  the best candidate beats every other token's largest possible Gumbel value."""
  vocab = 4096
  logits = np.random.default_rng(0).normal(size=(8, vocab)).astype(np.float32)
  logits[:4, :3] += 40.0  # Three tokens far above the rest: the draw is theirs.
  st = _state([SamplingParams(temperature=1.0)] * 8, vocab, list(range(8)))
  fast, fits, full = (np.asarray(x) for x in _both(jnp.asarray(logits), st, jnp.arange(8)))
  assert fits[:4].all() and not fits[4:].any()
  np.testing.assert_array_equal(fast[:4], full[:4])


@pytest.mark.parametrize("partitionable", [True, False])
@pytest.mark.parametrize("vocab", [49152, 1001])
def test_gumbel_at_is_jax_random_gumbel_at_those_ids(partitionable, vocab):
  previous = jax.config.jax_threefry_partitionable
  jax.config.update("jax_threefry_partitionable", partitionable)
  try:
    seeds = jnp.asarray([[7, 0], [1, 2**31], [0xFFFFFFFF, 5]], jnp.uint32)
    positions = jnp.asarray([0, 3, 1000], jnp.int32)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, vocab, (3, 300)), jnp.int32)
    noise = lambda s, p: jax.random.gumbel(gumbel.noise_key(s, p), (vocab,))
    whole = jax.jit(jax.vmap(noise))(seeds, positions)
    at = jax.jit(gumbel.gumbel_at, static_argnums=3)(seeds, positions, ids, vocab)
    np.testing.assert_array_equal(np.asarray(at),
                                  np.take_along_axis(np.asarray(whole), np.asarray(ids), 1))
  finally:
    jax.config.update("jax_threefry_partitionable", previous)


def test_gumbel_never_reaches_the_bound():
  """GUMBEL_MAX bounds jax.random.gumbel: its largest uniform is 1 - 2**-23."""
  largest = -np.log(-np.log(np.float32(1 - 2**-23)))
  assert largest < gumbel.GUMBEL_MAX
  draws = jax.random.gumbel(jax.random.key(0), (1 << 20,))
  assert float(jnp.max(draws)) <= largest + 1e-3


@pytest.mark.parametrize("vocab", [49152, 1001])
def test_blockwise_argmax_is_jnp_argmax_of_the_banned_logits(vocab):
  """First maximum on ties, a stop id on top banned only where the row ignores EOS. (Not NaN:
  XLA:CPU's fused max drops it, so a row of NaN logits, a broken model's, gets some token rather
  than the first NaN.)"""
  rng = np.random.default_rng(3)
  x = np.round(rng.normal(size=(6, vocab)) * 2).astype(np.float32)  # many ties
  x[1, 7] = x[2, 7] = 50.0  # the stop id 7 on top
  x[3, 500] = np.inf
  x[4, :] = -np.inf
  ignore = jnp.asarray([False, True, False, True, True, False])
  stop_ids = jnp.asarray([0, 7, vocab - 1], jnp.int32)
  eos = jnp.zeros(vocab, bool).at[stop_ids].set(True)
  got = jax.jit(sample_lib._argmax)(jnp.asarray(x), eos, stop_ids, ignore)
  want = jnp.argmax(jnp.where(ignore[:, None] & eos, -jnp.inf, jnp.asarray(x)), -1)
  np.testing.assert_array_equal(got, want)
  assert int(got[1]) != 7 and int(got[2]) == 7


def test_gumbel_draw_is_the_first_argmax_of_the_perturbed_row():
  """The whole-vocabulary draw (a max and a min, not XLA's argmax) picks jnp.argmax's token:
  ties at the top, rows all -inf but one token, a row all -inf."""
  vocab = 1001
  rng = np.random.default_rng(4)
  x = np.round(rng.normal(size=(6, vocab)) * 2).astype(np.float32)
  x[1, :] = -np.inf
  x[1, 17] = 3.0
  x[2, :] = -np.inf
  x[3, 5] = x[3, 900] = np.inf  # two tokens tied at +inf: the first wins
  seeds = jnp.asarray(rng.integers(0, 2**32, (6, 2)), jnp.uint32)
  positions = jnp.arange(6, dtype=jnp.int32)
  got = jax.jit(gumbel.gumbel_draw)(jnp.asarray(x), seeds, positions)
  noise = jax.vmap(lambda s, p: jax.random.gumbel(gumbel.noise_key(s, p), (vocab,)))(seeds,
                                                                                     positions)
  want = jnp.argmax(jnp.asarray(x) + noise, -1)
  np.testing.assert_array_equal(got, want)
  assert int(got[1]) == 17 and int(got[2]) == 0 and int(got[3]) == 5

"""On-device sampling, checked against numbers worked out by hand on tiny vocabularies."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from jaxserve.config import LogprobsMode, SamplingParams
from jaxserve.engine.sample import sample as _sample
from jaxserve.engine.sampling_state import SamplingRow

STOP = jnp.array([0], jnp.int32)
sample = jax.jit(_sample)


def state(params_list, vocab, prompts=None, outputs=None, seeds=None):
  n = len(params_list)
  seeds, prompts, outputs = seeds or [7] * n, prompts or [()] * n, outputs or [()] * n
  rows = [SamplingRow.from_params(p, seeds[i], prompts[i], outputs[i], vocab).as_state()
          for i, p in enumerate(params_list)]
  return jax.tree.map(lambda *xs: np.stack(xs), *rows)


def draw(logits, params, n=1, **kw):
  """Samples `n` times (positions 0..n-1) from the same logits; returns [n] tokens."""
  logits = jnp.asarray(logits, jnp.float32)[None].repeat(n, 0)
  st = state([params] * n, logits.shape[-1], **{k: v * n for k, v in kw.items()})
  return np.asarray(sample(logits, st, jnp.arange(n), STOP).tokens)


def test_greedy_is_argmax():
  assert draw([0.1, 2.0, 1.0, -1.0], SamplingParams(temperature=0))[0] == 1


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
  # Token 1: 2.0 / 4 = 0.5 < token 2's 1.0, so greedy now picks 2.
  assert draw([0.0, 2.0, 1.0, -1.0], SamplingParams(temperature=0, repetition_penalty=4.0),
              prompts=[(1,)])[0] == 2
  # Token 3 seen: -1.0 * 4 = -4; token 0 (unseen) 0.0 wins over -4 among tokens {0, 3}.
  assert draw([0.0, -9, -9, -1.0], SamplingParams(temperature=0, repetition_penalty=4.0),
              prompts=[(3,)])[0] == 0


def test_presence_and_frequency_penalties_count_output_tokens():
  # Token 1 generated 3 times: 2.0 - 0.5 (presence) - 3 * 0.25 (frequency) = 0.75 < 1.0.
  p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
  assert draw([0.0, 2.0, 1.0, 0.0], p, outputs=[(1, 1, 1)])[0] == 2
  # Generated twice: 2.0 - 0.5 - 0.5 = 1.0, not below token 2's 1.0... argmax takes the first.
  assert draw([0.0, 2.0, 1.0, 0.0], p, outputs=[(1, 1)])[0] == 1


def test_top_k_top_p_min_p_keep_exactly_the_expected_tokens():
  # probs: softmax(log [0.5, 0.25, 0.15, 0.1]) = [0.5, 0.25, 0.15, 0.1].
  logits = np.log([0.5, 0.25, 0.15, 0.1])
  seen = lambda p: set(draw(logits, p, n=400).tolist())
  assert seen(SamplingParams(top_k=2)) == {0, 1}
  # Mass before token 1 is 0.5 < 0.7; before 2, 0.75.
  assert seen(SamplingParams(top_p=0.7)) == {0, 1}
  assert seen(SamplingParams(top_p=0.8)) == {0, 1, 2}
  assert seen(SamplingParams(min_p=0.35)) == {0, 1}  # 0.15 < 0.35 * 0.5 = 0.175 < 0.25.
  assert seen(SamplingParams(top_k=3, top_p=0.6)) == {0, 1}  # top-p over the renormalised top 3.
  assert seen(SamplingParams()) == {0, 1, 2, 3}


def test_top_k_keeps_exactly_k_tokens_in_rows_with_inf_or_a_huge_range():
  """The k-th logit is found exactly whatever the row's range: ignore_eos's -inf, and a range of
  1e38 (float halvings of it stop 1e28 wide and kept every token)."""
  logits = [5.0, 1.0, 0.9, 0.8, 0.7]  # Token 0 is the stop id here.
  seen = lambda row, p: set(draw(row, p, n=400).tolist())
  assert seen(logits, SamplingParams(top_k=1, ignore_eos=True)) == {1}
  assert seen(logits, SamplingParams(top_k=2, ignore_eos=True)) == {1, 2}
  assert seen([-np.inf, -1e38, 0.0, 1.0, 1.5], SamplingParams(top_k=2)) == {3, 4}
  assert seen([-1e38, 0.0, 1.0, 1.5], SamplingParams(top_k=2)) == {2, 3}
  assert seen([-3e38, 3e38, 3e38, -np.inf], SamplingParams(top_k=1)) <= {1, 2}  # A tie: both kept.


def test_temperature_sampling_follows_the_softmax():
  probs = np.array([0.5, 0.25, 0.15, 0.1])
  n = 4000
  for t in (1.0, 0.5):
    tokens = draw(np.log(probs), SamplingParams(temperature=t), n=n)
    expected = probs ** (1 / t) / np.sum(probs ** (1 / t))
    freq = np.bincount(tokens, minlength=4) / n
    # Binomial standard error at n=4000 is below 0.008; 4 sigma.
    np.testing.assert_allclose(freq, expected, atol=0.032)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 50)), jnp.float32)
  p = SamplingParams(temperature=1.0)
  alone = sample(logits[1:2], state([p], 50, seeds=[42]), jnp.array([5]), STOP).tokens
  batched = sample(logits, state([p] * 3, 50, seeds=[1, 42, 3]), jnp.array([9, 5, 2]), STOP).tokens
  assert int(alone[0]) == int(batched[1])
  others = [int(sample(logits[1:2], state([p], 50, seeds=[s]), jnp.array([5]), STOP).tokens[0])
            for s in range(20)]
  assert len(set(others)) > 1  # The seed matters.


def test_ignore_eos_never_draws_a_stop_id():
  logits = [5.0, 1.0, 0.0]  # Token 0 (the stop id here) dominates.
  assert set(draw(logits, SamplingParams(ignore_eos=True), n=200).tolist()) <= {1, 2}
  assert draw(logits, SamplingParams(temperature=0, ignore_eos=True))[0] == 1


def test_logprobs_are_those_of_the_raw_model_distribution():
  logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))
  st = state([SamplingParams(temperature=0, logprobs=2, repetition_penalty=3.0)], 4, prompts=[(0,)])
  out = sample(logits, st, jnp.array([0]), STOP)
  # Penalty moves greedy to token 1 (0.5 -> log(0.5)*3 is more negative than log(0.25)).
  assert int(out.tokens[0]) == 1
  np.testing.assert_allclose(out.logprobs[0], np.log(0.25), rtol=1e-5)
  np.testing.assert_array_equal(out.top_ids[0, :2], [0, 1])
  np.testing.assert_allclose(out.top_logprobs[0, :2], np.log([0.5, 0.25]), rtol=1e-5)


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", float("nan")),
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
                                         ("min_p", 2.0), ("max_tokens", 0), ("stop", "x")])
def test_bad_sampling_params_name_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    SamplingParams(**{field: value})


def test_logit_bias_moves_greedy_and_bans_and_allowed_token_ids_limit_the_draw():
  logits = [0.0, 2.0, 1.0, 0.5]
  assert draw(logits, SamplingParams(temperature=0, logit_bias={2: 1.5}))[0] == 2  # 2.5 > 2.0
  assert draw(logits, SamplingParams(temperature=0, logit_bias={"1": -100}))[0] == 2
  banned = SamplingParams(logit_bias={1: -100, 2: -100})
  assert set(draw(logits, banned, n=300).tolist()) == {0, 3}
  assert set(draw(logits, SamplingParams(allowed_token_ids=[0, 3]), n=300).tolist()) == {0, 3}
  both = SamplingParams(temperature=0, allowed_token_ids=[0, 3], logit_bias={0: 1.0})
  assert draw(logits, both)[0] == 0  # 0 + 1.0 > 0.5, and 1 and 2 are not allowed.


def test_a_zero_bias_row_samples_the_tokens_of_no_bias():
  """x + 0.0 == x: a request without a bias (its row all zeros) draws what it drew before there
  was a bias. A bias of exactly 0 on some ids is such a row too."""
  logits = jnp.asarray(np.random.default_rng(1).normal(size=(8, 50)) * 4, jnp.float32)
  for p in (SamplingParams(temperature=0.8, top_k=10, top_p=0.9), SamplingParams(temperature=0)):
    plain = sample(logits, state([p] * 8, 50), jnp.arange(8), STOP)
    zero = sample(logits, state([dataclasses.replace(p, logit_bias={3: 0.0, 7: 0.0})] * 8, 50),
                  jnp.arange(8), STOP)
    np.testing.assert_array_equal(plain.tokens, zero.tokens)


@pytest.mark.parametrize("fields,named", [
    ({"logit_bias": {i: 1 for i in range(301)}}, "at most 300 token ids"),
    ({"logit_bias": {5: 101}}, "logit_bias[5] must be a number in [-100, 100]"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias[5]"),
    ({"logit_bias": {"five": 1}}, "keys must be token ids"),
    ({"logit_bias": {-1: 1}}, "keys must be token ids"),
    ({"logit_bias": [1, 2]}, "must be an object"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [1, "a"]}, "allowed_token_ids[1]"),
    ({"seed": 2**63}, "signed 64-bit"),
])
def test_bad_bias_and_seed_name_the_field(fields, named):
  with pytest.raises(ValueError) as e:
    SamplingParams(**fields)
  assert named in str(e.value)


def test_vllm_top_k_minus_one_is_off_and_any_signed_64_bit_seed_is_taken():
  assert SamplingParams(top_k=-1).top_k == 0
  for seed in (-1, -2**63, 2**63 - 1):
    assert SamplingParams(seed=seed).seed == seed
  logits = jnp.asarray(np.random.default_rng(2).normal(size=(1, 50)), jnp.float32)
  p = SamplingParams()
  draws = {int(sample(logits, state([p], 50, seeds=[s]), jnp.array([3]), STOP).tokens[0])
           for s in range(-20, 0)}
  assert len(draws) > 1  # Negative seeds are distinct streams.


def test_a_bitmask_restricts_the_draw_and_its_logprobs_are_of_the_masked_distribution():
  """Row 0 may sample tokens 2 and 33 only (bits 2 of word 0 and 1 of word 1); row 1's mask is
  all ones, so it samples what it would with no mask. Logprobs: softmax over 2 and 33 alone."""
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 40)), jnp.float32)
  params = [SamplingParams(temperature=1.0, seed=3, logprobs=2), SamplingParams(temperature=0)]
  st = state(params, 40)
  mask = jnp.array([[1 << 2, 1 << 1], [-1, -1]], jnp.int32)
  plain = sample(logits, st, jnp.array([4, 4]), STOP)
  masked = sample(logits, st, jnp.array([4, 4]), STOP, mask)
  assert int(masked.tokens[0]) in (2, 33) and int(masked.tokens[1]) == int(plain.tokens[1])
  pair = np.asarray(logits[0])[[2, 33]]
  want = pair - np.logaddexp.reduce(pair)
  got = dict(zip(np.asarray(masked.top_ids[0, :2]).tolist(),
                 np.asarray(masked.top_logprobs[0, :2])))
  np.testing.assert_allclose([got[2], got[33]], want, rtol=1e-5)
  np.testing.assert_allclose(float(masked.logprobs[1]), float(plain.logprobs[1]), rtol=1e-6)


def test_rows_that_sample_nothing_are_made_plain_greedy():
  """A padding row or a prompt chunk mid-way (samples False) must not send the batch down the
  draw, filter or penalty paths: its settings become greedy and plain; sampling rows keep theirs."""
  rows = [SamplingRow.from_params(p, 3, (1, 2), (2,), 8).as_state() for p in (
      SamplingParams(temperature=0.7, top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.3,
                     presence_penalty=0.4, frequency_penalty=0.2, logprobs=2, logit_bias={1: 2.0}),
      SamplingParams(temperature=0.9, top_p=0.8))]
  st = jax.tree.map(lambda *x: jnp.stack([jnp.asarray(v) for v in x]), *rows)
  plain = st.plain_where_not(jnp.array([False, True]))
  assert float(plain.temperature[0]) == 0 and int(plain.top_k[0]) == 0
  assert (float(plain.top_p[0]), float(plain.min_p[0])) == (1.0, 0.0)
  assert (float(plain.repetition_penalty[0]), float(plain.presence_penalty[0]),
          float(plain.frequency_penalty[0])) == (1.0, 0.0, 0.0)
  assert not bool(plain.want_logprobs[0]) and not bool(plain.has_bias[0])
  for name in ("temperature", "top_p"):  # The sampling row keeps its settings.
    assert float(getattr(plain, name)[1]) == float(getattr(st, name)[1])


def _count_primitive(jaxpr, name: str) -> int:
  """Equations of primitive `name` in `jaxpr` and every jaxpr nested in it (cond branches too)."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == name
    for sub in jax_core.jaxprs_in_params(eqn.params):
      n += _count_primitive(sub, name)
  return n


def test_the_sampler_is_traced_once_whatever_the_penalties():
  """The penalty / logit-bias branch feeds one sampler: XLA compiles every branch of a cond, so a
  sampler in each branch doubled the sampler's compile (issue 23)."""
  from jaxserve.engine import sample as sample_module
  st = state([SamplingParams(temperature=0.7, top_p=0.9)], 300)
  args = (jnp.zeros((1, 300), jnp.float32), st, jnp.arange(1), STOP)
  whole = jax.make_jaxpr(_sample)(*args).jaxpr
  raw = LogprobsMode.RAW_LOGPROBS
  alone = jax.make_jaxpr(lambda x, s, p, e: sample_module._sample(x, x, s, p, e, raw))(*args).jaxpr
  # threefry hashes the draws' noise: the fast path's candidates and the whole-row fallback.
  assert _count_primitive(alone, "threefry2x32") > 0
  assert _count_primitive(whole, "threefry2x32") == _count_primitive(alone, "threefry2x32")

"""Prompt logprobs (SamplingParams.prompt_logprobs): the prefill variant that scores every prompt
position, against a dense forward of the same tiny model; chunked equals unchunked, a prefix-cache
hit does not drop positions, no request compiles after warm-up."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.batching.runner import Runner
from jaxserve.config import SamplingParams, SchedulerConfig
from jaxserve.engine import prompt_logprobs
from jaxserve.engine.engine import Engine
from support.mock_engine import MockTokenizer
from support.tiny import TINY_ENGINE, count_compiles, dense_logits

PROMPT = [int(x) for x in np.random.default_rng(0).integers(1, 127, 50)]  # 50 > bucket 32: chunked.


@pytest.fixture(scope="module")
def engine(tiny_model):
  engine = Engine(tiny_model, TINY_ENGINE)
  engine.warmup()
  return engine


def reference(model, ids):
  """[len(ids)] logprob of each prompt token given those before it (nan for the first), and the
  [len(ids), V] log-softmax rows that scored them."""
  logprobs = np.asarray(jax.nn.log_softmax(dense_logits(model, ids), axis=-1))  # [n, V]
  chosen = np.full(len(ids), np.nan)
  chosen[1:] = logprobs[np.arange(len(ids) - 1), ids[1:]]
  return chosen, logprobs


def run(engine, prompts, sampling, **config):
  runner = Runner(engine, MockTokenizer(eos_id=127), SchedulerConfig(**config))
  return runner, runner.generate([(p, sampling) for p in prompts])


def check(out, model, ids, num_top):
  chosen, rows = reference(model, ids)
  got = out.prompt_logprobs
  assert len(got) == len(ids) and got[0] is None
  # The tiny random model's logprobs reach -60: float32 rounding of the two forwards differs.
  np.testing.assert_allclose([lp.logprob for lp in got[1:]], chosen[1:], rtol=1e-6, atol=1e-4)
  for pos, lp in enumerate(got[1:], start=1):
    row = rows[pos - 1]
    assert abs(np.sort(row)[::-1][lp.rank - 1] - row[ids[pos]]) < 1e-4  # The rank-th likeliest.
    assert len(lp.top_ids) == num_top
    np.testing.assert_allclose(lp.top_logprobs, np.sort(row)[::-1][:num_top], rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(row[list(lp.top_ids)], lp.top_logprobs, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("budget", [256, 8])  # One prefill step per bucket, or chunks of 8.
def test_prompt_logprobs_match_a_dense_forward(engine, tiny_model, budget):
  params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4)
  _, (out, short) = run(engine, [PROMPT, PROMPT[:5]], params, max_num_batched_tokens=budget)
  check(out, tiny_model, PROMPT, 4)
  check(short, tiny_model, PROMPT[:5], 4)


def test_chunked_equals_unchunked(engine):
  params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
  (_, (whole,)), (_, (chunked,)) = (run(engine, [PROMPT], params, max_num_batched_tokens=b)
                                    for b in (256, 5))
  assert whole.token_ids == chunked.token_ids
  np.testing.assert_allclose([lp.logprob for lp in whole.prompt_logprobs[1:]],
                             [lp.logprob for lp in chunked.prompt_logprobs[1:]], rtol=1e-6,
                             atol=1e-4)
  assert ([lp.top_ids for lp in whole.prompt_logprobs[1:]]
          == [lp.top_ids for lp in chunked.prompt_logprobs[1:]])


def test_a_prefix_cache_hit_does_not_drop_positions(engine, tiny_model):
  """The prompt's pages are cached by a first request; one asking for prompt logprobs skips the
  cache and scores every position, and a plain one after it still hits."""
  runner = Runner(engine, MockTokenizer(eos_id=127))
  plain = SamplingParams(temperature=0, max_tokens=2)
  (first,) = runner.generate([(PROMPT, plain)])
  (scored,) = runner.generate([(PROMPT, dataclasses.replace(plain, prompt_logprobs=1))])
  (again,) = runner.generate([(PROMPT, plain)])
  assert first.prompt_logprobs is None and first.num_cached_tokens == 0
  assert scored.num_cached_tokens == 0
  check(scored, tiny_model, PROMPT, 1)
  assert again.num_cached_tokens > 0
  assert first.token_ids == scored.token_ids == again.token_ids


def test_asking_for_prompt_logprobs_compiles_nothing(engine):
  rng = np.random.default_rng(1)
  prompts = [[int(x) for x in rng.integers(1, 127, n)] for n in (1, 2, 17, 33, 60)]
  params = [SamplingParams(temperature=t, max_tokens=2, prompt_logprobs=k, logprobs=k or 0)
            for t, k in ((0, 0), (1.0, 3), (0, 20), (0.5, None), (0, 1))]
  runner = Runner(engine, MockTokenizer(eos_id=127), SchedulerConfig(max_num_batched_tokens=24))
  with count_compiles() as counts:
    outs = runner.generate(list(zip(prompts, params)))
  assert counts == {"trace": 0, "compile": 0}
  assert [o.prompt_logprobs is None for o in outs] == [False, False, False, True, False]
  assert [len(o.prompt_logprobs or ()) for o in outs] == [1, 2, 17, 0, 60]


def test_scoring_in_blocks_gives_the_whole_arrays_numbers():
  """A long bucket is scored SCORE_BLOCK rows at a time (the head and log-softmax of [64, D],
  not [T, D]): the same values as scoring every row at once, in the same row order."""
  rng = np.random.default_rng(0)
  T = 3 * prompt_logprobs.SCORE_BLOCK
  hidden = jax.numpy.asarray(rng.normal(0, 1, (T, 16)), jax.numpy.float32)
  weights = jax.numpy.asarray(rng.normal(0, 2, (16, 500)), jax.numpy.float32)
  head = lambda x: x @ weights
  targets = jax.numpy.asarray(rng.integers(0, 500, T), jax.numpy.int32)
  blocked = prompt_logprobs.score_prompt(head, hidden, targets)
  whole = prompt_logprobs._score(head(hidden), targets)
  for a, b in zip(jax.tree.leaves(blocked), jax.tree.leaves(whole)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(blocked.ranks), np.asarray(whole.ranks))
  assert np.asarray(blocked.ranks).max() > 1  # Not all trivially first.

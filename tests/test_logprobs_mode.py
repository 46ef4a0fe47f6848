"""Logprobs a trainer can trust (issue 49; vLLM's --logprobs-mode): for sampled rollouts of a tiny
random Llama, the engine's reported values of each sampled token and of its top alternatives
equal the trainer's own forward pass over prompt + completion (support.tiny.dense_logits: the
same NNX model, one full forward on a fresh cache), put through a top-k / top-p mask written here
with a sort (the engine finds its thresholds by bisection), within 1e-4."""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.batching.runner import Runner
from jaxserve.cli import main as cli
from jaxserve.config import (
  EngineConfig,
  LogprobsMode,
  SamplingParams,
  SchedulerConfig,
  SpeculativeConfig,
)
from jaxserve.engine.engine import Engine
from jaxserve.llm import LLM
from jaxserve.model.llama import Transformer
from support.mock_engine import MockTokenizer
from support.tiny import TINY, TINY_ENGINE, count_compiles, dense_logits

PROMPTS = [[3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67], [2, 4, 6, 8]]
TOP_P = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, logprobs=5, seed=1)
# Five alternatives of top-k's four: the fifth is a removed token's, -inf (vLLM's).
TOP_K = SamplingParams(temperature=0.7, top_k=4, max_tokens=10, logprobs=5, seed=2)
# Penalties and a logit bias come before the temperature and the filters.
PENALIZED = SamplingParams(temperature=0.9, top_p=0.95, presence_penalty=0.5,
                           frequency_penalty=0.3, logit_bias={5: 2.0, 9: -1.5}, max_tokens=10,
                           logprobs=5, seed=3)
TOL = 1e-4
# Two slots and one prefill bucket: the fewest programs that still mix prefill and decode rows.
ENGINE = dataclasses.replace(TINY_ENGINE, num_slots=2, prefill_buckets=(32,))


@pytest.fixture(scope="module")
def model():
  """The tiny random Llama with its final norm's scale 1 -> 0.12: its logits' spread drops from
  ~9 (nearly every token's probability 1, the raw and processed logprobs both 0) to ~1, so the
  filters remove tokens and the processed values differ from the raw ones."""
  m = Transformer(TINY, rngs=nnx.Rngs(0))
  m.final_norm[...] = jnp.full_like(m.final_norm[...], 0.12)
  return m


@pytest.fixture(scope="module")
def runners(model):
  """One runner per mode, made when a test first asks (the engines share the model's weights)."""
  made = {}

  def runner(mode: LogprobsMode) -> Runner:
    if mode not in made:
      engine = Engine(model, dataclasses.replace(ENGINE, logprobs_mode=mode))
      made[mode] = Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=32))
    return made[mode]
  return runner


def trainer_values(model, prompt, completion, p: SamplingParams, mode: LogprobsMode):
  """[n, V]: what `mode` reports before each of the n completion tokens, from the trainer's
  forward: the logits at the positions that predict them, and for the processed modes penalized
  and biased, divided by the temperature and -inf outside the top-k, then top-p, tokens."""
  logits = dense_logits(model, list(prompt) + list(completion))[len(prompt) - 1:-1]  # [n, V]
  if mode.processed:
    logits = logits + penalties(completion, p, logits.shape[-1])
    scaled = logits / p.temperature
    logits = jnp.where(kept(np.asarray(scaled), p.top_k, p.top_p), scaled, -jnp.inf)
  return logits if mode.logits else jax.nn.log_softmax(logits, axis=-1)


def penalties(completion, p: SamplingParams, V: int):
  """[n, V]: OpenAI's presence and frequency penalties before each completion token (over the
  tokens generated before it), plus the logit bias."""
  before = np.cumsum(np.eye(V)[list(completion)], 0) - np.eye(V)[list(completion)]  # [n, V]
  bias = np.zeros(V)
  for token, value in p.logit_bias:
    bias[token] = value
  return bias - p.presence_penalty * (before > 0) - p.frequency_penalty * before


def kept(scaled, top_k: int, top_p: float):
  """[n, V] bool: the k largest of each row, then the fewest most likely of those whose
  probability (renormalized over them) reaches top_p."""
  order = np.argsort(-scaled, axis=-1, kind="stable")
  ranked = np.take_along_axis(scaled, order, -1).astype(np.float64)
  keep = np.ones(ranked.shape, bool)
  if top_k:
    keep[:, top_k:] = False
  probs = np.where(keep, np.exp(ranked - ranked[:, :1]), 0)
  probs /= probs.sum(-1, keepdims=True)
  if top_p < 1:
    keep &= np.cumsum(probs, -1) - probs < top_p  # The mass of the more likely tokens.
  out = np.empty_like(keep)
  np.put_along_axis(out, order, keep, -1)
  return out


def assert_equals_trainer(model, completion, prompt, p: SamplingParams, mode: LogprobsMode):
  want = np.asarray(trainer_values(model, prompt, completion.token_ids, p, mode))  # [n, V]
  assert len(completion.logprobs) == len(completion.token_ids) == p.max_tokens
  for i, (token, lp) in enumerate(zip(completion.token_ids, completion.logprobs)):
    assert np.isfinite(want[i, token])  # The sampled token is one the filters keep.
    np.testing.assert_allclose(lp.logprob, want[i, token], atol=TOL)
    np.testing.assert_allclose(lp.top_logprobs, want[i, list(lp.top_ids)], atol=TOL)
    np.testing.assert_allclose(lp.top_logprobs, np.sort(want[i])[::-1][:p.logprobs], atol=TOL)


@pytest.mark.parametrize("p", [TOP_P, TOP_K, PENALIZED],
                         ids=["t1-top_p0.9", "t0.7-top_k4", "penalized"])
def test_processed_logprobs_equal_the_trainers_forward(runners, model, p):
  runner = runners(LogprobsMode.PROCESSED_LOGPROBS)
  outs = runner.generate([(prompt, p) for prompt in PROMPTS])
  for prompt, out in zip(PROMPTS, outs):
    assert_equals_trainer(model, out, prompt, p, LogprobsMode.PROCESSED_LOGPROBS)
    # Not the raw values: the filters and the temperature moved the reported logprobs.
    raw = trainer_values(model, prompt, out.token_ids, p, LogprobsMode.RAW_LOGPROBS)
    assert np.max(np.abs(np.asarray([lp.logprob for lp in out.logprobs])
                         - np.asarray(raw)[np.arange(p.max_tokens), out.token_ids])) > 0.05


# raw_logprobs, the default, is test_model.py's engine-against-dense-forward check.
def test_top_logprobs_of_a_vocabulary_smaller_than_twenty():
  """A 16-token vocabulary: the step packs 16 top entries, not SamplingParams.MAX_LOGPROBS' 20,
  and the host reads them as packed, after a plain decode step and after a verifying one
  (n-gram proposals on prompts that repeat): each token's top k ids are the trainer's forward's
  top k, in order, and their logprobs its log_softmax, for k = 5 and k = V."""
  m = Transformer(dataclasses.replace(TINY, vocab_size=16), rngs=nnx.Rngs(0))
  m.final_norm[...] = jnp.full_like(m.final_norm[...], 0.12)  # As `model`'s: a spread of ~1.
  spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1,
                           disable_by_batch_size=None)
  runner = Runner(Engine(m, dataclasses.replace(ENGINE, speculative=spec)), MockTokenizer(),
                  SchedulerConfig(max_num_batched_tokens=32))
  jobs = [([3, 5, 7, 3, 5, 7, 3, 5], SamplingParams(temperature=0, max_tokens=8, logprobs=5)),
          ([2, 4, 2, 4, 2, 4], SamplingParams(temperature=0, max_tokens=8, logprobs=16))]
  outs = runner.generate(jobs)
  assert runner.scheduler.spec_stats.num_drafts > 0  # Some tokens came from verified runs.
  for (prompt, p), out in zip(jobs, outs):
    assert_equals_trainer(m, out, prompt, p, LogprobsMode.RAW_LOGPROBS)
    want = trainer_values(m, prompt, out.token_ids, p, LogprobsMode.RAW_LOGPROBS)
    ids = np.asarray(jax.lax.top_k(want, p.logprobs)[1])  # [n, k]
    assert [list(lp.top_ids) for lp in out.logprobs] == ids.tolist()


@pytest.mark.parametrize("mode", [LogprobsMode.RAW_LOGITS, LogprobsMode.PROCESSED_LOGITS])
def test_the_logits_modes_equal_the_trainers_forward(runners, model, mode):
  outs = runners(mode).generate([(prompt, TOP_K) for prompt in PROMPTS])
  for prompt, out in zip(PROMPTS, outs):
    assert_equals_trainer(model, out, prompt, TOP_K, mode)
    assert all((lp.top_logprobs[-1] == -np.inf) == mode.processed for lp in out.logprobs)


def test_mixed_sampling_params_compile_nothing_after_warmup(runners, model):
  runner = runners(LogprobsMode.PROCESSED_LOGPROBS)
  runner.engine.warmup()
  mixed = [TOP_P, TOP_K, SamplingParams(temperature=0, max_tokens=6, logprobs=3),
           SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.2, max_tokens=6,
                          logprobs=2, seed=3),
           SamplingParams(temperature=1.0, max_tokens=6, seed=4)]
  with count_compiles() as counts:
    outs = runner.generate([(PROMPTS[i % 2], p) for i, p in enumerate(mixed)])
  assert counts == {"trace": 0, "compile": 0}
  # The greedy row's processed logprobs are those of temperature 1, nothing filtered (vLLM's).
  assert_equals_trainer(model, outs[2], PROMPTS[0], dataclasses.replace(
      mixed[2], temperature=1.0), LogprobsMode.PROCESSED_LOGPROBS)
  assert outs[4].logprobs is None


def test_a_bad_mode_is_refused_by_name():
  with pytest.raises(ValueError, match="logprobs_mode must be one of .*got 'processed'"):
    EngineConfig(logprobs_mode="processed")
  with pytest.raises(ValueError, match="'raw'"):  # Before any model loads.
    LLM("no-such-model", logprobs_mode="raw")
  assert EngineConfig().logprobs_mode is LogprobsMode.RAW_LOGPROBS  # vLLM's default.
  args = cli.build_parser().parse_args(["serve", "--logprobs-mode", "processed_logprobs"])
  assert cli.engine_config(args).logprobs_mode is LogprobsMode.PROCESSED_LOGPROBS
  with pytest.raises(SystemExit):
    cli.build_parser().parse_args(["serve", "--logprobs-mode", "processed"])


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_removed_tokens_inf_leaves_as_vllms_floor_in_json(kind):
  from jaxserve.api.openai_completion_format import CompletionFormat
  from jaxserve.api.openai_format import ChatFormat
  from jaxserve.api.openai_request import Request
  from jaxserve.serving.requests import Chunk, FinishReason, GenerateInput, Prompt, TokenLogprobs

  fmt = (ChatFormat if kind == "chat" else CompletionFormat)(
      types.SimpleNamespace(model_name="m", tokenizer=MockTokenizer()),
      Request(GenerateInput(Prompt(text="x")), want_logprobs=True))
  lp = TokenLogprobs(-0.5, (3, 4), (-0.5, -np.inf))
  event = fmt.delta(Chunk("r", " t3", [3], [lp], FinishReason.STOP, None))

  def refuse(constant):
    raise ValueError(f"not JSON: {constant}")
  text = json.dumps(event)
  assert "-9999.0" in text and json.loads(text, parse_constant=refuse)

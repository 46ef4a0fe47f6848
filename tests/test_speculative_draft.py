"""Speculative decoding with a draft model (SpeculativeConfig(method="draft"), engine/draft.py).

The default model is its own draft: its proposals are its own tokens, so every one is accepted,
greedy or sampled, and the output equals decoding without speculation (alone, batched,
preempted), with no compile after warm-up. Its first 8 of 30 layers, a smaller draft with the
same tokenizer, propose tokens the model often rejects: the output still equals it. One engine
with speculation on serves both sides: SamplingParams(speculative=False) decodes one token a step.
"""

import copy
import dataclasses

import pytest

from jaxserve.batching.plan import StepKind
from jaxserve.config import EngineConfig, SamplingParams, SpeculativeConfig
from support import speculation
from support.speculation import run, tokens
from support.tiny import count_compiles

K = 3
ENGINE = EngineConfig(num_slots=4, page_size=16, num_pages=24, max_model_len=368,
                      prefill_buckets=(32,),
                      speculative=SpeculativeConfig(method="draft", num_speculative_tokens=K,
                                                    draft_model="smollm2-135m-instruct"))
TEXTS = ["What is a mortgage rate?", "Once upon a time, in a small village,",
         "def add(a, b):\n", "The three primary colours are"]


@pytest.fixture(scope="module")
def engine(default_model):
  return speculation.warm_engine(default_model, ENGINE, draft=True)


@pytest.fixture(scope="module")
def prompts(default_model):
  return [default_model[1].encode(t) for t in TEXTS]


def all_accepted(scheduler, completions):
  """The model as its own draft: every proposal it verified was accepted, and counted."""
  s = scheduler.spec_stats
  assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
  assert sum(c.num_accepted_tokens for c in completions) == s.num_accepted_tokens
  assert sum(c.num_draft_tokens for c in completions) == s.num_draft_tokens
  assert s.accepted_per_pos[0] == s.num_drafts


@pytest.mark.parametrize("k", [1, K])
def test_greedy_tokens_equal_and_every_proposal_accepted(engine, default_model, prompts, k):
  tok = default_model[1]
  on = SamplingParams(temperature=0, max_tokens=40)
  off = dataclasses.replace(on, speculative=False)
  with count_compiles() as counts:
    for batch in ([prompts[0]], prompts):
      want, s_off = run(engine, tok, batch, off, k)
      got, s_on = run(engine, tok, batch, on, k)
      assert tokens(got) == tokens(want)
      assert s_off.spec_stats.num_draft_tokens == 0
      all_accepted(s_on, got)
      assert max(s_on.spec_stats.accepted_per_pos[k:], default=0) == 0
      if k > 1:  # A verified run gives k + 1 tokens a step.
        assert s_on.num_steps < s_off.num_steps
  assert counts == {"trace": 0, "compile": 0}


def test_sampled_tokens_equal_and_every_proposal_accepted(engine, default_model, prompts):
  """The draft samples with the request's settings and its (seed, position) noise, as the
  verification does: as its own draft the model proposes its own samples, and the run holds
  the tokens of decoding one at a time, filters and penalties included."""
  tok = default_model[1]
  for i, case in enumerate([dict(temperature=1.0),
                            dict(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1,
                                 frequency_penalty=0.2)]):
    on = SamplingParams(max_tokens=30, seed=7 + i, **case)
    want, _ = run(engine, tok, prompts, dataclasses.replace(on, speculative=False))
    got, s_on = run(engine, tok, prompts, on)
    assert tokens(got) == tokens(want), case
    all_accepted(s_on, got)


def test_greedy_tokens_equal_when_preempted(engine, default_model, prompts):
  """23 pages of 16 tokens cannot hold four ~110-token sequences: requests are preempted and
  recomputed (the draft's KV with them), verified runs in flight included."""
  on = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
  want, s_off = run(engine, default_model[1], prompts, dataclasses.replace(on, speculative=False))
  got, s_on = run(engine, default_model[1], prompts, on)
  assert s_off.num_preemptions > 0 and s_on.num_preemptions > 0
  assert tokens(got) == tokens(want)
  all_accepted(s_on, got)
  assert s_on.pages.num_free_pages == s_on.pages.num_usable_pages


def first_layers(model, n: int):
  """The model with its layers from n on made identities (their output projections zeroed):
  in effect its first n layers, a smaller draft with the same tokenizer, in the model's own
  shapes, so its programs are those compiled for `engine` (the persistent compilation cache
  has them)."""
  from flax import nnx
  graphdef, state = nnx.split(model)
  weights = nnx.to_pure_dict(state)
  for name in ("wo", "w_down"):  # [L, ...]: each layer's output into the residual stream.
    weights["layers"][name] = weights["layers"][name].at[n:].set(0)
  nnx.replace_by_pure_dict(state, weights)
  return nnx.merge(graphdef, state)


def test_a_smaller_draft_keeps_the_output_with_rejections(engine, default_model, prompts):
  """A draft that disagrees with the model (its first 8 of 30 layers): proposals are rejected
  and rolled back, in both caches, and the tokens are still those without speculation, greedy
  and sampled (where this draft is rarely right)."""
  from jaxserve.engine.engine import Engine
  model, tok = default_model
  engine = Engine(model, ENGINE, stop_ids=tok.stop_ids, draft=first_layers(model, 8))
  for sampling in (SamplingParams(temperature=0, max_tokens=32),
                   SamplingParams(temperature=1.0, max_tokens=24, seed=3)):
    want, _ = run(engine, tok, prompts, dataclasses.replace(sampling, speculative=False))
    got, s_on = run(engine, tok, prompts, sampling)
    assert tokens(got) == tokens(want), sampling
    s = s_on.spec_stats
    assert s.num_accepted_tokens < s.num_draft_tokens, sampling  # Rejections happened.
    assert s.num_accepted_tokens > 0 or sampling.temperature, sampling  # Greedy: some accepted.


def test_refusals(default_model, tiny_model):
  from jaxserve.engine.draft import check_draft
  from jaxserve.engine.engine import Engine
  from jaxserve.llm import vocabulary_difference
  model, tok = default_model
  with pytest.raises(ValueError, match="needs draft_model"):
    SpeculativeConfig(method="draft")
  with pytest.raises(ValueError, match="needs draft_model"):
    SpeculativeConfig.from_json('{"method": "draft", "draft_model": ""}')
  with pytest.raises(ValueError, match="draft_model is for method"):
    SpeculativeConfig(method="ngram", draft_model="x")
  with pytest.raises(ValueError, match="vocabulary .* is not the target's"):
    Engine(model, ENGINE, draft=tiny_model)  # Refused before anything compiles.
  with pytest.raises(ValueError, match="needs a draft model"):
    Engine(model, ENGINE)
  with pytest.raises(ValueError, match='does not ask for method "draft"'):
    Engine(model, dataclasses.replace(ENGINE, speculative=SpeculativeConfig()), draft=model)
  with pytest.raises(ValueError, match="one device"):
    check_draft(dataclasses.replace(ENGINE, tp=2), model.cfg, model.cfg)
  assert vocabulary_difference(tok, tok) is None
  other = copy.copy(tok)  # The same tokens but one, spelled otherwise.
  other.id_to_token = lambda i: tok.id_to_token(i) + ("!" if i == 300 else "")
  assert "token 300" in vocabulary_difference(tok, other)


def test_draft_config_flag_on_serve_and_generate_and_plan_programs():
  from jaxserve.cli import flags
  from jaxserve.cli import main as cli
  from jaxserve.compiling.programs import engine_programs
  from jaxserve.config import AttentionBackend
  from jaxserve.planning import capacity
  text = '{"method": "draft", "draft_model": "smollm2-135m", "num_speculative_tokens": 3}'
  parser = cli.build_parser()
  want = SpeculativeConfig(method="draft", draft_model="smollm2-135m", num_speculative_tokens=3)
  for argv in (["serve"], ["generate", "x"]):
    args = parser.parse_args([*argv, "--speculative-config", text])
    assert flags.engine_config(args, "cpu").speculative == want
  # plan --compile lowers the engine's programs: the draft's weights and KV are among their
  # arguments, and the verifying ones are there.
  model = capacity.load_model_config("smollm2-135m")
  config = dataclasses.replace(ENGINE, speculative=want)
  programs = engine_programs(model, config, AttentionBackend.REFERENCE)
  assert any(p.kind is StepKind.VERIFYING for p in programs)
  for p in programs:
    (_, draft_params), cache = p.args[0], p.args[1]
    assert len(cache.groups) == len(cache.draft) == 1 and draft_params is not None
  # The pool holds both models' KV in each page.
  plain = capacity.num_kv_pages(model, 2**30, 0.9, 16, capacity.KV_DTYPES["float32"], 0)
  both = capacity.num_kv_pages(model, 2**30, 0.9, 16, capacity.KV_DTYPES["float32"], 0,
                               draft=model)
  assert both == plain // 2
  alone = capacity.plan_capacity(model, 2**34, 2048)
  paired = capacity.plan_capacity(model, 2**34, 2048, draft=model)
  assert paired.weight_bytes == 2 * alone.weight_bytes
  assert paired.kv_bytes_per_conversation == 2 * alone.kv_bytes_per_conversation

"""Constrained decoding through the engine, offline (`LLM`): JSON schema, regex and choice outputs
on the default model, all in one batch with unconstrained requests, with no compile after warm-up;
then the host loop's cases on a tiny random model (whose outputs only the mask can make valid):
preemption, max_tokens mid-object, stop strings, penalties, logprobs and the prefix cache."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

import jaxserve
from jaxserve import Constraint, EngineConfig, SamplingParams
from jaxserve.batching.request import FinishReason
from support.tiny import count_compiles

# Three levels: objects, arrays, enums, bounded integers, required fields; small enough that an
# object ends within a few dozen tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "role": {"enum": ["admin", "user", "guest"]},
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 8},
                "pos": {
                    "type": "object",
                    "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                   "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                            "maxItems": 2}},
                    "required": ["x", "tags"], "additionalProperties": False,
                },
            },
            "required": ["city", "pos"], "additionalProperties": False,
        },
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 1, "maxItems": 3},
    },
    "required": ["id", "role", "home", "scores"],
    "additionalProperties": False,
}
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
FREE = [SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=1.0, seed=7, max_tokens=24)]
FREE_PROMPTS = ["What is a mortgage rate?", "Name three rivers."]
ENGINE = EngineConfig(num_slots=32, max_model_len=512, prefill_buckets=(64, 128))


@pytest.fixture(scope="module")
def llm():
  return jaxserve.LLM(engine_config=ENGINE)


@pytest.fixture(scope="module")
def mixed(llm):
  """Unconstrained requests alone, then one batch of them among 100 schema, 20 regex and 10
  choice requests (compilations counted over the batch)."""
  alone = llm.generate(FREE_PROMPTS * 2, FREE + FREE[::-1], chat=True)
  json_sp = lambda t: SamplingParams(temperature=t, seed=3, max_tokens=120,
                                     constraint=Constraint.json_schema(SCHEMA))
  jobs = [(f"Describe user number {i} of a website as JSON.", json_sp(t)) for t in (1.0, 0.0)
          for i in range(50)]
  jobs += [(f"When was event {i}?", SamplingParams(temperature=1.0, seed=i, max_tokens=16,
                                                   constraint=Constraint.regex(DATE)))
           for i in range(10)]
  jobs += [(f"Call me at {i}", SamplingParams(temperature=1.0, seed=i, max_tokens=24,
                                              constraint=Constraint.regex(PHONE)))
           for i in range(10)]
  jobs += [(f"Review {i}: it was fine.", SamplingParams(temperature=t, seed=i, max_tokens=8,
                                                        constraint=Constraint.choice(CHOICES)))
           for i, t in enumerate([1.0, 0.0] * 5)]
  free = list(zip(FREE_PROMPTS * 2, FREE + FREE[::-1]))
  order = [free[0], *jobs[:60], free[1], *jobs[60:], *free[2:]]
  with count_compiles() as counts:
    outs = llm.generate([p for p, _ in order], [s for _, s in order], chat=True)
  by_kind = {"free": [outs[0], outs[61], *outs[-2:]], "json": outs[1:61] + outs[62:102],
             "regex": outs[102:122], "choice": outs[122:132]}
  return alone, by_kind, counts


@pytest.mark.real_model
def test_fifty_prompts_with_a_nested_schema_parse_and_validate_at_temperature_1_and_0(mixed):
  _, outs, _ = mixed
  assert len(outs["json"]) == 100
  for out in outs["json"]:
    assert out.finish_reason is FinishReason.STOP, out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.real_model
def test_regex_and_choice_outputs_match(mixed):
  _, outs, _ = mixed
  for out in outs["regex"][:10]:
    assert re.fullmatch(DATE, out.text), out.text
  for out in outs["regex"][10:]:
    assert re.fullmatch(PHONE, out.text), out.text
  assert all(out.text in CHOICES for out in outs["choice"]), [o.text for o in outs["choice"]]


@pytest.mark.real_model
def test_unconstrained_requests_get_the_tokens_they_get_alone(mixed):
  alone, outs, _ = mixed
  assert [o.token_ids for o in outs["free"]] == [o.token_ids for o in alone]


@pytest.mark.real_model
def test_no_compile_after_warmup(mixed):
  _, _, counts = mixed
  assert counts == {"trace": 0, "compile": 0}


@pytest.mark.real_model
def test_logprobs_are_those_of_the_masked_distribution(llm):
  params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, logprobs=5,
                          constraint=Constraint.choice(["yes", "no"]))
  out, = llm.generate(["Is water wet?"], params, chat=True)
  assert out.text in ("yes", "no")
  # Only "yes"/"no" spellings and end-of-sequence ids have a probability; they sum to 1.
  compiler = llm.runner.constraints.compiler
  matcher = compiler.compile(params.constraint).matcher()
  allowed = np.flatnonzero(_unpack(compiler, matcher))
  entries = _logprobs(llm, out, params)
  first = entries[0]
  finite = [t for t, lp in zip(first.top_ids, first.top_logprobs) if np.isfinite(lp)]
  assert set(finite) <= set(allowed.tolist())
  assert np.isfinite(first.logprob) and first.logprob <= 0
  assert np.exp(np.logaddexp.reduce([lp for lp in first.top_logprobs
                                     if np.isfinite(lp)])) <= 1 + 1e-4


def _unpack(compiler, matcher) -> np.ndarray:
  mask = compiler.new_bitmask(1)
  compiler.fill_bitmask(mask, [(0, matcher)])
  bits = (mask[0][:, None] >> np.arange(32)) & 1
  return bits.reshape(-1)[:compiler.vocab_size].astype(bool)


def _logprobs(llm, out, params):
  """The request's per-token logprobs, from a streamed run of the runner (Completion has none)."""
  runner = llm.runner
  req = runner.add_request(list(out.prompt_token_ids), params)
  entries = []
  while runner.has_unfinished:
    for o in runner.step():
      if o.request_id == req.request_id:
        entries += list(o.logprobs or ())
  return entries


# The host loop's cases, on a tiny random model: a free run of it is nonsense, so every valid
# output below is the mask's doing.

@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
  """4 slots, 15 usable pages of 16 tokens: test_determinism's preempted condition's shapes, so
  in the suite its programs are loaded from the persistent compilation cache."""
  from support import server_harness as h
  return jaxserve.LLM(str(tiny_checkpoint), engine_config=h.SMALL_POOL)


def test_preempted_constrained_requests_rebuild_their_matchers_and_stay_valid(tiny):
  sp = [SamplingParams(temperature=1.0, seed=i, max_tokens=90,
                       constraint=Constraint.json_schema(SCHEMA))
        for i in range(8)]
  before = tiny.runner.scheduler.num_preemptions
  outs = tiny.generate([f"user {i}" for i in range(8)], sp)
  assert tiny.runner.scheduler.num_preemptions > before  # 4 x ~95 tokens in 15 pages of 16.
  for out in outs:
    if out.finish_reason is FinishReason.STOP:
      jsonschema.validate(json.loads(out.text), SCHEMA)
  assert sum(o.finish_reason is FinishReason.STOP for o in outs) >= 4


def test_max_tokens_mid_object_is_length_and_eos_only_where_the_grammar_ends(tiny):
  out, = tiny.generate(["x"], SamplingParams(temperature=1.0, seed=0, max_tokens=6,
                                             constraint=Constraint.json_schema(SCHEMA)))
  assert out.finish_reason is FinishReason.LENGTH and out.text.startswith('{"id": ')
  with pytest.raises(json.JSONDecodeError):
    json.loads(out.text)
  # A choice can only end once it is complete: an end-of-sequence token comes right after.
  outs = tiny.generate(["x"] * 6, [SamplingParams(temperature=1.0, seed=s, max_tokens=12,
                                                  constraint=Constraint.choice(CHOICES))
                                   for s in range(6)])
  assert all(o.text in CHOICES and o.finish_reason is FinishReason.STOP for o in outs)
  assert all(o.token_ids[-1] in tiny.tokenizer.stop_ids for o in outs)


def test_stop_strings_penalties_and_the_prefix_cache_work_with_a_constraint(tiny):
  prompt = "a shared prefix of some length, so that its first page is cached " * 2
  sp = SamplingParams(temperature=1.0, seed=5, max_tokens=40, stop=["-"], frequency_penalty=1.5,
                      repetition_penalty=1.3, constraint=Constraint.regex(PHONE))
  first, = tiny.generate([prompt], sp)
  second, = tiny.generate([prompt], sp)
  assert second.num_cached_tokens > 0
  for out in (first, second):
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == "-"
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}", out.text), out.text
  assert first.token_ids == second.token_ids  # The same seed, cached prefix or not.


def test_a_constraint_with_ignore_eos_is_refused():
  with pytest.raises(ValueError, match="ignore_eos cannot be combined with a constraint"):
    SamplingParams(ignore_eos=True, constraint=Constraint.json_object())

"""Constrained decoding: constraints, the grammar cache, matchers and masks on SmolLM2's vocabulary,
and the device-side mask against a numpy reference."""

from __future__ import annotations

import asyncio
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxserve.engine.constraint_mask import apply_token_bitmask
from jaxserve.loading import checkpoint, pull
from jaxserve.text.constraint import (
  ALL_ALLOWED,
  Constraint,
  ConstraintCompiler,
  ConstraintKind,
  check,
)
from jaxserve.text.constraint_vocab import vocab_bytes
from jaxserve.text.tokenizer import Tokenizer
from support.tiny import count_compiles

# Three levels: objects, arrays, enums, bounded integers and numbers, required and optional fields.
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {
                    "type": "object",
                    "properties": {
                        "level": {"type": "integer", "minimum": -3, "maximum": 250},
                        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                 "maxItems": 3},
                    },
                    "required": ["level", "tags"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "geo"],
            "additionalProperties": False,
        },
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                   "minItems": 1, "maxItems": 4},
    },
    "required": ["name", "age", "role", "address", "scores"],
    "additionalProperties": False,
}
VALID_DOC = {"name": "Ada", "age": 36, "role": "admin",
             "address": {"city": "London", "zip": "02139",
                         "geo": {"level": -2, "tags": ["a", "c"]}},
             "scores": [5, -5, 0]}
# [0-9], not \d: llguidance's \d is any Unicode digit, as in Python's re, but its Unicode tables
# are newer than Python 3.11's, so random draws can find digits that re does not know.
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
  return Tokenizer.from_hf_dir(checkpoint.resolve(None) / "tokenizer")


@pytest.fixture(scope="module")
def compiler(tokenizer) -> ConstraintCompiler:
  return ConstraintCompiler(tokenizer)


def allowed_ids(compiler, matcher) -> np.ndarray:
  bitmask = compiler.new_bitmask(1)
  compiler.fill_bitmask(bitmask, [(0, matcher)])
  return np.flatnonzero(unpack(bitmask, compiler.vocab_size)[0])


def unpack(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
  """[B, W] int32 -> [B, V] bool, written apart from the code under test: token t is bit t of
  the row's little-endian bytes."""
  return np.unpackbits(bitmask.view(np.uint8), axis=1,
                       bitorder="little")[:, :vocab_size].astype(bool)


def sample_random(compiler, tokenizer, constraint, rng, max_len=2000, closers=None,
                  special=range(17)) -> str:
  """Draws uniformly among the allowed tokens until an end-of-sequence token; checks on the way
  that end-of-sequence is allowed exactly when the grammar can end, and no other special token.
  `closers` (a bool [V]): half the draws come from these tokens when some are allowed (so that
  unbounded strings and objects end)."""
  matcher = compiler.compile(constraint).matcher()
  stops, ids = sorted(tokenizer.stop_ids), []
  for _ in range(max_len):
    allowed = allowed_ids(compiler, matcher)
    assert np.isin(stops, allowed).all() == matcher.can_end, tokenizer.detokenize(ids)
    assert set(allowed[np.isin(allowed, special)].tolist()) <= set(stops), "a special token"
    if matcher.can_end and (matcher.is_finished or rng.random() < 0.3):
      return tokenizer.detokenize(ids)
    allowed = np.setdiff1d(allowed, stops)
    if closers is not None and closers[allowed].any() and rng.random() < 0.5:
      allowed = allowed[closers[allowed]]
    token = int(rng.choice(allowed))
    assert matcher.accept(token), matcher.error
    ids.append(token)
  raise AssertionError(f"no end after {max_len} tokens: {tokenizer.detokenize(ids)!r}")


# Validation.

@pytest.mark.parametrize("make, message", [
    (lambda: check(Constraint.json_schema('{"type": "object",')), "the schema is not valid JSON"),
    (lambda: check(Constraint.json_schema([{"type": "object"}])),
     "the schema must be a JSON object, got an array"),
    (lambda: check(Constraint.json_schema({"type": "objekt"})), "Invalid type: objekt"),
    (lambda: check(Constraint.json_schema({"type": "object", "if": {}})),
     'Unimplemented keys: \\["if"\\]'),
    (lambda: check(Constraint.json_schema({"type": "string", "pattern": "(("})), "unclosed group"),
    (lambda: check(Constraint.json_schema({"$ref": "#/$defs/missing"})), "does not exist"),
    (lambda: check(Constraint.regex("((")), "(?s)regex constraint is invalid.*unclosed group"),
    (lambda: check(Constraint.regex("")), "regex constraint: the pattern is empty"),
    (lambda: check(Constraint.regex("a{3,1}")), "invalid repetition count range"),
    (lambda: check(Constraint.choice([])), "the options must be a non-empty list of strings"),
    (lambda: check(Constraint.choice(["yes", 3])), "option 1 must be a non-empty string, got 3"),
    (lambda: check(Constraint.grammar('start: "a" | b')),
     '(?s)grammar constraint is invalid.*unknown name: "b"'),
    (lambda: check(Constraint.grammar('root ::= ("a"')),
     "(?s)grammar constraint is invalid.*Expected '\\)'"),
    (lambda: check(Constraint.grammar("  ")), "the grammar is empty"),
    (lambda: check(Constraint("xml", "<a/>")),
     "constraint kind must be one of json_object, json_schema"),
    (lambda: check(Constraint(ConstraintKind.JSON_OBJECT, "{}")),
     "json_object constraint takes no text"),
])
def test_invalid_constraints_name_the_problem(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_valid_constraints_are_canonical_and_take_kind_names():
  assert (Constraint("json_schema", '{ "type" :  "object" }')
          == Constraint.json_schema({"type": "object"}))
  assert Constraint.json_schema(NESTED_SCHEMA).text.startswith(
      '{"type":"object","properties":{"name"')
  assert Constraint.grammar('root ::= "yes" | "no"').kind is ConstraintKind.GRAMMAR  # GBNF
  assert Constraint.regex(PHONE) != Constraint.regex(DATE)


# The grammar cache.

def test_second_compile_of_a_schema_is_a_cache_hit(tokenizer):
  compiler = ConstraintCompiler(tokenizer, max_grammars=2)
  first = compiler.compile(Constraint.json_schema(NESTED_SCHEMA))
  again = compiler.compile(Constraint.json_schema(json.dumps(NESTED_SCHEMA, indent=4)))
  assert again is first and (compiler.num_compiles, compiler.num_cache_hits) == (1, 1)
  compiler.compile(Constraint.regex(DATE))
  compiler.compile(Constraint.regex(PHONE))  # Evicts the schema, the least recently used.
  assert compiler.compile(Constraint.json_schema(NESTED_SCHEMA)) is not first
  assert (compiler.num_compiles, compiler.num_cache_hits) == (4, 1)


def test_compiles_off_the_event_loop_in_parallel_without_a_lock(tokenizer):
  """Compiles hold no lock (a long one must not stall the cache's readers), so threads that ask
  at once may each compile: every one gets the constraint's grammar, and the cache keeps one."""
  compiler = ConstraintCompiler(tokenizer)
  constraint = Constraint.json_schema(NESTED_SCHEMA)

  async def compile_many():
    return await asyncio.gather(*[asyncio.to_thread(compiler.compile, constraint)
                                  for _ in range(8)])

  grammars = asyncio.run(compile_many())
  assert all(g.constraint == constraint for g in grammars)
  assert compiler.num_compiles + compiler.num_cache_hits == 8 and compiler.num_compiles >= 1
  assert compiler.cached(constraint) in grammars


# Matchers.

def test_vocab_bytes_spell_what_the_tokenizer_decodes(tokenizer):
  token_bytes, special = vocab_bytes(tokenizer)
  assert special == list(range(17))  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...
  assert token_bytes[216] == b" " and len(token_bytes) == tokenizer.vocab_size
  for i in range(17, tokenizer.vocab_size, 7):
    text = tokenizer.detokenize([i])
    if "\ufffd" not in text:  # A whole character or more (not part of a multi-byte one).
      assert token_bytes[i] == text.encode(), i


def test_sentencepiece_vocab_bytes_and_a_constraint_on_it():
  gemma = Tokenizer.from_gguf(pull.gguf_path(pull.GEMMA3))  # 262,144 SentencePiece pieces.
  token_bytes, special = vocab_bytes(gemma)
  assert token_bytes[gemma.token_to_id("<0x0A>")] == b"\n" and gemma.eos_id in special
  word = gemma.encode(" the")[-1]
  assert gemma.id_to_token(word) == "\u2581the" and token_bytes[word] == b" the"
  compiler = ConstraintCompiler(gemma)
  rng = np.random.default_rng(5)
  for _ in range(5):
    assert re.fullmatch(PHONE, sample_random(compiler, gemma, Constraint.regex(PHONE), rng,
                                             special=special))


def test_matcher_accepts_a_valid_document_and_allows_eos_only_at_its_end(compiler, tokenizer):
  ids = tokenizer.encode(json.dumps(VALID_DOC))  # json.dumps spaces it as the grammar does.
  matcher = compiler.compile(Constraint.json_schema(NESTED_SCHEMA)).matcher()
  for n, token in enumerate(ids):
    allowed = allowed_ids(compiler, matcher)
    assert token in allowed and not matcher.can_end and not np.isin([0, 2], allowed).any(), n
    assert matcher.accept(token), matcher.error
  assert matcher.can_end and matcher.is_finished
  assert allowed_ids(compiler, matcher).tolist() == [0, 2]  # <|endoftext|>, <|im_end|>


def test_matcher_refuses_a_document_that_breaks_the_schema(compiler, tokenizer):
  doc = dict(VALID_DOC, age=121)  # Past the maximum.
  matcher = compiler.compile(Constraint.json_schema(NESTED_SCHEMA)).matcher()
  ids = tokenizer.encode(json.dumps(doc))
  assert not matcher.accept_all(ids)
  refused = ids[matcher.num_tokens]
  assert tokenizer.detokenize(ids[:matcher.num_tokens]).endswith('"age": 12')  # 121 is past 120.
  assert f'token "{tokenizer.detokenize([refused])}" doesn\'t satisfy the grammar' in matcher.error
  assert matcher.is_finished and allowed_ids(compiler, matcher).tolist() == [0, 2]  # It stops.


def test_rebuilt_matcher_has_the_state_of_one_fed_token_by_token(compiler, tokenizer):
  ids = tokenizer.encode(json.dumps(VALID_DOC))
  grammar = compiler.compile(Constraint.json_schema(NESTED_SCHEMA))
  stepped = grammar.matcher()
  states = [stepped.state()]
  for token in ids:
    stepped.accept(token)
    states.append(stepped.state())
  assert len(set(states)) > len(ids) // 2  # The states differ, so equal ones mean something.
  for n in range(len(ids) + 1):
    rebuilt = grammar.matcher(ids[:n])
    assert rebuilt.state() == states[n] and rebuilt.num_tokens == n, n


def test_random_tokens_under_the_schema_always_parse_and_validate(compiler, tokenizer):
  rng = np.random.default_rng(0)
  validator = jsonschema.Draft202012Validator(NESTED_SCHEMA)
  for _ in range(25):
    text = sample_random(compiler, tokenizer, Constraint.json_schema(NESTED_SCHEMA), rng)
    validator.validate(json.loads(text))


def test_json_object_gives_objects(compiler, tokenizer):
  rng = np.random.default_rng(1)
  token_bytes, _ = vocab_bytes(tokenizer)
  closers = np.array([any(c in t for c in b'"}]') for t in token_bytes])  # [V] bool
  for _ in range(10):
    text = sample_random(compiler, tokenizer, Constraint.json_object(), rng, closers=closers)
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("pattern", [DATE, PHONE])
def test_random_tokens_under_a_regex_match_it(compiler, tokenizer, pattern):
  rng = np.random.default_rng(2)
  texts = {sample_random(compiler, tokenizer, Constraint.regex(pattern), rng) for _ in range(25)}
  assert len(texts) > 20  # Different outputs, each matching.
  for text in texts:
    assert re.fullmatch(pattern, text), text


def test_random_tokens_under_a_choice_are_one_of_the_choices(compiler, tokenizer):
  rng = np.random.default_rng(3)
  options = ["yes", "no", "yes, with changes", "ünïcode \"quoted\""]
  texts = [sample_random(compiler, tokenizer, Constraint.choice(options), rng) for _ in range(40)]
  assert set(texts) <= set(options) and len(set(texts)) >= 3


def test_grammar_constraints_in_lark_and_gbnf(compiler, tokenizer):
  rng = np.random.default_rng(4)
  lark = Constraint.grammar('start: item ("+" item)*\nitem: /[0-9]{1,3}/')
  gbnf = Constraint.grammar('root ::= item ("+" item)*\nitem ::= [0-9] [0-9]? [0-9]?')
  for constraint in (lark, gbnf):
    for _ in range(10):
      text = sample_random(compiler, tokenizer, constraint, rng)
      assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", text), text


# Masks.

def test_fill_bitmask_writes_only_the_constrained_rows(compiler):
  bitmask = compiler.new_bitmask(4)
  assert bitmask.shape == (4, 49152 // 32) and (bitmask == ALL_ALLOWED).all()
  matcher = compiler.compile(Constraint.choice(["yes", "no"])).matcher()
  compiler.fill_bitmask(bitmask, [(2, matcher)])
  assert (bitmask[[0, 1, 3]] == ALL_ALLOWED).all()
  assert 0 < unpack(bitmask, compiler.vocab_size)[2].sum() < 10
  with pytest.raises(ValueError, match="bitmask must be int32"):
    compiler.fill_bitmask(np.zeros((4, 10), np.int32), [(0, matcher)])


def test_padded_vocab_rows_are_never_allowed(tokenizer):
  compiler = ConstraintCompiler(tokenizer, vocab_size=49152 + 64)  # A model with padded logits.
  matcher = compiler.compile(Constraint.json_object()).matcher()
  bitmask = compiler.new_bitmask(1)
  compiler.fill_bitmask(bitmask, [(0, matcher)])
  assert bitmask.shape == (1, 1538) and not unpack(bitmask, compiler.vocab_size)[0, 49152:].any()


@pytest.mark.parametrize("vocab_size", [100, 49152])
def test_apply_token_bitmask_matches_numpy(vocab_size):
  rng = np.random.default_rng(vocab_size)
  num_words = -(-vocab_size // 32)
  bitmask = rng.integers(-2**31, 2**31, (5, num_words), dtype=np.int64).astype(np.int32)  # [B, W]
  bitmask[1] = ALL_ALLOWED  # Unconstrained.
  bitmask[2] = 0  # Nothing allowed.
  bitmask[3, 0] = np.int32(-2**31)  # Only bit 31 of the first word: token 31.
  logits = rng.normal(size=(5, vocab_size)).astype(np.float32)  # [B, V]
  masked = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(bitmask)))
  expected = np.where(unpack(bitmask, vocab_size), logits, -np.inf)
  np.testing.assert_array_equal(masked, expected)
  np.testing.assert_array_equal(masked[1], logits[1])  # Bit for bit.
  assert np.isfinite(masked[3, :32]).tolist() == [False] * 31 + [True]


def test_apply_token_bitmask_compiles_once_for_any_mask():
  step = jax.jit(apply_token_bitmask)
  logits = jnp.zeros((4, 49152), jnp.float32)
  masks = [jnp.full((4, 1536), ALL_ALLOWED, jnp.int32)] + [
      jnp.asarray(np.random.default_rng(seed).integers(-2**31, 2**31, (4, 1536)).astype(np.int32))
      for seed in range(3)]
  step(logits, masks[0]).block_until_ready()
  with count_compiles() as counts:
    for bitmask in masks[1:]:
      step(logits, bitmask).block_until_ready()
  assert counts["compile"] == 0


def test_apply_token_bitmask_checks_shapes():
  with pytest.raises(ValueError, match=r"bitmask must be int32 \[2, 4\]"):
    apply_token_bitmask(jnp.zeros((2, 100)), jnp.zeros((2, 3), jnp.int32))

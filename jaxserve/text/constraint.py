"""Constrained decoding, host side: which tokens a constrained sequence may sample next.

  Constraint (config/constraint.py: plain data on SamplingParams) --check--> llguidance's grammar
  Constraint --ConstraintCompiler.compile (checks it; cached)--> Grammar
  Grammar.matcher(token_ids) -> one Matcher per sequence; Matcher.accept(token) after each step
  ConstraintCompiler.fill_bitmask(bitmask [B, ceil(V/32)] int32, [(row, matcher), ...])

The grammar engine is llguidance (BENCHMARKS.md, "Tried and not adopted": against xgrammar):
one 3 MB wheel with no dependencies, a lazily built lexer (compiling a schema costs about a
millisecond; the work is spread over the first masks), and a JSON schema compiler that refuses
the keywords it cannot enforce instead of ignoring them. A bit set in the mask allows the token;
rows of all ones (ALL_ALLOWED) leave a sequence unconstrained, and only constrained rows are
written, so unconstrained sequences cost nothing here. Imports no jax.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from typing import Any, Sequence

import llguidance
import llguidance.numpy
import numpy as np

from jaxserve.config.constraint import Constraint, ConstraintKind
from jaxserve.text.constraint_vocab import llguidance_tokenizer

__all__ = ["ALL_ALLOWED", "Constraint", "ConstraintCompiler", "ConstraintKind", "Grammar",
           "Matcher", "check"]

ALL_ALLOWED = -1  # An int32 with all 32 bits set: a mask word that allows every token.
# JSON is written the way json.dumps writes it by default. Free whitespace would let a small model
# fill max_tokens with newlines (greedy decoding loops on them), so none is allowed.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def limits() -> llguidance.LLParserLimits:
  """llguidance's budget for one grammar: its own defaults (max_items_in_row 2,000,
  max_grammar_size 500,000 symbols, lexer fuel and states), errors without a dump of the parser's
  state. Config's MAX_CONSTRAINT_CHARS bounds the text before any of it is compiled."""
  return llguidance.LLParserLimits(verbose_errors=False)


def check(constraint: Constraint, tokenizer: llguidance.LLTokenizer | None = None) -> str:
  """Raises ValueError naming what the grammar engine finds wrong with `constraint` (a schema
  keyword it cannot enforce, a regex or grammar that does not compile, a limit it reached);
  returns llguidance's grammar for it. A warning is refused too: llguidance warns where it will
  not enforce part of a constraint, and output outside a constraint must never be served.
  `tokenizer`: the vocabulary's, which token ids in a grammar (`<[13]>`) are checked against
  (without it, llguidance warns that it cannot check them)."""
  grammar = _GRAMMAR_BUILDERS[constraint.kind](constraint.text)
  is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer,
                                                                          limits=limits())
  if is_error:
    raise ValueError(f"{constraint.kind.value} constraint is invalid: {messages[0]}")
  if messages:
    raise ValueError(f"{constraint.kind.value} constraint cannot be enforced: the grammar "
                     f"engine warns: {'; '.join(messages)}")
  return grammar


def _json_object_grammar(text: str) -> str:
  return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)


def _json_schema_grammar(text: str) -> str:
  return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)


def _regex_grammar(text: str) -> str:
  return llguidance.LLMatcher.grammar_from_regex(text)


def _choice_grammar(text: str) -> str:
  # One terminal (upper case), so the options are one lexeme that the lexer matches, never
  # alternatives of a parser rule: the Earley parser predicts every alternative of a rule in one
  # row, and past its 2,000-item row limit it gave up mid-output, leaving "item" of
  # "item1234" as the whole (finish stop). Compiling a rule of 100k options also took 20 s where
  # the lexeme takes 0.7 s. Lark's string literals take JSON's escapes: json.dumps spells any
  # option safely.
  options = dict.fromkeys(json.loads(text))
  return llguidance.LLMatcher.grammar_from_lark(
      "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))


def _grammar_grammar(text: str) -> str:
  try:  # GBNF is recognized by its `::=` and translated to Lark.
    return llguidance.grammar_from("grammar", text)
  except ValueError as e:
    raise ValueError(f"grammar constraint is invalid: {e}") from None


_GRAMMAR_BUILDERS = {
    ConstraintKind.JSON_OBJECT: _json_object_grammar,
    ConstraintKind.JSON_SCHEMA: _json_schema_grammar,
    ConstraintKind.REGEX: _regex_grammar, ConstraintKind.CHOICE: _choice_grammar,
    ConstraintKind.GRAMMAR: _grammar_grammar,
}


class Grammar:
  """A compiled constraint for one vocabulary; makes the matchers of the sequences that use it."""

  def __init__(self, constraint: Constraint, pristine: llguidance.LLMatcher):
    self.constraint = constraint
    self._pristine = pristine  # Never advanced: each matcher starts as a copy of it.
    # The first token's mask, packed [ceil(V_tok/32)] int32: computing it also runs the parser's
    # first row, where a limit can show before any request uses the grammar.
    self.first_mask = np.frombuffer(pristine.compute_bitmask(), np.int32).copy()
    self._probe(pristine)

  def _probe(self, pristine: llguidance.LLMatcher) -> None:
    """Raises ValueError when the grammar engine gives up at the start: computing the first mask,
    or taking a token that mask allows (a Lark rule of over 2,000 alternatives passes its checks,
    then overflows the parser's row on the first token: only end-of-sequence would follow, and
    "ite" of "item12" would be the whole output). Two tokens are tried: one may end the output."""
    error = pristine.get_error()
    allowed = np.flatnonzero(np.unpackbits(self.first_mask.view(np.uint8), bitorder="little"))
    for token in allowed[::-1][:1].tolist() + allowed[:1].tolist():
      if not error:
        probe = pristine.deep_copy()
        probe.consume_token(token)
        error = probe.get_error()
    if error:  # Cut the marker llguidance writes where verbose errors would go on.
      raise ValueError(f"{self.constraint.kind.value} constraint cannot be enforced: "
                       f"{error.split(chr(10) + '<non-verbose/>')[0]}")

  def matcher(self, token_ids: Sequence[int] = ()) -> Matcher:
    """A matcher that has accepted `token_ids` (the tokens generated before a preemption)."""
    m = Matcher(self._pristine.deep_copy())
    m.accept_all(token_ids)
    return m

  def check_allowed(self, token_ids: Sequence[int]) -> None:
    """Raises ValueError when none of `token_ids` (a request's allowed_token_ids) may start the
    output: the step would mask every token, and the request end at once with nothing."""
    ids = np.asarray(token_ids, np.int64)
    ids = ids[ids < self.first_mask.size * 32]
    if not ((self.first_mask[ids // 32] >> (ids % 32)) & 1).any():
      raise ValueError(f"allowed_token_ids and the {self.constraint.kind.value} constraint leave "
                       "no token to start the output with: none of the allowed ids is one the "
                       "constraint allows first")


class Matcher:
  """One sequence's place in its grammar. Not thread-safe: one owner at a time."""

  def __init__(self, inner: llguidance.LLMatcher):
    self._m = inner
    self.num_tokens = 0

  def accept(self, token_id: int) -> bool:
    """Advances past a sampled token; False if the grammar did not allow it (see `error`)."""
    ok = self._m.consume_token(int(token_id))
    self.num_tokens += ok
    return ok

  def accept_all(self, token_ids: Sequence[int]) -> bool:
    return all(self.accept(t) for t in token_ids)  # Stops at the first token refused.

  @property
  def can_end(self) -> bool:
    """The output so far is complete: end-of-sequence tokens are allowed now, and only now."""
    return self._m.is_accepting()

  @property
  def is_finished(self) -> bool:
    """Nothing but an end-of-sequence token can follow (also true in error: the mask then allows
    only end-of-sequence tokens, so a sequence that broke its grammar stops)."""
    return self._m.is_stopped()

  @property
  def error(self) -> str:
    """Why the matcher failed ('' while it has not): a refused token, or a grammar limit hit."""
    return self._m.get_error()

  def state(self) -> tuple[bool, bool, str, bytes]:
    """(can_end, is_finished, error, packed allowed-token mask): equal states compare equal."""
    return self.can_end, self.is_finished, self.error, self._m.compute_bitmask()


class ConstraintCompiler:
  """Compiles constraints for one tokenizer's vocabulary, caches them, and fills the masks.

  `compile` is thread-safe and meant to run off the event loop, in a worker thread: a schema the
  cache has not seen costs milliseconds, a large one seconds. The lock guards only the cache, never
  a compile, so `cached` (what the event loop may call) never waits on one. The cache keeps the
  `max_grammars` most recently used.
  """

  def __init__(self, tokenizer: Any, vocab_size: int | None = None, max_grammars: int = 256,
               num_threads: int | None = None):
    """`tokenizer`: a jaxserve Tokenizer. `vocab_size`: the model's V, when its logits have rows
    past the tokenizer's vocabulary (those tokens are never allowed in a constrained row)."""
    self.vocab_size = vocab_size or tokenizer.vocab_size
    if self.vocab_size < tokenizer.vocab_size:
      raise ValueError(f"vocab_size {vocab_size} is less than the tokenizer's "
                       f"{tokenizer.vocab_size}")
    self.num_words = -(-self.vocab_size // 32)  # W: int32 words per mask row.
    self._tokenizer = llguidance_tokenizer(tokenizer)
    self._num_tokenizer_words = -(-tokenizer.vocab_size // 32)
    self._grammars: collections.OrderedDict[Constraint, Grammar] = collections.OrderedDict()
    self._lock = threading.Lock()
    # A matcher's error then names the refused token, without a dump of its parser's state.
    self._limits = limits()
    self._max_grammars = max_grammars
    # Rows are filled in parallel: most mask time is spent walking the vocabulary's token trie.
    self._executor = llguidance.LLExecutor(num_threads or min(8, os.cpu_count() or 1))
    self.num_compiles = 0
    self.num_cache_hits = 0

  def cached(self, constraint: Constraint) -> Grammar | None:
    """The compiled grammar if the cache has it; never compiles (the lock is held for a lookup)."""
    with self._lock:
      grammar = self._grammars.get(constraint)
      if grammar is not None:
        self._grammars.move_to_end(constraint)
        self.num_cache_hits += 1
      return grammar

  def compile(self, constraint: Constraint) -> Grammar:
    """The grammar of `constraint`, from the cache or compiled in the calling thread (two
    threads may compile one constraint at once; both results are equal)."""
    grammar = self.cached(constraint)
    if grammar is not None:
      return grammar
    pristine = llguidance.LLMatcher(self._tokenizer, check(constraint, self._tokenizer),
                                    log_level=0,
                                    limits=self._limits)
    if pristine.is_error():  # What only the vocabulary shows, e.g. an unknown special token.
      raise ValueError(f"{constraint.kind.value} constraint is invalid: {pristine.get_error()}")
    grammar = Grammar(constraint, pristine)
    with self._lock:
      self._grammars[constraint] = grammar
      self.num_compiles += 1
      if len(self._grammars) > self._max_grammars:
        self._grammars.popitem(last=False)
    return grammar

  def new_bitmask(self, num_rows: int) -> np.ndarray:
    """[num_rows, ceil(V/32)] int32, every token allowed: the mask of unconstrained rows."""
    return np.full((num_rows, self.num_words), ALL_ALLOWED, np.int32)

  def fill_bitmask(self, bitmask: np.ndarray, rows: Sequence[tuple[int, Matcher]]) -> None:
    """Writes row r of `bitmask` [B, ceil(V/32)] int32 for each (r, matcher); other rows are left
    as they are (a row whose sequence left must be set back to ALL_ALLOWED by its owner)."""
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != self.num_words:
      raise ValueError(f"bitmask must be int32 [B, {self.num_words}], got "
                       f"{bitmask.dtype} {list(bitmask.shape)}")
    if not rows:
      return
    # llguidance writes whole rows of its own vocabulary's width, so into a packed scratch array;
    # the model's padding tokens past that width stay disallowed.
    scratch = np.empty((len(rows), self._num_tokenizer_words), np.int32)  # [R, ceil(V_tok/32)]
    pairs = [(m._m, n) for n, (_, m) in enumerate(rows)]
    llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, scratch)
    index = np.fromiter((r for r, _ in rows), np.int64, len(rows))
    bitmask[index, :scratch.shape[1]] = scratch
    bitmask[index, scratch.shape[1]:] = 0

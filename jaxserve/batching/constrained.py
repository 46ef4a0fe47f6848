"""Constrained decoding in the host loop: each constrained request's matcher, and its masks.

How a constrained token is made, with the runner's overlap (runner.py: step n+1 is dispatched
before step n's tokens are read):

  The mask of a request's next token needs the token before it. So the scheduler leaves a
  constrained request out of a step's decode while its previous token is still in flight
  (scheduler.py, `_schedule_decodes`): it decodes every other step, while the unconstrained
  requests decode every step and keep the overlap. In the step it sits out, the runner reads its
  token, the matcher accepts it, and in the next one the mask is filled from the matcher (on the
  host, while the device runs the step before) and sent with the decode.

  step n     dispatch decode(A, C, mask of C)        read n-1          (A free, C constrained)
  step n+1   dispatch decode(A)                      read n: C's token -> matcher
  step n+2   dispatch decode(A, C, mask of C)        read n+1

A prefill's last chunk samples the first token under the mask of the matcher's start (or, after a
preemption, of the tokens generated before it: a token in flight when the request was preempted
was never accepted, as its epoch dropped it, and a matcher that disagrees with the tokens is
rebuilt from them). End-of-sequence ids are in the mask only where the grammar can end; once it
is complete, only they are. Unconstrained requests cost nothing here: a step with no constrained
row passes no mask (the engine's kept all-ones one is used).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import numpy as np
from absl import logging

from jaxserve.batching.request import Request
from jaxserve.config import Constraint
from jaxserve.text.constraint import ALL_ALLOWED, ConstraintCompiler, Grammar, Matcher


class Constraints:
  """The runner's constrained requests: grammars (compiled once per constraint), matchers, masks."""

  def __init__(self, tokenizer: Any, vocab_size: int, num_slots: int):
    self._tokenizer, self._vocab_size, self._num_slots = tokenizer, vocab_size, num_slots
    self._compiler: ConstraintCompiler | None = None  # Built on first use: it reads the vocabulary.
    self._lock = threading.Lock()
    self._matchers: dict[str, Matcher] = {}
    # [Bs, V / 32] int32, all ones but while a decode mask is made.
    self._rows: np.ndarray | None = None
    self.num_masks = 0  # Mask rows filled, and the host seconds spent filling them.
    self.mask_seconds = 0.0

  @property
  def compiler(self) -> ConstraintCompiler:
    with self._lock:
      if self._compiler is None:
        self._compiler = ConstraintCompiler(self._tokenizer, self._vocab_size)
        self._rows = self._compiler.new_bitmask(self._num_slots)
      return self._compiler

  @property
  def num_active(self) -> int:
    return len(self._matchers)

  def grammar(self, constraint: Constraint,
              allowed_token_ids: Sequence[int] | None = None) -> Grammar:
    """Compiles `constraint` (cached); raises ValueError naming what is wrong with it, or that
    `allowed_token_ids` leave no token it allows first. Thread-safe, and slow for a large
    constraint: the serving core calls it from a worker thread before the request is queued."""
    grammar = self.compiler.compile(constraint)
    if allowed_token_ids is not None:
      grammar.check_allowed(allowed_token_ids)
    return grammar

  def cached(self, constraint: Constraint) -> Grammar | None:
    """The grammar if compiled already, else None; never waits on a compile (the event loop's)."""
    compiler = self._compiler  # Read once: set (never unset) by the first compile.
    return compiler.cached(constraint) if compiler is not None else None

  def start(self, req: Request) -> None:
    if req.grammar is not None:
      self._matchers[req.request_id] = req.grammar.matcher()

  def end(self, req: Request) -> None:
    self._matchers.pop(req.request_id, None)

  def error(self, req: Request) -> str | None:
    """Why `req`'s matcher stopped (a grammar limit reached, a refused token); None if it did
    not."""
    return self._matchers[req.request_id].error or None

  def accept(self, req: Request, token: int) -> None:
    matcher = self._matchers[req.request_id]
    if not matcher.accept(token):  # The mask allowed it, so this is a bug, not bad input.
      logging.warning("request %s: token %d broke its constraint (%s); only end-of-sequence "
                      "follows", req.request_id, token, matcher.error)

  def prefill_mask(self, req: Request) -> np.ndarray:
    """[1, W]: the tokens the first sampled token (after the prompt and any tokens generated
    before a preemption) may be."""
    matcher = self._matchers[req.request_id]
    output = req.output_token_ids
    if matcher.num_tokens != len(output):
      matcher = self._matchers[req.request_id] = req.grammar.matcher(output)
    mask = self.compiler.new_bitmask(1)
    self._fill(mask, [(0, matcher)])
    return mask

  def decode_mask(self, reqs: Sequence[Request]) -> np.ndarray | None:
    """[len(reqs), W]: row i allows what reqs[i] may sample (all ones when it is free); None when
    no request of the step is constrained."""
    if not self._matchers:
      return None
    rows = [(i, self._matchers[r.request_id]) for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
      return None
    self._fill(self._rows, rows)
    mask = self._rows[:len(reqs)].copy()
    self._rows[[i for i, _ in rows]] = ALL_ALLOWED
    return mask

  def step_mask(self, decodes: Sequence[Request], ends: Sequence[Request]) -> np.ndarray | None:
    """[len(decodes) + len(ends), W], rows in the order of a step's samples: the decoding
    requests', then those whose prompts end in the step; None when none is constrained."""
    decode = self.decode_mask(decodes)
    if decode is None and not any(r.grammar is not None for r in ends):
      return None
    mask = self.compiler.new_bitmask(len(decodes) + len(ends))
    if decode is not None:
      mask[:len(decodes)] = decode
    for i, req in enumerate(ends):
      if req.grammar is not None:
        mask[len(decodes) + i] = self.prefill_mask(req)[0]
    return mask

  def _fill(self, mask: np.ndarray, rows: list[tuple[int, Matcher]]) -> None:
    start = time.perf_counter()
    self.compiler.fill_bitmask(mask, rows)
    self.mask_seconds += time.perf_counter() - start
    self.num_masks += len(rows)

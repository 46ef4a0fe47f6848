"""A real server over the mock engine: the whole serving path (gRPC, HTTP, keys, the prefix cache,
metrics) in milliseconds, with tokens worked out by hand. Text is tokenized one character a
token (its code point), so a test knows how many pages a prompt fills."""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from support import server_harness as h
from support.mock_engine import MockEngine, MockTokenizer, next_plus_one

VOCAB_SIZE = 1000


class CharTokenizer(MockTokenizer):
  """MockTokenizer with what the server needs: one token a character (ASCII), a vocabulary for
  the constraint compiler the server builds as it warms up, no chat template."""

  vocab_size = VOCAB_SIZE
  bos_id = None
  max_token_chars = 1
  chat_template = None
  takes_tools = False

  def encode(self, text: str, add_special_tokens: bool = True, add_bos: bool = True) -> list[int]:
    return [ord(c) for c in text]

  def id_to_token(self, i: int) -> str:
    return self.piece(i)


class Gate:
  """A next-token function that, once closed, waits as soon as `when()` holds: the engine thread
  stops inside a step, so the scheduler's state holds still for a test to read."""

  def __init__(self):
    self._open = threading.Event()
    self._open.set()
    self.when: Callable[[], bool] = lambda: True
    self.token_s = 0.0  # Seconds each token takes: long enough for later requests to arrive.

  def __call__(self, context: Sequence[int]) -> int:
    time.sleep(self.token_s)
    if self.when():
      assert self._open.wait(30), "the gate stayed closed"
    return next_plus_one(context) % 900  # Never the end-of-sequence id.

  def close(self, when: Callable[[], bool] = lambda: True) -> None:
    self.when = when
    self._open.clear()

  def open(self) -> None:
    self._open.set()


def serve(engine: MockEngine | None = None, keys_file: str | None = None,
          **config) -> h.ServerThread:
  """A started server of `engine` (by default 4 slots, 4-token pages, 63 usable pages)."""
  engine = engine or MockEngine(max_model_len=64, vocab_size=VOCAB_SIZE)
  return h.serve(engine, CharTokenizer(), name="mock",
                 keys_file=keys_file, **config)

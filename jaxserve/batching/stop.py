"""A request's output text and its stop conditions.

Stop strings are matched on the detokenized text, so one can span several tokens. Text that could
still turn into a stop string (the last `len(longest stop string) - 1` characters) is held back, so
the client never sees any part of a stop string: when one appears, the text is cut just before it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from jaxserve.config import SamplingParams


class Detokenizer(Protocol):
  """jaxserve.text.detokenizer.IncrementalDetokenizer, as used here."""

  def add(self, token_ids: Sequence[int]) -> str:
    """New text for new tokens; never ends in part of a character."""
    ...

  def flush(self) -> str:
    ...


class OutputText:

  def __init__(self, detokenizer: Detokenizer, sampling: SamplingParams, eos_ids: frozenset[int]):
    self._detokenizer = detokenizer
    self._stop = sampling.stop
    self._num_held = max(map(len, self._stop), default=1) - 1
    self.stop_token_ids = frozenset(sampling.stop_token_ids) | (
        frozenset() if sampling.ignore_eos else eos_ids)
    self.stop_string: str | None = None  # Set once one has been found.
    self.text = ""  # All the text so far, cut before the stop string if there is one.
    self._num_sent = 0

  def add(self, token_ids: Sequence[int]) -> str:
    """Takes new output tokens; returns the text that is now safe to send."""
    self._extend(self._detokenizer.add(token_ids))
    held = 0 if self.stop_string is not None else self._num_held
    return self._release(len(self.text) - held)

  def finish(self) -> str:
    """The request ended: everything not sent yet (still cut at a stop string)."""
    if self.stop_string is None:
      self._extend(self._detokenizer.flush())
    return self._release(len(self.text))

  def _extend(self, delta: str) -> None:
    if not delta:
      return
    start = len(self.text)
    self.text += delta
    if self._stop:
      self._cut_at_stop(start)

  def _cut_at_stop(self, start: int) -> None:
    """Finds the earliest stop string that ends in text[start:]. It cannot begin in text already
    sent: what is sent stops at least len(stop) - 1 characters before the end."""
    best, found = len(self.text), None
    for stop in self._stop:
      i = self.text.find(stop, max(0, start - len(stop) + 1))
      if 0 <= i < best:
        best, found = i, stop
    if found is not None:
      self.text, self.stop_string = self.text[:best], found

  def _release(self, end: int) -> str:
    if end <= self._num_sent:
      return ""
    delta = self.text[self._num_sent:end]
    self._num_sent = end
    return delta

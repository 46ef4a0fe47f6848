"""Streams generated token ids out as text, one delta at a time.

Decoding each token alone is wrong twice over: a character can span several tokens (byte-level
BPE pieces, SentencePiece `<0xNN>` byte fallback), and some decoders treat a sequence's first
token specially (a SentencePiece dummy-prefix space is dropped). So every step decodes a short
window of ids twice, as vLLM does: the ids before the read offset (text already emitted) and the
same ids plus the new ones; the delta is what the second adds. The window starts at the previous
delta's first id, so it stays a few tokens long however long the sequence grows.

A window whose text ends in U+FFFD ends inside a character that later ids may complete, so it is
held back until they arrive (or until `flush`, at the end of the sequence).

The deltas of a sequence concatenate to `tokenizer.detokenize(output_ids)`, with one deliberate
exception: given prompt ids, a dummy-prefix SentencePiece tokenizer (Llama 2) keeps the first
output token's leading space, the space between prompt and answer that decoding the output
alone drops.
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.text.tokenizer import Tokenizer

# Prompt ids decoded in front of the first output ids: enough for the first output token to
# decode as it does mid-sequence (e.g. keep its leading space), few enough to stay cheap.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"  # What a decoder writes for bytes that are not (yet) a whole character.


class IncrementalDetokenizer:
  """Text deltas for one sequence; concatenated with `flush()` they equal its full decode."""

  def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *,
               skip_special_tokens: bool = True):
    self._tokenizer = tokenizer
    self._skip_special_tokens = skip_special_tokens
    context = [int(i) for i in prompt_ids[-_CONTEXT_TOKENS:]]
    context_text = self._decode(context)
    if context_text.endswith(_REPLACEMENT):  # A prompt cut mid-character: no clean boundary.
      context, context_text = [], ""
    self._ids = context  # The window: ids from the prefix offset on.
    self._read_offset = len(context)  # Ids before it are already emitted (or are the prompt).
    self._prefix_text = context_text  # The decode of ids[:read_offset].
    self.text = ""

  def add(self, token_ids: Sequence[int]) -> str:
    """Appends `token_ids`; returns the text they complete (possibly "")."""
    self._ids.extend(int(i) for i in token_ids)
    window_text = self._decode(self._ids)
    if window_text.endswith(_REPLACEMENT) or len(window_text) <= len(self._prefix_text):
      return ""
    return self._emit(window_text)

  def flush(self) -> str:
    """At the end of the sequence: the held-back text, incomplete characters and all."""
    window_text = self._decode(self._ids)
    if len(window_text) <= len(self._prefix_text):
      return ""
    return self._emit(window_text)

  def _emit(self, window_text: str) -> str:
    delta = window_text[len(self._prefix_text):]
    # The ids just emitted become the next window's prefix; everything before them is dropped.
    del self._ids[:self._read_offset]
    self._read_offset = len(self._ids)
    self._prefix_text = self._decode(self._ids)
    self.text += delta
    return delta

  def _decode(self, ids: Sequence[int]) -> str:
    return self._tokenizer.detokenize(ids, skip_special_tokens=self._skip_special_tokens)

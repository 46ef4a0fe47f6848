"""A jaxserve Tokenizer's vocabulary as the bytes each token stands for, which grammar engines need.

Byte-level BPE vocabularies spell bytes as GPT-2's printable stand-ins ("Ġ" is a space);
SentencePiece ones write "▁" for a space and "<0x0A>" for a raw byte. Special tokens are kept
apart: text never spells them, so "<|im_end|>" written inside a JSON string is those characters,
not the end-of-turn token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import llguidance


def llguidance_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
  """llguidance's view of `tokenizer`; its end-of-sequence tokens are the tokenizer's stop ids."""
  token_bytes, special_ids = vocab_bytes(tokenizer)
  return llguidance.LLTokenizer(
      llguidance.TokenizerWrapper(_VocabView(tokenizer, token_bytes, special_ids)),
      eos_token=sorted(tokenizer.stop_ids))


@dataclasses.dataclass(frozen=True)
class _VocabView:
  """The shape of tokenizer llguidance.TokenizerWrapper reads: token bytes, ids, and encode."""

  tokenizer: Any
  tokens: list[bytes]
  special_token_ids: list[int]

  @property
  def eos_token_id(self) -> int | None:
    return self.tokenizer.eos_id

  @property
  def bos_token_id(self) -> int | None:
    return self.tokenizer.bos_id

  def __call__(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_bos=False)


def vocab_bytes(tokenizer: Any) -> tuple[list[bytes], list[int]]:
  """The bytes each token id stands for, and the ids of the special tokens (those that decode to
  nothing unless special tokens are shown). Which spelling a vocabulary uses shows in its tokens:
  nearly all of a byte-level one's use only the 256 stand-ins."""
  spellings = [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)]
  stand_in = _byte_stand_ins()
  num_byte_level = sum(all(c in stand_in for c in s) for s in spellings)
  if num_byte_level >= 0.9 * len(spellings):
    token_bytes = [bytes(stand_in[c] for c in s) if all(c in stand_in for c in s) else s.encode()
                   for s in spellings]
  else:
    token_bytes = [_sentencepiece_bytes(s) for s in spellings]
  return token_bytes, _special_ids(tokenizer,
                                   token_bytes.index(b"\0") if b"\0" in token_bytes else None)


def _special_ids(tokenizer: Any, nul_id: int | None, chunk: int = 4096) -> list[int]:
  """Ids that decode to nothing with special tokens skipped, and to something without skipping.

  One decode call per token takes seconds for a 262k vocabulary, so tokens are decoded a chunk at
  a time, each followed by the NUL byte's token, and the text split at the NULs. A chunk whose
  split does not come out even (a token that spells a NUL itself) is decoded token by token; every
  empty piece is confirmed on its own (SentencePiece drops the space a chunk's first token opens
  with).
  """
  empty = []
  for start in range(0, tokenizer.vocab_size, chunk):
    ids = range(start, min(start + chunk, tokenizer.vocab_size))
    pieces = None
    if nul_id is not None:
      pieces = tokenizer.detokenize([t for i in ids for t in (i, nul_id)], True).split("\0")[:-1]
    if pieces is None or len(pieces) != len(ids):
      pieces = [tokenizer.detokenize([i], True) for i in ids]
    empty += [i for i, piece in zip(ids, pieces) if not piece]
  return [i for i in empty
          if not tokenizer.detokenize([i], True) and tokenizer.detokenize([i], False)]


def spelling_bytes(spelling: str) -> bytes:
  """The bytes one token's vocabulary spelling stands for, either kind of vocabulary (for a
  token whose text alone cannot say: a piece of a multi-byte character decodes to U+FFFD)."""
  if spelling.startswith("<0x") and len(spelling) == 6:
    return _sentencepiece_bytes(spelling)
  stand_in = _byte_stand_ins()
  if all(c in stand_in for c in spelling):
    return bytes(stand_in[c] for c in spelling)
  return _sentencepiece_bytes(spelling)


@functools.cache
def _byte_stand_ins() -> dict[str, int]:
  """GPT-2's byte-to-character table, inverted: printable Latin-1 bytes stand for themselves,
  the other 68 (controls, space, a few Latin-1 gaps) for U+0100, U+0101, ... in byte order."""
  printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  others = [b for b in range(256) if b not in set(printable)]
  table = {chr(b): b for b in printable}
  table.update({chr(0x100 + n): b for n, b in enumerate(others)})
  return table


def _sentencepiece_bytes(piece: str) -> bytes:
  if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
    try:
      return bytes([int(piece[3:5], 16)])
    except ValueError:
      pass
  return piece.replace("\u2581", " ").encode()

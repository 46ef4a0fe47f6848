"""The two tokenizer backends behind `jaxserve.text.tokenizer.Tokenizer`, and their GGUF builders.

- byte-level BPE (a GGUF `gpt2` vocab, or any Hugging Face `tokenizer.json`) runs in `tokenizers`;
- SentencePiece (`tokenizer.model`, or a GGUF `llama` vocab rebuilt into a model proto) runs in
  `sentencepiece`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Mapping, Protocol, Sequence

import gguf
import numpy as np
import sentencepiece as spm
import tokenizers
from absl import logging
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from tokenizers import decoders, pre_tokenizers


class _Backend(Protocol):
  vocab_size: int

  def encode(self, text: str) -> list[int]: ...
  def detokenize(self, ids: list[int], skip_special_tokens: bool) -> str: ...
  def token_to_id(self, token: str) -> int | None: ...
  def id_to_token(self, token_id: int) -> str: ...
  def adds_bos(self, bos_id: int | None) -> bool: ...  # The default when no config says.
  def save(self, d: pathlib.Path) -> None: ...


class _HFBackend:
  """A `tokenizers.Tokenizer`: byte-level BPE, or whatever a tokenizer.json describes."""

  def __init__(self, tok: tokenizers.Tokenizer):
    self._tok = tok
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    # A batch of one: unlike encode, encode_batch releases the GIL, so the server's event loop
    # keeps answering while a worker tokenizes a long prompt (0.3 s for 160k digits).
    return self._tok.encode_batch([text], add_special_tokens=False)[0].ids  # BOS is ours to add.

  def detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
    return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def id_to_token(self, token_id: int) -> str:
    return self._tok.id_to_token(token_id)

  def adds_bos(self, bos_id: int | None) -> bool:
    # The tokenizer.json post-processor (e.g. Llama 3's) is the only record of the HF default.
    return bos_id is not None and self._tok.encode("a").ids[:1] == [bos_id]

  def save(self, d: pathlib.Path) -> None:
    self._tok.save(str(d / "tokenizer.json"))


_Piece = sp_pb2.ModelProto.SentencePiece


class _SentencePieceBackend:
  """A SentencePiece model proto, run by `sentencepiece`."""

  def __init__(self, proto: sp_pb2.ModelProto):
    self._proto = proto  # Saved unchanged; the processor below runs a patched copy.
    specials = [i for i, p in enumerate(proto.pieces) if p.type in (_Piece.CONTROL, _Piece.UNKNOWN)]
    self._special_ids = frozenset(specials)
    runtime = sp_pb2.ModelProto()
    runtime.CopyFrom(proto)
    # SentencePiece never matches a control piece in text and decodes it to "", but a prompt
    # that spells "<start_of_turn>" must get its id, and decode(skip_special_tokens=False) must
    # print it (as HF does). As user-defined pieces they do both; skipping is done by id here.
    for i in specials:
      if runtime.pieces[i].type == _Piece.CONTROL:
        runtime.pieces[i].type = _Piece.USER_DEFINED
      else:  # HF prints "<unk>" where sentencepiece would print " \u2047 ".
        runtime.trainer_spec.unk_surface = runtime.pieces[i].piece
    self._sp = spm.SentencePieceProcessor(model_proto=runtime.SerializeToString())
    self.vocab_size = self._sp.get_piece_size()

  @classmethod
  def from_file(cls, path: pathlib.Path) -> _SentencePieceBackend:
    proto = sp_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    return cls(proto)

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
    # Ids past the vocab (a model's padded embedding rows) decode to nothing, as in `tokenizers`.
    skipped = self._special_ids if skip_special_tokens else frozenset()
    return self._sp.decode([i for i in ids if 0 <= i < self.vocab_size and i not in skipped])

  def token_to_id(self, token: str) -> int | None:
    token_id = self._sp.piece_to_id(token)  # Unknown pieces map to the unk id.
    return token_id if self._sp.id_to_piece(token_id) == token else None

  def id_to_token(self, token_id: int) -> str:
    return self._sp.id_to_piece(token_id)

  def adds_bos(self, bos_id: int | None) -> bool:
    return bos_id is not None  # The Llama and Gemma SentencePiece convention.

  def save(self, d: pathlib.Path) -> None:
    (d / "tokenizer.model").write_bytes(self._proto.SerializeToString())


@dataclasses.dataclass(frozen=True)
class _PreTokenizer:
  """How a byte-level BPE vocab splits text into words before merging."""

  regex: str
  split_digits: bool = False  # Every digit is its own word before the regex runs.
  ignore_merges: bool = False  # A word that is itself a token is used whole (Llama 3).


_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
# Keyed by the GGUF `tokenizer.ggml.pre` names llama.cpp writes.
_GGUF_PRE_TOKENIZERS = {
    "default": _PreTokenizer(_GPT2_REGEX),
    "gpt-2": _PreTokenizer(_GPT2_REGEX),
    "smollm": _PreTokenizer(_GPT2_REGEX, split_digits=True),
    "starcoder": _PreTokenizer(_GPT2_REGEX, split_digits=True),
    "refact": _PreTokenizer(_GPT2_REGEX, split_digits=True),
    "llama-bpe": _PreTokenizer(_LLAMA3_REGEX, ignore_merges=True),
    "qwen2": _PreTokenizer(_QWEN2_REGEX),
}


def _bpe_from_gguf(meta: Mapping[str, Any]) -> _HFBackend:
  """A GGUF `gpt2` vocab (byte-level tokens, merges, token types) as a `tokenizers` BPE."""
  pre_name = meta.get("tokenizer.ggml.pre", "default")
  pre = _GGUF_PRE_TOKENIZERS.get(pre_name)
  if pre is None:
    logging.warning("GGUF pre-tokenizer %r is unknown; splitting words like GPT-2", pre_name)
    pre = _GGUF_PRE_TOKENIZERS["default"]
  tokens = meta["tokenizer.ggml.tokens"]
  vocab = {}
  for i, token in enumerate(tokens):
    vocab.setdefault(token, i)
  merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
  steps = [pre_tokenizers.Digits(individual_digits=True)] if pre.split_digits else []
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      *steps, pre_tokenizers.Split(tokenizers.Regex(pre.regex), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  # Control and user-defined tokens are stored as raw text, matched before any splitting.
  types = np.asarray(meta["tokenizer.ggml.token_type"])
  tok.add_special_tokens(_added_tokens(tokens, types == gguf.TokenType.CONTROL, special=True))
  tok.add_tokens(_added_tokens(tokens, types == gguf.TokenType.USER_DEFINED, special=False))
  return _HFBackend(tok)


def _added_tokens(tokens: Sequence[str], mask: np.ndarray, *,
                  special: bool) -> list[tokenizers.AddedToken]:
  return [tokenizers.AddedToken(tokens[i], special=special, normalized=False)
          for i in np.flatnonzero(mask)]


def _sentencepiece_from_gguf(meta: Mapping[str, Any]) -> _SentencePieceBackend:
  """A GGUF `llama` vocab (pieces, scores, token types) rebuilt into a SentencePiece BPE proto."""
  proto = sp_pb2.ModelProto()
  types = np.asarray(meta["tokenizer.ggml.token_type"])
  scores = np.asarray(meta["tokenizer.ggml.scores"], np.float32).tolist()
  for token, score, kind in zip(meta["tokenizer.ggml.tokens"], scores, types.tolist()):
    # GGUF token types are SentencePiece's piece types, number for number (0 = undefined).
    kind = kind if _Piece.NORMAL <= kind <= _Piece.BYTE else _Piece.NORMAL
    if kind == _Piece.USER_DEFINED:  # llama.cpp wrote their "\u2581"s back as spaces.
      token = token.replace(" ", "\u2581")
    proto.pieces.add(piece=token, score=score, type=kind)
  spec = proto.trainer_spec
  spec.model_type = sp_pb2.TrainerSpec.BPE  # llama.cpp's SPM merges by score, like SP's BPE.
  spec.vocab_size = len(proto.pieces)
  spec.byte_fallback = int(np.sum(types == _Piece.BYTE)) == 256
  unk = np.flatnonzero(types == _Piece.UNKNOWN)
  spec.unk_id = meta.get("tokenizer.ggml.unknown_token_id", int(unk[0]) if len(unk) else 0)
  # Gemma 3's GGUF types <unk> as control; sentencepiece needs its one unknown piece.
  proto.pieces[spec.unk_id].type = _Piece.UNKNOWN
  spec.bos_id = meta.get("tokenizer.ggml.bos_token_id", -1)
  spec.eos_id = meta.get("tokenizer.ggml.eos_token_id", -1)
  spec.pad_id = meta.get("tokenizer.ggml.padding_token_id", -1)
  norm = proto.normalizer_spec
  norm.name = "identity"  # llama.cpp applies no Unicode normalization.
  norm.add_dummy_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
  norm.remove_extra_whitespaces = False
  norm.escape_whitespaces = True
  return _SentencePieceBackend(proto)


# ---------------------------------------------------------------------------------------------
# GGUF metadata. gguf.GGUFReader builds numpy views per array element: 28 s for Gemma 3's 262k
# token strings on this machine. Reading the key/value section directly takes well under 1 s.

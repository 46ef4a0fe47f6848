"""Text <-> token ids for every model jaxserve loads, plus chat templates.

Two backends sit behind one `Tokenizer`:
- byte-level BPE (a GGUF `gpt2` vocab, or any Hugging Face `tokenizer.json`) runs in `tokenizers`;
- SentencePiece (`tokenizer.model`, or a GGUF `llama` vocab rebuilt into a model proto) runs in
  `sentencepiece`.
Both are saved the way Hugging Face stores them, so `save()` then `from_hf_dir()` round-trips and
our checkpoints carry a tokenizer any HF tool can read.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import mmap
import pathlib
import struct
from typing import Any, Mapping, Protocol, Sequence

from absl import logging
import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
import tokenizers
from tokenizers import decoders, pre_tokenizers

# Tokens that end a chat turn (or a document) in the model families we serve; generation stops
# on any of them that the vocab has, not just on the one EOS id the metadata names.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>",
                      "<|end_of_text|>", "<|end|>")
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class Tokenizer:
  """Encodes, decodes and renders chats; built by `from_gguf` or `from_hf_dir`."""

  def __init__(self, backend: _Backend, *, bos_id: int | None, eos_id: int | None,
               add_bos: bool, chat_template: str | None, extra_stop_ids: Sequence[int] = ()):
    self._backend = backend
    self.vocab_size: int = backend.vocab_size
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.add_bos = add_bos and bos_id is not None
    self.chat_template = chat_template
    turn_ends = (backend.token_to_id(t) for t in END_OF_TURN_TOKENS)
    stops = {i for i in (eos_id, *extra_stop_ids, *turn_ends) if i is not None}
    self.stop_ids: frozenset[int] = frozenset(stops)
    self._compiled_template: jinja2.Template | None = None

  @classmethod
  def from_gguf(cls, path: str | pathlib.Path) -> Tokenizer:
    meta = read_gguf_metadata(path, prefix="tokenizer.")
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
      backend = _bpe_from_gguf(meta)
    elif kind == "llama":
      backend = _sentencepiece_from_gguf(meta)
    else:
      raise ValueError(f"{path}: unsupported GGUF tokenizer model {kind!r} (want gpt2 or llama)")
    # llama.cpp's default when the key is absent: SentencePiece vocabs add BOS, BPE ones do not.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    extra = (meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
    return cls(backend, bos_id=meta.get("tokenizer.ggml.bos_token_id"),
               eos_id=meta.get("tokenizer.ggml.eos_token_id"), add_bos=bool(add_bos),
               chat_template=meta.get("tokenizer.chat_template"),
               extra_stop_ids=[i for i in extra if i is not None])

  @classmethod
  def from_hf_dir(cls, path: str | pathlib.Path) -> Tokenizer:
    d = pathlib.Path(path)
    if (d / "tokenizer.json").exists():
      backend = _HFBackend(tokenizers.Tokenizer.from_file(str(d / "tokenizer.json")))
    elif (d / "tokenizer.model").exists():
      backend = _SentencePieceBackend.from_file(d / "tokenizer.model")
    else:
      raise FileNotFoundError(f"{d}: no tokenizer.json or tokenizer.model")
    cfg = _read_json(d / "tokenizer_config.json")
    token_names = {**_read_json(d / "special_tokens_map.json"), **cfg}
    model_cfg = {**_read_json(d / "config.json"), **_read_json(d / "generation_config.json")}
    eos_ids = _as_list(model_cfg.get("eos_token_id"))
    bos_id = _special_id(cfg, token_names, "bos", backend, _as_list(model_cfg.get("bos_token_id")))
    eos_id = _special_id(cfg, token_names, "eos", backend, eos_ids)
    add_bos = cfg.get("add_bos_token", backend.adds_bos(bos_id))
    return cls(backend, bos_id=bos_id, eos_id=eos_id, add_bos=bool(add_bos),
               chat_template=_hf_chat_template(d, cfg),
               extra_stop_ids=[*eos_ids, *cfg.get("stop_token_ids", ())])

  def save(self, path: str | pathlib.Path) -> None:
    """Writes tokenizer.json or tokenizer.model, and tokenizer_config.json, into directory `path`."""
    d = pathlib.Path(path)
    d.mkdir(parents=True, exist_ok=True)
    self._backend.save(d)
    config = {
        "bos_token": self._token(self.bos_id), "eos_token": self._token(self.eos_id),
        "bos_token_id": self.bos_id, "eos_token_id": self.eos_id,
        "stop_token_ids": sorted(self.stop_ids), "add_bos_token": self.add_bos,
        "chat_template": self.chat_template,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Special tokens written in `text` (e.g. "<|im_start|>") become their single ids."""
    ids = self._backend.encode(text)
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids.insert(0, self.bos_id)
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self._backend.decode([int(i) for i in ids], skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self._backend.token_to_id(token)

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True) -> str:
    """Renders `messages` ({"role", "content"} dicts) with the model's jinja2 chat template."""
    _check_messages(messages)
    template = self._template()
    try:
      return template.render(messages=[dict(m) for m in messages],
                             add_generation_prompt=add_generation_prompt,
                             bos_token=self._token(self.bos_id) or "",
                             eos_token=self._token(self.eos_id) or "")
    except jinja2.TemplateError as e:
      raise ValueError(f"chat template failed: {e}") from e

  def _template(self) -> jinja2.Template:
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template; send a raw prompt instead")
    if self._compiled_template is None:
      self._compiled_template = _jinja_env().from_string(self.chat_template)
    return self._compiled_template

  def _token(self, token_id: int | None) -> str | None:
    return None if token_id is None else self._backend.id_to_token(token_id)


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
  if isinstance(messages, (str, bytes)) or not messages:
    raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
  for n, m in enumerate(messages):
    if not isinstance(m, Mapping):
      raise ValueError(f"messages[{n}] must be a dict, got {type(m).__name__}")
    if m.get("role") not in CHAT_ROLES:
      raise ValueError(f"messages[{n}] has role {m.get('role')!r}; want one of "
                       f"{sorted(CHAT_ROLES)}")
    if not isinstance(m.get("content"), str):
      raise ValueError(f"messages[{n}] ({m['role']}) has no string 'content'")


def _raise_exception(message: str):
  # Templates call raise_exception() to reject conversations they cannot render (HF convention).
  raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
  # Like HF's: keeps non-ASCII text readable rather than jinja's HTML-escaping tojson.
  return json.dumps(value, ensure_ascii=False, indent=indent)


def _jinja_env() -> jinja2.Environment:
  # Sandboxed: a chat template ships inside a downloaded model file and is not trusted code.
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


def _read_json(path: pathlib.Path) -> dict[str, Any]:
  return json.loads(path.read_text()) if path.exists() else {}


def _as_list(value: int | Sequence[int] | None) -> list[int]:
  if value is None:
    return []
  return [value] if isinstance(value, int) else list(value)


def _special_id(cfg: Mapping[str, Any], names: Mapping[str, Any], kind: str,
                backend: _Backend, fallback_ids: Sequence[int]) -> int | None:
  """BOS or EOS: our explicit id, else the named token of the HF configs, else config.json's."""
  if f"{kind}_token_id" in cfg:
    return cfg[f"{kind}_token_id"]
  name = names.get(f"{kind}_token")
  if isinstance(name, Mapping):  # HF writes AddedToken dicts here too.
    name = name.get("content")
  token_id = backend.token_to_id(name) if isinstance(name, str) else None
  if token_id is None and fallback_ids:
    token_id = fallback_ids[0]
  return token_id


def _hf_chat_template(d: pathlib.Path, cfg: Mapping[str, Any]) -> str | None:
  template = cfg.get("chat_template")
  if isinstance(template, list):  # Named templates: [{"name": "default", "template": ...}, ...]
    named = {t["name"]: t["template"] for t in template}
    template = named.get("default", next(iter(named.values()), None))
  if template is None and (d / "chat_template.jinja").exists():
    template = (d / "chat_template.jinja").read_text()
  if template is None and (d / "chat_template.json").exists():
    template = _read_json(d / "chat_template.json").get("chat_template")
  return template


# ---------------------------------------------------------------------------------------------
# Backends: the two tokenizer engines behind `Tokenizer`, with one small interface.


class _Backend(Protocol):
  vocab_size: int

  def encode(self, text: str) -> list[int]: ...
  def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...
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
    return self._tok.encode(text, add_special_tokens=False).ids  # BOS is ours to add.

  def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
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

  def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
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

_V = gguf.GGUFValueType
_GGUF_DTYPES = {_V.UINT8: "<u1", _V.INT8: "<i1", _V.UINT16: "<u2", _V.INT16: "<i2",
                _V.UINT32: "<u4", _V.INT32: "<i4", _V.FLOAT32: "<f4", _V.BOOL: "?",
                _V.UINT64: "<u8", _V.INT64: "<i8", _V.FLOAT64: "<f8"}


def read_gguf_metadata(path: str | pathlib.Path, prefix: str = "") -> dict[str, Any]:
  """The GGUF key/values whose key starts with `prefix`; numeric arrays come as numpy arrays."""
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
    magic, version, _, num_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
      raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file")
    meta, pos = {}, 24
    for _ in range(num_kv):
      key, pos = _gguf_string(buf, pos)
      (kind,) = struct.unpack_from("<I", buf, pos)
      value, pos = _gguf_value(buf, pos + 4, _V(kind))
      if key.startswith(prefix):
        meta[key] = value
  return meta


def _gguf_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
  (n,) = struct.unpack_from("<Q", buf, pos)
  return buf[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n


def _gguf_value(buf: mmap.mmap, pos: int, kind: gguf.GGUFValueType) -> tuple[Any, int]:
  if kind == _V.STRING:
    return _gguf_string(buf, pos)
  if kind != _V.ARRAY:
    dtype = np.dtype(_GGUF_DTYPES[kind])
    return np.frombuffer(buf[pos:pos + dtype.itemsize], dtype)[0].item(), pos + dtype.itemsize
  item_kind, count = struct.unpack_from("<IQ", buf, pos)
  pos += 12
  if _V(item_kind) in _GGUF_DTYPES:
    dtype = np.dtype(_GGUF_DTYPES[_V(item_kind)])
    end = pos + count * dtype.itemsize
    return np.frombuffer(buf[pos:end], dtype), end
  items = []
  for _ in range(count):
    item, pos = _gguf_value(buf, pos, _V(item_kind))
    items.append(item)
  return items, pos

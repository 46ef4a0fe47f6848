"""Text <-> token ids for every model jaxserve loads, plus chat templates.

Two backends (`tokenizer_backends.py`) sit behind one `Tokenizer`: byte-level BPE in `tokenizers`
and SentencePiece in `sentencepiece`. Both are saved the way Hugging Face stores them, so `save()`
then `from_hf_dir()` round-trips and our checkpoints carry a tokenizer any HF tool can read.
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from jaxserve.gguf_metadata import read_gguf_metadata
from jaxserve.text import chat_templates
from jaxserve.text.tokenizer_backends import (
  _Backend,
  _bpe_from_gguf,
  _HFBackend,
  _sentencepiece_from_gguf,
  _SentencePieceBackend,
)

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
               chat_template=meta.get("tokenizer.chat_template") or chat_templates.fallback(
                   backend.token_to_id, str(path)),
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
               chat_template=_hf_chat_template(d, cfg) or chat_templates.fallback(
                   backend.token_to_id, str(d)),
               extra_stop_ids=[*eos_ids, *cfg.get("stop_token_ids", ())])

  def save(self, path: str | pathlib.Path) -> None:
    """Writes tokenizer.json or tokenizer.model, and tokenizer_config.json, into directory
    `path`."""
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

  @functools.cached_property
  def max_token_chars(self) -> int:
    """The longest text one token stands for (81 characters for SmolLM2, 31 for Gemma 3)."""
    return max(len(self._backend.detokenize([i], False)) for i in range(self.vocab_size))

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    """Special tokens written in `text` (e.g. "<|im_start|>") become their single ids."""
    ids = self._backend.encode(text)
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids.insert(0, self.bos_id)
    return ids

  def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self._backend.detokenize([int(i) for i in ids], skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self._backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str:
    """The vocabulary's spelling of one token (byte-level "Ġthe", SentencePiece "▁the")."""
    return self._backend.id_to_token(token_id)

  @property
  def takes_tools(self) -> bool:
    """The chat template renders a `tools` list itself (Hugging Face's convention)."""
    return self.chat_template is not None and "tools" in self.chat_template

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True,
                          tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """Renders `messages` ({"role", "content"} dicts) with the model's jinja2 chat template;
    `tools` (OpenAI's function definitions) go to a template that `takes_tools`."""
    _check_messages(messages)
    template = self._template()
    extra = {"tools": [{"type": "function", "function": dict(t)} for t in tools]} if tools else {}
    try:
      return template.render(messages=[dict(m) for m in messages], **extra,
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
    content = m.get("content")
    if not (isinstance(content, str) or _are_parts(content)):
      raise ValueError(f"messages[{n}] ({m['role']}) has no string 'content' (nor a list of "
                       "{'type': 'text', 'text'} and {'type': 'image'} parts)")


def _are_parts(content: Any) -> bool:
  """Content as transformers' multimodal templates take it: text parts and image placeholders."""
  return isinstance(content, list) and all(
      isinstance(p, Mapping) and (p.get("type") == "image" or (
          p.get("type") == "text" and isinstance(p.get("text"), str))) for p in content)


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

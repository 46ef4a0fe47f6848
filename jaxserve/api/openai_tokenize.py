"""vLLM's tokenizer routes, as lm-eval's remote tokenizer and other clients call them.

  POST /tokenize        {"prompt": str} or {"messages": [...]} (image parts too: each image's
                        placeholder expanded as for generation), optional model,
                        add_special_tokens, add_generation_prompt (chat), return_token_strs
                        -> {"count", "max_model_len", "tokens", "token_strs"}
  POST /detokenize      {"tokens": [ids]} -> {"prompt": text}
  GET  /tokenizer_info  the tokenizer's class, special tokens and chat template

The same tokenizer, chat template and checks as generation (serving/prepare.py's
PromptPreparer.encode), so the ids a client counts here are the ids a completion would run.
Every function raises only `ApiError`.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxserve.api import openai_prompt
from jaxserve.config import short
from jaxserve.serving import client_fields
from jaxserve.serving.gateway import invalid
from jaxserve.serving.requests import Prompt
from jaxserve.serving.service import Service

_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens",
                              "add_generation_prompt", "return_token_strs"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tokenize(service: Service, body: Mapping[str, Any]) -> dict[str, Any]:
  body = _known(body, _TOKENIZE_FIELDS, "/tokenize")
  service.check_model(body.get("model", ""))
  flags = {f: body.get(f, d) for f, d in (("add_special_tokens", "prompt" in body),
                                          ("add_generation_prompt", True),
                                          ("return_token_strs", False))}
  for field, value in flags.items():
    if not isinstance(value, bool):
      raise invalid(f"{field} must be true or false, got {short(value)}")
  if ("prompt" in body) == ("messages" in body):
    raise invalid("/tokenize takes exactly one of prompt (a string) or messages")
  if "prompt" in body:
    if not isinstance(body["prompt"], str):
      raise invalid(f"prompt must be a string, got {short(body['prompt'])}")
    prompt = Prompt(text=openai_prompt.unicode_text(body["prompt"], "prompt"))
  else:
    prompt = openai_prompt.chat_prompt(body)
  # True is Hugging Face's meaning: the special tokens the tokenizer adds by default (BOS or none).
  ids = service.prompts.encode(
      prompt, add_special_tokens=None if flags["add_special_tokens"] else False,
      add_generation_prompt=flags["add_generation_prompt"])
  strs = [service.tokenizer.id_to_token(i) for i in ids] if flags["return_token_strs"] else None
  return {"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids,
          "token_strs": strs}


def detokenize(service: Service, body: Mapping[str, Any]) -> dict[str, Any]:
  body = _known(body, _DETOKENIZE_FIELDS, "/detokenize")
  service.check_model(body.get("model", ""))
  tokens = body.get("tokens")
  if not isinstance(tokens, list):
    raise invalid(f"tokens must be a list of token ids, got {short(tokens)}")
  if len(tokens) > service.max_model_len:  # Before reading them one by one.
    raise invalid(f"tokens: at most {service.max_model_len} ids (the context window), "
                  f"got {len(tokens):,}")
  client_fields.check_token_ids(tokens, service.vocab_size, "tokens")
  return {"prompt": service.tokenizer.detokenize(tokens)}


def tokenizer_info(service: Service) -> dict[str, Any]:
  tok = service.tokenizer
  spell = lambda i: None if i is None else tok.id_to_token(i)
  return {"tokenizer_class": type(tok).__name__, "vocab_size": service.vocab_size,
          "model_max_length": service.max_model_len, "bos_token": spell(tok.bos_id),
          "eos_token": spell(tok.eos_id), "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
          "add_bos_token": tok.add_bos, "stop_token_ids": sorted(tok.stop_ids),
          "chat_template": tok.chat_template}


def _known(body: Mapping[str, Any], fields: frozenset[str], route: str) -> dict[str, Any]:
  body = {k: v for k, v in body.items() if v is not None}
  unknown = sorted(set(body) - fields)
  if unknown:
    raise invalid(f"{route} does not take {', '.join(short(k, 40) for k in unknown[:8])}; "
                  f"its fields are {', '.join(sorted(fields))}")
  return body

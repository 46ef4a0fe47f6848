"""Client fields -> what the engine runs: `SamplingParams`, checked token ids, a prompt fitted to
the context window. Each bad field is an INVALID_ARGUMENT naming it (gateway.ApiError), the same
from either front end."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from jaxserve.config import SamplingParams, is_int, short
from jaxserve.serving.gateway import invalid

MAX_CHUNK_TOKENS = 4096
MAX_REQUEST_ID_CHARS = 256
MAX_MESSAGES = 2048  # Chat messages in one request (each costs template and tokenizer work).
# What a client may set; max_tokens and logprobs are checked on their own, against the context;
# pooling is the embedding endpoints' own.
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {
    "max_tokens", "logprobs", "pooling"}


def check_num_messages(n: int) -> None:
  """Raises the 400 for a chat of more than MAX_MESSAGES messages (both front ends)."""
  if n > MAX_MESSAGES:
    raise invalid(f"messages: at most {MAX_MESSAGES} in one request, got {n:,}")

def sampling_params(fields: Mapping[str, Any], max_tokens: int,
                    logprobs: int | None) -> SamplingParams:
  """SamplingParams from the fields a client set (all but max_tokens and logprobs, which come
  apart); ValueError/TypeError become INVALID_ARGUMENT with SamplingParams' own message, which
  names the field and its value."""
  unknown = set(fields) - _SAMPLING_FIELDS
  if unknown:
    raise invalid(f"unknown sampling fields {sorted(map(str, unknown))}")
  if logprobs is not None and not (is_int(logprobs)
                                   and 0 <= logprobs <= SamplingParams.MAX_LOGPROBS):
    raise invalid(f"logprobs must be in [0, {SamplingParams.MAX_LOGPROBS}], got {short(logprobs)}")
  # The engine reports logprobs for requests that ask for at least one top token; the front end
  # drops the alternatives of a request that asked for the chosen token's logprob only.
  num_top = 0 if logprobs is None else max(logprobs, 1)
  try:
    return SamplingParams(**fields, max_tokens=max_tokens, logprobs=num_top)
  except (ValueError, TypeError) as e:
    raise invalid(str(e)) from e


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
  for n, i in enumerate(ids):
    if not is_int(i):
      raise invalid(f"{field}[{n}] must be a token id (an int), got {short(i)}")
    if not 0 <= i < vocab_size:
      raise invalid(f"{field}[{n}] is {short(i)}, outside the vocabulary [0, {vocab_size})")


def check_bias_ids(sampling: SamplingParams, vocab_size: int) -> None:
  """logit_bias' ids against the vocabulary (SamplingParams checked their types and count)."""
  for token, _ in sampling.logit_bias:
    if token >= vocab_size:
      raise invalid(f"logit_bias has token id {token}, outside the vocabulary [0, {vocab_size})")


def allowed_token_ids(ids: Any, vocab_size: int) -> Any:
  """vLLM's allowed_token_ids, deduplicated (sorted): at most the vocabulary's size of them,
  counted before any is read, each an id in it. Not a list: as given, for SamplingParams to
  refuse by name."""
  if not isinstance(ids, (list, tuple)):
    return ids
  if len(ids) > vocab_size:
    raise invalid(f"allowed_token_ids: at most {vocab_size:,} ids (the vocabulary's size), got "
                  f"{len(ids):,}")
  check_token_ids(ids, vocab_size, "allowed_token_ids")
  return tuple(sorted(set(ids)))


def check_stop_token_ids(ids: Any, vocab_size: int) -> None:
  """The vocabulary bound SamplingParams cannot know; it checks the rest (the type, the count)."""
  if isinstance(ids, (list, tuple)) and len(ids) <= SamplingParams.MAX_STOP_TOKEN_IDS:
    check_token_ids(ids, vocab_size, "stop_token_ids")


def checked_sampling_fields(fields: Mapping[str, Any], vocab_size: int) -> Mapping[str, Any]:
  """The request's SamplingParams fields with their token ids checked against the vocabulary
  (stop_token_ids, allowed_token_ids: the latter deduplicated)."""
  check_stop_token_ids(fields.get("stop_token_ids"), vocab_size)
  if "allowed_token_ids" in fields:
    fields = {**fields, "allowed_token_ids": allowed_token_ids(fields["allowed_token_ids"],
                                                               vocab_size)}
  return fields


def check_request_id(request_id: str) -> None:
  # It is written in the request's log lines: keep it a name, not a payload.
  if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
    raise invalid(f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters, "
                  f"got {short(request_id)}")


def prompt_room(max_model_len: int, max_tokens: int | None = None) -> int:
  """The most prompt tokens the context window holds beside max_tokens (None: at least one)."""
  return max_model_len - (max_tokens or 1)


def fit_to_context(ids: Sequence[int], max_tokens: int | None, max_model_len: int,
                   truncate: bool, default: int | None = None) -> tuple[Sequence[int], int]:
  """(prompt ids, max_tokens) that fit the context window: the one place a request's max_tokens
  is decided, for either front end, once its prompt's length is known.

  max_tokens None takes what the window leaves after the prompt, or at most `default` when one
  is given (the key's tokens per minute may later shorten only such a default: Lease.reserve).
  A prompt that leaves no room is refused, or with `truncate`, loses its first tokens.
  """
  if not ids:
    raise invalid("prompt is empty")
  if max_tokens is not None and not 1 <= max_tokens < max_model_len:
    raise invalid(f"max_tokens must be in [1, {max_model_len}) (the context window), "
                  f"got {max_tokens}")
  room = prompt_room(max_model_len, max_tokens)
  if len(ids) > room:
    if not truncate:
      raise invalid(f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens or 1}) is more than "
                    f"the context window of {max_model_len} tokens; shorten it or set "
                    "truncate_prompt")
    ids = ids[len(ids) - room:]
  if max_tokens is None:
    max_tokens = (max_model_len - len(ids) if default is None
                  else min(default, max_model_len - len(ids)))
  return ids, max_tokens


def check_chunk_tokens(chunk_tokens: int) -> int:
  if not is_int(chunk_tokens) or not 0 <= chunk_tokens <= MAX_CHUNK_TOKENS:
    raise invalid(f"chunk_tokens must be in [0, {MAX_CHUNK_TOKENS}], got {chunk_tokens!r}")
  return max(chunk_tokens, 1)

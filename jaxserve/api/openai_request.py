"""OpenAI request bodies -> requests.GenerateInput, for /v1/completions and /v1/chat/completions.

What is checked here is what the gateway and SamplingParams cannot see: the body's bytes and
JSON, OpenAI's field names and JSON types, and fields the endpoint does not know. A field sent as
null counts as not sent, as OpenAI's clients send unset fields that way; any other unknown field
is refused, as OpenAI does, so that a misspelt `temprature` is not silently ignored (but for
best_of 1, echo false and response_format text, which change nothing, and OpenAI's fields that
mean nothing here: store, metadata, service_tier, user; parallel_tool_calls only bounds forced
tool calls). The structured-output fields (response_format, guided_*, tools) are
openai_structured.py's, the prompt and the chat messages openai_prompt.py's.

Each endpoint builds the service's request shape once per prompt (`_input`: a GenerateInput);
its max_tokens is left to client_fields.fit_to_context, the one place that decides it for
either front end, once the prompt's length is known.

Every function here is pure and raises only `ApiError` (INVALID_ARGUMENT) naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxserve.api import openai_prompt, openai_structured
from jaxserve.api.openai_structured import GUIDED_FIELDS
from jaxserve.config import Constraint, SamplingParams, is_int, json_type, short
from jaxserve.serving import work_pool
from jaxserve.serving.gateway import invalid
from jaxserve.serving.requests import GenerateInput, Prompt
from jaxserve.text import tool_calls

# OpenAI's sampling fields and vLLM's extras, passed on to SamplingParams as they are.
SAMPLING_FIELDS = (*SamplingParams.SAMPLER_FIELDS, "seed", "ignore_eos", "stop_token_ids",
                   "logit_bias", "allowed_token_ids")
# OpenAI's fields about storage, billing and tools that change nothing about the tokens: taken
# and dropped, so that clients which always send them work.
IGNORED_FIELDS = frozenset({"store", "metadata", "service_tier", "parallel_tool_calls", "user"})
_COMMON_FIELDS = frozenset({*SAMPLING_FIELDS, "model", "max_tokens", "n", "stream",
                            "stream_options", "stop", "priority", "truncate_prompt",
                            "response_format", "cache_salt", *GUIDED_FIELDS})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "prompt_logprobs"}
MAX_CHOICES = 64  # Prompts x best_of (or n) in one request: each is a request of its own.
# Unsupported fields that some clients send with their no-op value anyway (vLLM's benchmark
# sends best_of 1; vllm-router adds vLLM's and SGLang's defaults of the rest to every body, and
# no reasoning parser runs here): taken, as long as the value is that one.
_NO_OP_VALUES = {"best_of": 1, "echo": False, "response_format": {"type": "text"},
                 "skip_special_tokens": True, "no_stop_trim": False,
                 "return_hidden_states": False, "continue_final_message": False,
                 "include_reasoning": True, "separate_reasoning": True, "stream_reasoning": True}
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's and vLLM's max_tokens for /v1/completions.
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                                "tools", "tool_choice"}


@dataclasses.dataclass(frozen=True)
class Request:
  """One parsed body: what the service runs, and how the answer goes back."""

  input: GenerateInput  # The first prompt's (the only one's, but in a completions list).
  stream: bool = False  # Server-sent events, or one JSON response.
  include_usage: bool = False  # A last stream event with the usage.
  # Every prompt's input, in order, when a completions request has a list of them (else ()).
  inputs: tuple[GenerateInput, ...] = ()
  n: int = 1  # Choices returned per prompt.
  best_of: int = 1  # Choices generated per prompt; the n likeliest are returned.
  echo: bool = False  # The prompt (and its logprobs) come before each choice's own.
  hide_generated: bool = False  # echo with max_tokens 0: the prompt alone.
  want_logprobs: bool = False  # The client asked for logprobs (best_of reads them regardless).
  prompt_logprobs: int | None = None  # vLLM's extra, as sent: each choice gets a prompt_logprobs.
  # Chat with tools: "required" or "named" (the output is constrained to calls), "auto" (calls
  # the model writes are parsed), "none" (free text; the tools are not shown to the model).
  tool_choice: str = "none"
  tool_names: tuple[str, ...] = ()

  @property
  def num_runs(self) -> int:
    """Completions generated per prompt."""
    return max(self.n, self.best_of)

  @property
  def every_input(self) -> tuple[GenerateInput, ...]:
    """One input per prompt, in choice order (prompt p's choices come p-th)."""
    return self.inputs or (self.input,)


def parse_body(data: bytes) -> dict[str, Any]:
  """The body's JSON object. Non-standard NaN and Infinity parse (to be refused by name later).
  On a worker thread: a body of megabytes takes a while (work_pool.loads)."""
  try:
    text = data.decode("utf-8")  # JSON is UTF-8 (RFC 8259), whatever the Content-Type says.
  except UnicodeDecodeError as e:
    raise invalid(f"the request body is not valid UTF-8: {e}") from e
  try:
    body = work_pool.loads(text)
  except RecursionError as e:  # [[[[...]]]]: the decoder recurses once per level.
    raise invalid("the request body's JSON is nested too deeply") from e
  except ValueError as e:
    raise invalid(f"the request body is not JSON: {e}") from e
  if not isinstance(body, dict):
    raise invalid(f"the request body must be a JSON object, got {json_type(body)}")
  return body


def completion_request(body: Mapping[str, Any]) -> Request:
  body = _present(body, COMPLETION_FIELDS, "/v1/completions")
  echo = body.pop("echo", False)
  if not _is_bool(echo):
    raise invalid(f"echo must be true or false, got {short(echo)}")
  hide = echo and body.get("max_tokens") == 0 and is_int(body["max_tokens"])
  if hide:  # The prompt's logprobs alone: one token is generated, and not shown.
    body["max_tokens"] = 1
  prompts = openai_prompt.completion_prompts(body)
  sampling, n = _shared_fields(body, "max_tokens")
  logprobs, best_of = body.get("logprobs"), body.get("best_of", n)
  _check_best_of(best_of, n, len(prompts), body.get("stream", False))
  scored = _scored_prompt(body, echo, logprobs)
  if scored is not None:  # SamplingParams checks it.
    sampling["prompt_logprobs"] = scored
  # Cumulative logprobs rank best_of's runs: they are read even when the client did not ask.
  num_top = 0 if best_of > n and logprobs is None else logprobs
  inputs = tuple(_input(body, p, sampling, num_top, "max_tokens", DEFAULT_COMPLETION_TOKENS)
                 for p in prompts)
  return _request(body, inputs, n, best_of=best_of, echo=echo, hide_generated=hide,
                  want_logprobs=logprobs is not None,
                  prompt_logprobs=body.get("prompt_logprobs"))


def chat_request(body: Mapping[str, Any]) -> Request:
  # Read before _present drops it: OpenAI's default is true.
  parallel = body.get("parallel_tool_calls")
  if parallel is not None and not _is_bool(parallel):
    raise invalid(f"parallel_tool_calls must be true or false, got {short(parallel)}")
  body = _present(body, CHAT_FIELDS, "/v1/chat/completions")
  want = body.get("logprobs", False)
  if not isinstance(want, bool):
    raise invalid(f"logprobs must be true or false, got {short(want)}")
  if body.get("top_logprobs", 0) != 0 and want is not True:  # OpenAI refuses it too.
    raise invalid("top_logprobs needs logprobs: true")
  top = body.get("top_logprobs", 0)
  if not (is_int(top) and 0 <= top <= SamplingParams.MAX_LOGPROBS):
    raise invalid(f"top_logprobs must be an int in [0, {SamplingParams.MAX_LOGPROBS}], "
                  f"got {short(top)}")
  max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
  tools, choice, name = openai_structured.parse_tools(body)
  prompt = openai_prompt.chat_prompt(body, tools if choice == "auto" else None)
  sampling, n = _shared_fields(body, max_field)
  if choice in ("required", "named"):
    sampling["constraint"] = _forced_calls(sampling, choice, tools, name, parallel)
  inp = _input(body, prompt, sampling, top if want else None, max_field)
  return _request(body, (inp,), n, want_logprobs=want, tool_choice=choice,
                  tool_names=tuple(t["name"] for t in tools))


def _present(body: Mapping[str, Any], known: frozenset[str], endpoint: str) -> dict[str, Any]:
  body = {k: v for k, v in body.items()
          if v is not None and k not in IGNORED_FIELDS and not _is_no_op(k, v)}
  unknown = sorted(set(body) - known)
  if unknown:
    raise invalid(f"{endpoint} does not take {', '.join(short(k, 40) for k in unknown[:8])}; "
                  f"its fields are {', '.join(sorted(known))}")
  return body


def _is_no_op(field: str, value: Any) -> bool:
  want = _NO_OP_VALUES.get(field, None)
  return want is not None and type(value) is type(want) and value == want  # 1, not true.


def _shared_fields(body: dict[str, Any], max_field: str) -> tuple[dict[str, Any], int]:
  """(the SamplingParams fields, n) of what both endpoints take, checked."""
  _check_types(body, max_field)
  n = body.get("n", 1)
  if not (is_int(n) and 1 <= n <= MAX_CHOICES):
    raise invalid(f"n must be in [1, {MAX_CHOICES}], got {short(n)}")
  sampling = {f: body[f] for f in SAMPLING_FIELDS if f in body}
  constraint = openai_structured.output_constraint(body)
  if constraint is not None:
    sampling["constraint"] = constraint
  if "stop" in body:
    sampling["stop"] = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
  return sampling, n


def _input(body: dict[str, Any], prompt: Prompt, sampling: dict[str, Any], logprobs: Any,
           max_field: str, default_max_tokens: int | None = None) -> GenerateInput:
  """The one GenerateInput of `prompt`: the body's fields in the service's request shape (its
  max_tokens is decided with the prompt's length, by client_fields.fit_to_context)."""
  return GenerateInput(prompt, sampling, max_tokens=body.get(max_field),
                       default_max_tokens=default_max_tokens, logprobs=logprobs,
                       request_id=None, priority=body.get("priority", 0),
                       model=body.get("model", ""),
                       truncate_prompt=body.get("truncate_prompt", False),
                       cache_salt=body.get("cache_salt"))


def _request(body: dict[str, Any], inputs: tuple[GenerateInput, ...], n: int,
             **fields: Any) -> Request:
  options = body.get("stream_options", {})
  return Request(inputs[0], body.get("stream", False), options.get("include_usage", False),
                 inputs=inputs, n=n, **fields)


def _check_best_of(best_of: Any, n: int, num_prompts: int, stream: bool) -> None:
  if not (is_int(best_of) and n <= best_of):
    raise invalid(f"best_of must be an int >= n ({n}), got {short(best_of)}")
  if best_of > 1 and stream and best_of != n:
    raise invalid("best_of cannot be streamed: the best are known only at the end")
  if num_prompts * best_of > MAX_CHOICES:
    raise invalid(f"{num_prompts} prompts x best_of {best_of} is more than {MAX_CHOICES} "
                  "completions in one request")


def _scored_prompt(body: dict[str, Any], echo: bool, logprobs: Any) -> Any:
  """The prompt_logprobs the prompt is scored with (None: not scored): vLLM's field as sent,
  and with echo, as many top logprobs as the generated tokens get."""
  asked = body.get("prompt_logprobs")
  if not echo or logprobs is None:
    return asked
  asked = 0 if asked is None else asked
  return max(asked, logprobs) if is_int(asked) and is_int(logprobs) else logprobs


def _forced_calls(sampling: dict[str, Any], choice: str, tools: list[dict[str, Any]],
                  name: str | None, parallel: bool | None) -> Constraint:
  """tool_choice "required" or named: the output is constrained to the calls' JSON."""
  if sampling.get("constraint") is not None:
    raise invalid(f"tool_choice {choice!r} constrains the output to tool calls: it cannot be "
                  "combined with response_format or guided_* fields")
  return Constraint.json_schema(tool_calls.call_schema(
      tools, name, 1 if parallel is False else tool_calls.MAX_FORCED_CALLS))


def _check_types(body: dict[str, Any], max_field: str) -> None:
  """The JSON types of the fields the service takes as they are."""
  for field, ok, want in ((max_field, is_int, "an int >= 1"), ("priority", is_int, "an int"),
                          ("n", is_int, "an int"), ("model", _is_str, "a string"),
                          ("stream", _is_bool, "true or false"),
                          ("truncate_prompt", _is_bool, "true or false"),
                          ("stream_options", _is_dict, "an object"),
                          ("cache_salt", lambda s: _is_str(s) and s, "a non-empty string")):
    if field in body and not ok(body[field]):
      raise invalid(f"{field} must be {want}, got {short(body[field])}")
  if max_field in body and body[max_field] < 1:
    raise invalid(f"{max_field} must be an int >= 1, got {body[max_field]}")
  usage = body.get("stream_options", {}).get("include_usage", False)
  if not _is_bool(usage):
    raise invalid(f"stream_options.include_usage must be true or false, got {short(usage)}")


def _is_str(x: Any) -> bool:
  return isinstance(x, str)


def _is_bool(x: Any) -> bool:
  return isinstance(x, bool)


def _is_dict(x: Any) -> bool:
  return isinstance(x, dict)

"""OpenAI request bodies -> requests.GenerateInput, for /v1/completions and /v1/chat/completions.

What is checked here is what the gateway and SamplingParams cannot see: the body's bytes and
JSON, OpenAI's field names and JSON types, and fields the endpoint does not know. A field sent as
null counts as not sent, as OpenAI's clients send unset fields that way; any other unknown field
is refused, as OpenAI does, so that a misspelt `temprature` is not silently ignored (but for
best_of 1, echo false and response_format text, which change nothing, and OpenAI's fields that
mean nothing here: store, metadata, service_tier, user; parallel_tool_calls only bounds forced
tool calls). The structured-output fields (response_format, guided_*, tools) are
openai_structured.py's.

Every function here is pure and raises only `ApiError` (INVALID_ARGUMENT) naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxserve.api import openai_structured
from jaxserve.api.openai_structured import GUIDED_FIELDS
from jaxserve.config import Constraint, SamplingParams, is_int, json_type, short
from jaxserve.serving import work_pool
from jaxserve.serving.client_fields import MAX_MESSAGES
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

  input: GenerateInput
  stream: bool = False  # Server-sent events, or one JSON response.
  include_usage: bool = False  # A last stream event with the usage.
  prompts: tuple[Prompt, ...] = ()  # Several prompts of one completions request (else input's).
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
  echo, asked_prompt = body.pop("echo", False), body.get("prompt_logprobs")
  if not _is_bool(echo):
    raise invalid(f"echo must be true or false, got {short(echo)}")
  hide = echo and body.get("max_tokens") == 0 and is_int(body["max_tokens"])
  if hide:  # The prompt's logprobs alone: one token is generated, and not shown.
    body["max_tokens"] = 1
  logprobs = body.get("logprobs")
  if echo and logprobs is not None:  # The prompt's tokens get as many top logprobs as the rest.
    asked = body.get("prompt_logprobs", 0)
    both_ints = is_int(asked) and is_int(logprobs)
    body["prompt_logprobs"] = max(asked, logprobs) if both_ints else logprobs
  prompts = _completion_prompts(body)
  req = _request(body, prompts[0], logprobs, "max_tokens", DEFAULT_COMPLETION_TOKENS)
  if "prompt_logprobs" in body:  # SamplingParams checks it.
    sampling = {**req.input.sampling, "prompt_logprobs": body["prompt_logprobs"]}
    req = dataclasses.replace(req, input=dataclasses.replace(req.input, sampling=sampling))
  n, best_of = req.n, body.get("best_of", req.n)
  if not (is_int(best_of) and n <= best_of):
    raise invalid(f"best_of must be an int >= n ({n}), got {short(best_of)}")
  if best_of > 1 and req.stream and best_of != n:
    raise invalid("best_of cannot be streamed: the best are known only at the end")
  if len(prompts) * best_of > MAX_CHOICES:
    raise invalid(f"{len(prompts)} prompts x best_of {best_of} is more than {MAX_CHOICES} "
                  "completions in one request")
  want = logprobs is not None
  if best_of > n and logprobs is None:  # Cumulative logprobs rank the choices.
    req = dataclasses.replace(req, input=dataclasses.replace(req.input, logprobs=0))
  return dataclasses.replace(req, prompts=tuple(prompts), best_of=best_of, echo=echo,
                             hide_generated=hide, want_logprobs=want, prompt_logprobs=asked_prompt)


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
  prompt = Prompt(messages=_messages(body), tools=tools if choice == "auto" else None)
  req = _request(body, prompt, top if want else None, max_field)
  if choice in ("required", "named"):
    if req.input.sampling.get("constraint") is not None:
      raise invalid(f"tool_choice {choice!r} constrains the output to tool calls: it cannot be "
                    "combined with response_format or guided_* fields")
    sampling = {**req.input.sampling,
                "constraint": Constraint.json_schema(tool_calls.call_schema(
                    tools, name, 1 if parallel is False else tool_calls.MAX_FORCED_CALLS))}
    req = dataclasses.replace(req, input=dataclasses.replace(req.input, sampling=sampling))
  return dataclasses.replace(req, tool_choice=choice, tool_names=tuple(t["name"] for t in tools))


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


def _request(body: dict[str, Any], prompt: Prompt, logprobs: Any, max_field: str,
             default_max_tokens: int | None = None) -> Request:
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
  options = body.get("stream_options", {})
  inp = GenerateInput(prompt, sampling, max_tokens=body.get(max_field),
                      default_max_tokens=default_max_tokens, logprobs=logprobs,
                      request_id=None, priority=body.get("priority", 0),
                      model=body.get("model", ""),
                      truncate_prompt=body.get("truncate_prompt", False),
                      cache_salt=body.get("cache_salt"))
  return Request(inp, body.get("stream", False), options.get("include_usage", False), n=n,
                 want_logprobs=logprobs is not None)


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


def _completion_prompts(body: dict[str, Any]) -> list[Prompt]:
  """A string, a list of token ids, or a list of either (several prompts, choices in order)."""
  prompt = body.get("prompt")
  if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
    return [_completion_prompt(p, f"prompt[{k}]") for k, p in enumerate(prompt)]
  return [_completion_prompt(prompt, "prompt")]


def _completion_prompt(prompt: Any, field: str) -> Prompt:
  if isinstance(prompt, str):
    return Prompt(text=_unicode(prompt, field))
  if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
    # The service checks the length first, then each id (type and vocabulary): 2M ids are not
    # read one by one here, on the event loop, before their length is known to be too long.
    return Prompt(token_ids=prompt)
  raise invalid(f"{field} must be a string, a list of token ids, or a list of those, got "
                f"{short(prompt)}")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise invalid(f"messages must be a non-empty list, got {short(messages)}")
  if len(messages) > MAX_MESSAGES:  # Before reading them one by one.
    raise invalid(f"messages: at most {MAX_MESSAGES} in one request, got {len(messages):,}")
  out = []
  for n, m in enumerate(messages):
    if not isinstance(m, dict):
      raise invalid(f"messages[{n}] must be an object, got {short(m)}")
    if not isinstance(m.get("role"), str):  # The tokenizer checks which roles there are.
      raise invalid(f"messages[{n}].role must be a string, got {short(m.get('role'))}")
    calls = m.get("tool_calls")
    if calls is not None and m["role"] == "assistant":
      # An earlier call, content null: written back as the model writes calls (tool_calls.py).
      if not (isinstance(calls, list) and all(
          isinstance(c, dict) and isinstance(c.get("function"), dict)
          and _is_str(c["function"].get("name")) for c in calls)):
        raise invalid(f"messages[{n}].tool_calls must be a list of {{\"function\": {{\"name\": "
                      f"..., \"arguments\": ...}}}}, got {short(calls)}")
      text = _content(m.get("content") or "", f"messages[{n}].content")
      out.append({"role": "assistant",
                  "content": "\n".join(filter(None, [text, tool_calls.history_text(calls)]))})
      continue
    out.append({"role": m["role"], "content": _content(m.get("content"), f"messages[{n}].content")})
  return out


def _content(content: Any, field: str) -> str:
  if isinstance(content, list):  # Content parts: only text ones are supported.
    for k, part in enumerate(content):
      if not (isinstance(part, dict) and part.get("type") == "text" and _is_str(part.get("text"))):
        raise invalid(f"{field}[{k}] must be a text part {{\"type\": \"text\", \"text\": ...}} "
                      f"(only text is supported), got {short(part)}")
    content = "".join(part["text"] for part in content)
  if not isinstance(content, str):
    raise invalid(f"{field} must be a string or a list of text parts, got {short(content)}")
  return _unicode(content, field)


def _unicode(text: str, field: str) -> str:
  # JSON can spell a lone surrogate ("\ud800"), which no tokenizer can encode.
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise invalid(f"{field} is not valid Unicode: {e.reason} at character {e.start}") from e
  return text


def _is_str(x: Any) -> bool:
  return isinstance(x, str)


def _is_bool(x: Any) -> bool:
  return isinstance(x, bool)


def _is_dict(x: Any) -> bool:
  return isinstance(x, dict)


# For the tokenizer routes (openai_tokenize.py): the same message and text checks as chat.
messages = _messages
unicode_text = _unicode

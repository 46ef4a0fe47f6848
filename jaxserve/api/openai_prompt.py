"""The prompt of an OpenAI request body: /v1/completions' `prompt` (a string, token ids, or a list
of either) and chat's `messages`, checked as openai_request.py checks the rest of the body; the
tokenizer routes (openai_tokenize.py) take the same checks.

Every function here is pure and raises only `ApiError` (INVALID_ARGUMENT) naming the field.
"""

from __future__ import annotations

from typing import Any

from jaxserve.config import short
from jaxserve.serving.client_fields import check_num_messages
from jaxserve.serving.gateway import invalid
from jaxserve.serving.requests import Prompt
from jaxserve.text import tool_calls


def completion_prompts(body: dict[str, Any]) -> list[Prompt]:
  """A string, a list of token ids, or a list of either (several prompts, choices in order)."""
  prompt = body.get("prompt")
  if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
    return [_completion_prompt(p, f"prompt[{k}]") for k, p in enumerate(prompt)]
  return [_completion_prompt(prompt, "prompt")]


def _completion_prompt(prompt: Any, field: str) -> Prompt:
  if isinstance(prompt, str):
    return Prompt(text=unicode_text(prompt, field))
  if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
    # The service checks the length first, then each id (type and vocabulary): 2M ids are not
    # read one by one here, on the event loop, before their length is known to be too long.
    return Prompt(token_ids=prompt)
  raise invalid(f"{field} must be a string, a list of token ids, or a list of those, got "
                f"{short(prompt)}")


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
  given = body.get("messages")
  if not isinstance(given, list) or not given:
    raise invalid(f"messages must be a non-empty list, got {short(given)}")
  check_num_messages(len(given))  # Before reading them one by one.
  out = []
  for n, m in enumerate(given):
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
  return unicode_text(content, field)


def unicode_text(text: str, field: str) -> str:
  # JSON can spell a lone surrogate ("\ud800"), which no tokenizer can encode.
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise invalid(f"{field} is not valid Unicode: {e.reason} at character {e.start}") from e
  return text


def _is_str(x: Any) -> bool:
  return isinstance(x, str)

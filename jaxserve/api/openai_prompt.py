"""The prompt of an OpenAI request body: /v1/completions' `prompt` (a string, token ids, or a list
of either) and chat's `messages` (each content a string, or text and image parts), checked as
openai_request.py checks the rest of the body; the tokenizer routes (openai_tokenize.py) take the
same checks. An image part's URL is only collected here; serving/media.py decodes it.

Every function here is pure and raises only `ApiError` (INVALID_ARGUMENT) naming the field.
"""

from __future__ import annotations

from typing import Any

from jaxserve.config import short
from jaxserve.serving.client_fields import check_num_messages
from jaxserve.serving.gateway import invalid
from jaxserve.serving.media import ImageSource
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


def chat_prompt(body: dict[str, Any], tools: Any = None) -> Prompt:
  """Chat's `messages` as a Prompt: each message's text, and its image parts' URLs in order
  (decoded later, on the model's and the server's limits: serving/media.py)."""
  images: list[ImageSource] = []
  return Prompt(messages=_messages(body, images), tools=tools, images=tuple(images))


def _messages(body: dict[str, Any], images: list[ImageSource]) -> list[dict[str, Any]]:
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
    with_calls = calls is not None and m["role"] == "assistant"
    content = _content(m.get("content") or "" if with_calls else m.get("content"),
                       f"messages[{n}].content", images)
    if with_calls:
      # An earlier call, content null: written back as the model writes calls (tool_calls.py).
      if not (isinstance(calls, list) and all(
          isinstance(c, dict) and isinstance(c.get("function"), dict)
          and _is_str(c["function"].get("name")) for c in calls)):
        raise invalid(f"messages[{n}].tool_calls must be a list of {{\"function\": {{\"name\": "
                      f"..., \"arguments\": ...}}}}, got {short(calls)}")
      if not isinstance(content, str):
        raise invalid(f"messages[{n}]: an assistant message with tool_calls takes text only")
      content = "\n".join(filter(None, [content, tool_calls.history_text(calls)]))
    out.append({"role": m["role"], "content": content})
  return out


def _content(content: Any, field: str, images: list[ImageSource]) -> str | list[dict[str, Any]]:
  """A string; a list of text parts is joined into one (as a text-only template takes it); with
  an image part, the parts as transformers' chat templates take them ({"type": "image"})."""
  if isinstance(content, list):
    parts = [_part(part, f"{field}[{k}]", images) for k, part in enumerate(content)]
    if any(part["type"] == "image" for part in parts):
      return parts
    content = "".join(part["text"] for part in parts)
  if not isinstance(content, str):
    raise invalid(f"{field} must be a string or a list of content parts, got {short(content)}")
  return unicode_text(content, field)


def _part(part: Any, field: str, images: list[ImageSource]) -> dict[str, Any]:
  kind = part.get("type") if isinstance(part, dict) else None
  if kind == "text" and _is_str(part.get("text")):
    return {"type": "text", "text": unicode_text(part["text"], f"{field}.text")}
  if kind == "image_url":
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else None
    if not _is_str(url):
      raise invalid(f"{field}.image_url must be an object {{\"url\": \"data:image/png;base64,"
                    f"...\"}}, got {short(part.get('image_url'))}")
    images.append(ImageSource(url, f"{field}.image_url"))
    return {"type": "image"}
  raise invalid(f"{field} must be a text part {{\"type\": \"text\", \"text\": ...}} or an "
                f"image part {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}, "
                f"got {short(part)}")


def unicode_text(text: str, field: str) -> str:
  # JSON can spell a lone surrogate ("\ud800"), which no tokenizer can encode.
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise invalid(f"{field} is not valid Unicode: {e.reason} at character {e.start}") from e
  return text


def _is_str(x: Any) -> bool:
  return isinstance(x, str)

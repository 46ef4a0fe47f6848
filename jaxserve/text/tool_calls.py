"""Tool calls in a model's text: the schema a forced call is constrained to, and the parser of
calls a model writes of its own accord.

  tool_choice "required"     the output is a JSON array of calls (at least one), constrained by
                             `call_schema`: each {"name": one of the tools, "arguments": its
                             parameters' schema}
  tool_choice {named one}    one such object, for that tool only
  tool_choice "auto"         the tools go to the chat template (as `tools`) when it takes them,
                             else into a system message in the Hermes format
                             (Qwen's, NousResearch's:
                             <tool_call>{"name": ..., "arguments": ...}</tool_call>), which
                             `parse_tagged` reads back out of the text
  tool_choice "none"         free text

Plain Python, no jax: the front end builds and parses, the runner only sees a JSON schema.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

# "required" makes an array of calls: at most this many (1 without parallel calls).
MAX_FORCED_CALLS = 4
_TAG = "<tool_call>"
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def call_schema(tools: Sequence[Mapping[str, Any]], name: str | None = None,
                max_calls: int = MAX_FORCED_CALLS) -> dict[str, Any]:
  """The JSON schema of forced calls: one call of tool `name`, or (None) an array of calls of any
  of `tools`. tools: OpenAI's function definitions ({"name", "parameters", ...})."""
  def one(tool: Mapping[str, Any]) -> dict[str, Any]:
    params = dict(tool.get("parameters") or {"type": "object", "properties": {}})
    # A call carries the parameters its tool declares, no others (OpenAI's strict mode asks the
    # same); a schema that says otherwise is kept as it is.
    if "properties" in params:
      params.setdefault("additionalProperties", False)
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}

  if name is not None:
    return one(next(t for t in tools if t["name"] == name))
  calls = [one(t) for t in tools]
  item = calls[0] if len(calls) == 1 else {"anyOf": calls}
  return {"type": "array", "items": item, "minItems": 1, "maxItems": max_calls}


def parse_forced(text: str) -> list[tuple[str, str]] | None:
  """(name, arguments as JSON text) of each call in a forced output; None if it is incomplete
  (max_tokens cut it, or a stop string)."""
  try:
    value = json.loads(text)
  except ValueError:
    return None
  calls = value if isinstance(value, list) else [value]
  if not all(isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c
             for c in calls):
    return None
  return [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]


def system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
  """The Hermes-format system message that offers `tools` to a model whose template cannot."""
  listed = "\n".join(json.dumps({"type": "function", "function": dict(t)}, ensure_ascii=False)
                     for t in tools)
  return ("You may call one or more functions to assist with the user query. The functions you "
          f"can call are listed in <tools></tools>:\n<tools>\n{listed}\n</tools>\nTo call a "
          "function, write a JSON object with its name and arguments within "
          "<tool_call></tool_call> "
          'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
          "</tool_call>")


def parse_tagged(text: str, names: Sequence[str]) -> tuple[str, list[tuple[str, str]]]:
  """(the text outside the calls, the calls) of a free output in the Hermes format. A tag whose
  body is not a call of one of `names` stays in the text."""
  calls, kept, last = [], [], 0
  for m in _TAGGED.finditer(text):
    try:
      call = json.loads(m.group(1))
    except ValueError:
      continue
    if not (isinstance(call, dict) and call.get("name") in names):
      continue
    kept.append(text[last:m.start()])
    last = m.end()
    calls.append((call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
  kept.append(text[last:])
  return "".join(kept).strip() if calls else text, calls


class CallStream:
  """A free output in the Hermes format, as it streams: content goes out as it is generated, and
  only text that may begin a call is held back (a tail that is the start of "<tool_call>", or
  everything from a tag on), to be parsed for calls when the output ends. vLLM's tool parsers
  stream the same way; holding the whole text back made a chat with tools one event at its end."""

  def __init__(self, names: Sequence[str]):
    self._names = names
    self._text = ""
    self._num_sent = 0  # Characters of _text streamed as content.
    self._in_call = False  # A tag has opened: the rest is held until the end.

  def add(self, text: str) -> str:
    """Takes the next piece of output; returns the content that can be sent now."""
    self._text += text
    if self._in_call:
      return ""
    rest = self._text[self._num_sent:]
    at = rest.find(_TAG)
    self._in_call = at >= 0
    out = rest[:at] if self._in_call else rest[:len(rest) - _partial_tag(rest)]
    self._num_sent += len(out)
    return out

  def finish(self) -> tuple[str, list[tuple[str, str]]]:
    """(the content held back and not a call, the calls) once the output has ended."""
    held, self._num_sent = self._text[self._num_sent:], len(self._text)
    return parse_tagged(held, self._names)


def _partial_tag(text: str) -> int:
  """The length of the longest tail of `text` that is the start of a tag (and not all of it)."""
  return next((n for n in range(min(len(_TAG) - 1, len(text)), 0, -1)
               if text.endswith(_TAG[:n])), 0)


def history_text(calls: Sequence[Mapping[str, Any]]) -> str:
  """An assistant turn's earlier tool_calls as the model would have written them (Hermes tags),
  for templates that render content only."""
  parts = []
  for c in calls:
    fn = c.get("function", {})
    args = fn.get("arguments", "{}")
    try:
      args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
      pass
    parts.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args},
                                              ensure_ascii=False) + "\n</tool_call>")
  return "\n".join(parts)

"""The structured-output fields of an OpenAI request body (openai_request.py).

`response_format` json_object / json_schema, vLLM's guided_json, guided_regex,
guided_choice and guided_grammar (at most one of them) become `SamplingParams.constraint`; chat's
`tools` with tool_choice "required" or a named function become a constraint too
(text/tool_calls.py), "auto" offers the tools to the model and parses its calls, "none" ignores
them.

Every function here is pure and raises only `ApiError` (INVALID_ARGUMENT) naming the field.
"""

from __future__ import annotations

from typing import Any

from jaxserve.config import Constraint, short
from jaxserve.serving.gateway import invalid

# vLLM's constrained-decoding extras, each a way to give SamplingParams.constraint.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_TOOLS = 128  # OpenAI's limit on the functions one request offers.


def output_constraint(body: dict[str, Any]) -> Constraint | None:
  """The output constraint of response_format or a guided_* field (at most one of them)."""
  given = [f for f in ("response_format", *GUIDED_FIELDS) if f in body]
  if len(given) > 1:
    raise invalid(f"give at most one of response_format and {', '.join(GUIDED_FIELDS)}; got "
                  f"{', '.join(given)}")
  if not given:
    return None
  field, value = given[0], body[given[0]]
  want = {"guided_json": ((dict, str, bool), "a JSON schema (an object, or its text)"),
          "guided_regex": (str, "a string (a regular expression)"),
          "guided_choice": (list, "a list of strings"),
          "guided_grammar": (str, "a string (a Lark or GBNF grammar)")}
  if field in want and not isinstance(value, want[field][0]):
    raise invalid(f"{field} must be {want[field][1]}, got {short(value)}")
  try:
    if field == "response_format":
      return _response_format(value)
    make = {"guided_json": Constraint.json_schema, "guided_regex": Constraint.regex,
            "guided_choice": Constraint.choice, "guided_grammar": Constraint.grammar}[field]
    return make(value)
  except ValueError as e:
    raise invalid(f"{field}: {e}") from e


def _response_format(value: Any) -> Constraint:
  kinds = '"text", "json_object" or "json_schema"'
  if not isinstance(value, dict) or not isinstance(value.get("type"), str):
    raise invalid(f'response_format must be an object {{"type": {kinds}}}, got {short(value)}')
  if value["type"] == "json_object":
    return Constraint.json_object()
  if value["type"] != "json_schema":
    raise invalid(f"response_format.type must be {kinds}, got {short(value['type'])}")
  spec = value.get("json_schema")
  if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
    raise invalid("response_format json_schema needs json_schema: {\"name\": ..., \"schema\": "
                  f"{{...}}}}, got {short(spec)}")
  return Constraint.json_schema(spec["schema"])


def parse_tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], str, str | None]:
  """(OpenAI's function definitions, tool_choice: none / auto / required / named, the named
  function)."""
  tools, choice = body.get("tools", []), body.get("tool_choice")
  if isinstance(tools, list) and len(tools) > MAX_TOOLS:
    raise invalid(f"tools: at most {MAX_TOOLS} in one request (as OpenAI), got {len(tools):,}")
  if not isinstance(tools, list) or not all(_is_function(t) for t in tools):
    raise invalid('tools must be a list of {"type": "function", "function": {"name": ..., '
                  f'"parameters": {{...}}}}}}, got {short(tools)}')
  functions = [dict(t["function"]) for t in tools]
  names = [f["name"] for f in functions]
  if choice is None:
    return functions, "auto" if tools else "none", None
  if not tools:
    raise invalid("tool_choice needs tools")
  if choice in ("none", "auto", "required"):
    return functions, choice, None
  name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
  if not (isinstance(choice, dict) and choice.get("type") == "function" and name in names):
    raise invalid('tool_choice must be "none", "auto", "required" or {"type": "function", '
                  f'"function": {{"name": one of {names}}}}}, got {short(choice)}')
  return functions, "named", name


def _is_function(tool: Any) -> bool:
  fn = tool.get("function") if isinstance(tool, dict) else None
  return (tool.get("type") == "function" and isinstance(fn, dict)
          and isinstance(fn.get("name"), str) and isinstance(fn.get("parameters", {}), dict))

"""text/tool_calls.py: the schema of forced calls, and the parsers of a model's calls."""

import json

import jsonschema
import pytest

from jaxserve.text import tool_calls

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object",
                                           "properties": {"zone": {"type": "integer"}}}}


def test_call_schema_takes_calls_of_the_given_tools_only():
  any_call = tool_calls.call_schema([WEATHER, TIME])
  jsonschema.validate([{"name": "get_time", "arguments": {"zone": 3}},
                       {"name": "get_weather", "arguments": {"city": "Oslo"}}], any_call)
  for bad in ([], [{"name": "get_time", "arguments": {"zone": "x"}}],
              [{"name": "nope", "arguments": {}}], {"name": "get_time", "arguments": {}}):
    with pytest.raises(jsonschema.ValidationError):
      jsonschema.validate(bad, any_call)
  named = tool_calls.call_schema([WEATHER, TIME], "get_weather")
  jsonschema.validate({"name": "get_weather", "arguments": {"city": "Rome"}}, named)
  with pytest.raises(jsonschema.ValidationError):
    jsonschema.validate({"name": "get_time", "arguments": {"zone": 1}}, named)


def test_parse_forced_reads_one_call_or_an_array_and_refuses_a_cut_one():
  assert tool_calls.parse_forced('{"name": "get_time", "arguments": {"zone": 3}}') == [
      ("get_time", '{"zone": 3}')]
  assert tool_calls.parse_forced(
      '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]') == [
          ("a", "{}"), ("b", '{"x": 1}')]
  assert tool_calls.parse_forced('[{"name": "a", "argu') is None


def test_parse_tagged_takes_calls_of_known_tools_out_of_the_text():
  text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
          '</tool_call>\n<tool_call>{"name": "other", "arguments": {}}</tool_call>')
  content, calls = tool_calls.parse_tagged(text, ["get_weather"])
  assert calls == [("get_weather", '{"city": "Oslo"}')]
  assert content == 'Let me check.\n\n<tool_call>{"name": "other", "arguments": {}}</tool_call>'
  assert tool_calls.parse_tagged("no calls here", ["get_weather"]) == ("no calls here", [])


def test_history_is_written_as_the_model_writes_calls():
  calls = [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
  text = tool_calls.history_text(calls)
  assert tool_calls.parse_tagged(text, ["get_weather"])[1] == [("get_weather", '{"city": "Oslo"}')]
  offer = tool_calls.system_prompt([WEATHER])
  assert json.dumps({"type": "function", "function": WEATHER}) in offer and "<tool_call>" in offer

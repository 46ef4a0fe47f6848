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


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_a_call_stream_holds_back_only_what_may_begin_a_call():
  stream = tool_calls.CallStream(["get_weather"])
  text = "Is 3 < 4? Let me check.\n" + CALL
  sent = [stream.add(c) for c in text]  # One character at a time, as the worst tokenizer.
  streamed = "".join(sent)
  assert streamed == "Is 3 < 4? Let me check.\n"
  # Every character went out as soon as it could not begin a tag: "<" waited for one more.
  assert sent[:5] == ["I", "s", " ", "3", " "] and sent[5:7] == ["", "< "]
  assert stream.finish() == ("", [("get_weather", '{"city": "Oslo"}')])


def test_a_call_stream_gives_back_a_tag_that_was_no_call():
  stream = tool_calls.CallStream(["get_weather"])
  assert stream.add("x <tool") == "x "
  assert stream.add("_cal") == ""
  assert stream.add("l>not json</tool_call> bye") == ""
  assert stream.finish() == ("<tool_call>not json</tool_call> bye", [])
  ended = tool_calls.CallStream(["get_weather"])
  assert ended.add("ends on <tool_") == "ends on " and ended.finish() == ("<tool_", [])


def test_a_chat_stream_with_tools_sends_content_as_it_comes_and_the_call_at_the_end():
  import types

  from jaxserve.api.openai_format import ChatFormat
  from jaxserve.api.openai_request import Request
  from jaxserve.serving.requests import Chunk, FinishReason, GenerateInput, Prompt

  request = Request(GenerateInput(Prompt(text="x")), stream=True, tool_choice="auto",
                    tool_names=("get_weather",))
  fmt = ChatFormat(types.SimpleNamespace(model_name="m", tokenizer=None), request)
  pieces = ["Let", " me", " check", ".\n", "<tool", "_call>\n", CALL[12:40], CALL[40:]]
  events = [fmt.delta(Chunk("r", p, [n], None, None, None)) for n, p in enumerate(pieces[:-1])]
  events.append(fmt.delta(Chunk("r", pieces[-1], [7], None, FinishReason.STOP, None)))
  deltas = [e["choices"][0]["delta"] for e in events]
  assert [d.get("content") for d in deltas[:4]] == ["Let", " me", " check", ".\n"]
  assert all(not d.get("content") for d in deltas[4:])
  call, = deltas[-1]["tool_calls"]
  assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
  assert call["index"] == 0 and call["id"].startswith("call_")
  assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

"""Structured output and tool calls over the OpenAI-compatible HTTP API, driven by the official
`openai` client and by LangChain's ChatOpenAI, on the tiny random model: its free text is noise,
so every valid object below is the constraint's doing."""

from __future__ import annotations

import json
import re
from typing import Literal

import grpc
import jsonschema
import langchain_openai
import openai
import pydantic
import pytest

from jaxserve.api.proto import jaxserve_pb2 as pb
from support import server_harness as h
from support.openai_http import openai_client

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 6},
                         "size": {"enum": ["s", "m", "l"]},
                         "rooms": {"type": "array", "maxItems": 2,
                                   "items": {"type": "object",
                                             "properties": {"n": {"type": "integer", "minimum": 0,
                                                                  "maximum": 9}},
                                             "required": ["n"], "additionalProperties": False}}},
          "required": ["city", "size", "rooms"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 6},
                                  "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"],
        "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Hi"}]


class Flat(pydantic.BaseModel):
  name: str = pydantic.Field(max_length=6)
  kind: Literal["cat", "dog"]
  age: int = pydantic.Field(ge=0, le=20)


@pytest.fixture(scope="module")
def srv_options():
  return dict(keys=True)


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
  return openai_client(srv, timeout=120)


def test_response_format_json_schema_and_json_object(client):
  for seed in range(3):
    out = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=80, temperature=1.0, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "house", "schema": SCHEMA}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
  out = client.completions.create(model="tiny", prompt="x", max_tokens=60, temperature=1.0,
                                  seed=1, extra_body={"response_format": {"type": "json_object"}})
  if out.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(out.choices[0].text), dict)
  else:
    assert out.choices[0].text.startswith("{")


def test_chat_completions_parse_returns_the_model(client):
  out = client.chat.completions.parse(model="tiny", messages=ASK, max_tokens=60, temperature=0,
                                      response_format=Flat)
  assert isinstance(out.choices[0].message.parsed, Flat)


def test_guided_regex_choice_and_grammar(client):
  kinds = {"guided_regex": r"[0-9]{3}-[a-z]{2}", "guided_choice": ["red", "green"],
           "guided_grammar": 'root ::= "a" [0-9] "b"'}
  checks = {"guided_regex": lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t),
            "guided_choice": lambda t: t in ("red", "green"),
            "guided_grammar": lambda t: re.fullmatch(r"a[0-9]b", t)}
  for field, value in kinds.items():
    out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=16,
                                         temperature=1.0, seed=4, extra_body={field: value})
    assert checks[field](out.choices[0].message.content), (field, out.choices[0].message.content)


def test_a_choice_of_thousands_of_options_gives_one_of_them(client):
  # Past llguidance's 2,000-item parser row, where "item" alone used to come out (finish stop).
  options = [f"item{i}" for i in range(2_500)]
  for seed in range(3):
    out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=16, seed=seed,
                                         temperature=1.0, extra_body={"guided_choice": options})
    assert out.choices[0].message.content in options, out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"


def test_streaming_a_constrained_chat_gives_the_same_text(client):
  fields = dict(model="tiny", messages=ASK, max_tokens=80, temperature=1.0, seed=9,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "h", "schema": SCHEMA}})
  whole = client.chat.completions.create(**fields).choices[0].message.content
  streamed = "".join(c.choices[0].delta.content or "" for c in
                     client.chat.completions.create(**fields, stream=True) if c.choices)
  assert streamed == whole


@pytest.mark.parametrize("body, message", [
    ({"guided_regex": "(("}, "regex constraint is invalid"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "Invalid type: objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "needs json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type must be"),
    ({"guided_grammar": 'start: "a" | b'}, 'unknown name: "b"'),
    ({"guided_choice": []}, "non-empty list of strings"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "at most one of"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice must be"),
    # Issue 29: allowed ids the constraint never allows first (0 is <|endoftext|>); a choice
    # list past the size budget, refused before it is compiled.
    ({"guided_choice": ["red", "green"], "allowed_token_ids": [0]},
     "allowed_token_ids and the choice constraint leave no token"),
    ({"guided_choice": [f"item{i}" for i in range(100_000)]}, "a constraint may have"),
])
def test_bad_constraints_are_a_400_naming_the_problem(client, srv, body, message):
  with pytest.raises(openai.BadRequestError, match=re.escape(message)):
    client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, extra_body=body)
  assert not srv.scheduler.waiting and not srv.scheduler.running  # Nothing was queued.


def test_a_grammar_engine_error_mid_output_is_an_error_not_a_short_answer(client, srv,
                                                                           monkeypatch):
  """llguidance's row and size limits are met at compile (a 400 before anything runs); one met
  later leaves its matcher in error, where only an end of sequence is allowed. That end must not
  pass for the answer's: the client gets a 400 naming it. The matcher is put in that state for
  real, by feeding llguidance a token its grammar refuses after the first token."""
  from jaxserve.text.constraint import Matcher

  accept, refused = Matcher.accept, client_token(srv, "x")

  def accept_then_fail(self, token_id):
    ok = accept(self, token_id)
    if ok and not self.error:
      assert not accept(self, refused)  # llguidance is now in its error state.
    return ok

  monkeypatch.setattr(Matcher, "accept", accept_then_fail)
  late, digits = "could not go on after 1 tokens", {"guided_regex": "[0-9]{6}"}
  with pytest.raises(openai.BadRequestError, match=late):
    client.completions.create(model="tiny", prompt="x", max_tokens=8, extra_body=digits)
  with pytest.raises(openai.APIError, match=late):
    list(client.completions.create(model="tiny", prompt="x", max_tokens=8, stream=True,
                                   extra_body=digits))
  with grpc.insecure_channel(srv.grpc_address) as ch, pytest.raises(grpc.RpcError) as e:
    list(h.generate(h.stub(ch), pb.GenerateRequest(text="x", max_tokens=8, regex="[0-9]{6}"),
                    timeout=120))
  assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and late in e.value.details()


def client_token(srv, text: str) -> int:
  (token,) = srv.server.service.tokenizer.encode(text, add_bos=False)
  return token


def test_tool_choice_required_returns_tool_calls_whose_arguments_validate(client):
  params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
  for seed in range(3):
    out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=90, seed=seed,
                                         temperature=1.0, tools=[WEATHER, TIME],
                                         tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
      assert call.type == "function" and call.id.startswith("call_")
      jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def test_a_named_tool_streams_as_tool_call_deltas(client):
  fields = dict(model="tiny", messages=ASK, max_tokens=60, temperature=0, tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_time"}})
  whole = client.chat.completions.create(**fields).choices[0].message.tool_calls
  assert [c.function.name for c in whole] == ["get_time"]
  deltas = [d for c in client.chat.completions.create(**fields, stream=True) if c.choices
            for d in c.choices[0].delta.tool_calls or ()]
  assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
      (0, "get_time", whole[0].function.arguments)]
  jsonschema.validate(json.loads(whole[0].function.arguments), TIME["function"]["parameters"])


def test_tool_call_history_and_auto_and_none_are_accepted(client):
  history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather",
                               "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
  # "auto" offers the tools in a system message longer than the tiny model's 128-token window:
  # truncate_prompt keeps its tail.
  for choice in ("auto", "none"):
    out = client.chat.completions.create(model="tiny", messages=history, max_tokens=4,
                                         tools=[WEATHER], tool_choice=choice,
                                         extra_body={"truncate_prompt": True})
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_chat_with_tools_streams_its_content_as_it_is_generated(client):
  """Issue 29: with tools, the whole text came as one event at the end. Content now streams;
  only text that may begin a call is held back."""
  fields = dict(model="tiny", messages=ASK, max_tokens=24, temperature=1.0, seed=3,
                tools=[WEATHER], extra_body={"truncate_prompt": True, "ignore_eos": True})
  whole = client.chat.completions.create(**fields).choices[0].message.content
  events = [c.choices[0] for c in client.chat.completions.create(**fields, stream=True)
            if c.choices]
  contents = [e.delta.content for e in events if e.delta.content]
  assert len(contents) >= 12, contents  # 24 tokens: most of them an event of their own.
  first = next(n for n, e in enumerate(events) if e.delta.content)
  assert first <= 3 and events[-1].finish_reason == "length"  # Early, not with the end.
  assert "".join(contents).strip() == whole.strip()


def test_langchain_structured_output_and_bind_tools(srv):
  llm = langchain_openai.ChatOpenAI(base_url=srv.http_url + "/v1", api_key=h.KEYS["alice"],
                                    model="tiny", temperature=0, max_tokens=60, max_retries=0)
  result = llm.with_structured_output(Flat).invoke("Describe a pet.")
  assert isinstance(result, Flat)

  class get_time(pydantic.BaseModel):  # noqa: N801 (a tool's name, as the model sees it)
    """The time in a time zone."""
    zone: int = pydantic.Field(ge=-12, le=12)

  msg = llm.bind_tools([get_time], tool_choice="required", parallel_tool_calls=False).invoke(
      "What time is it?")
  assert [c["name"] for c in msg.tool_calls] == ["get_time"], msg
  assert all(-12 <= c["args"]["zone"] <= 12 for c in msg.tool_calls)
  auto = langchain_openai.ChatOpenAI(base_url=srv.http_url + "/v1", api_key=h.KEYS["alice"],
                                     model="tiny", max_tokens=4, max_retries=0,
                                     extra_body={"truncate_prompt": True})
  assert auto.bind_tools([get_time]).invoke("Hi").type == "ai"  # "auto": free text, parsed.


def test_grpc_constraint_oneof(srv):
  with grpc.insecure_channel(srv.grpc_address) as ch:
    stub = h.stub(ch)
    run = lambda **f: "".join(r.text for r in h.generate(stub, pb.GenerateRequest(
        **{"text": "x", "max_tokens": 80, "temperature": 1.0, "seed": 2, **f}), timeout=120))
    jsonschema.validate(json.loads(run(json_schema=json.dumps(SCHEMA))), SCHEMA)
    assert run(choice=pb.Choices(options=["up", "down"])) in ("up", "down")
    assert re.fullmatch(r"[a-c]{2}", run(regex="[a-c]{2}"))
    assert run(json_object=True, max_tokens=4).startswith("{")  # Cut by max_tokens: a start.
    with pytest.raises(grpc.RpcError) as e:
      run(grammar='start: "a" | b')
    assert (e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            and 'unknown name: "b"' in e.value.details())

"""The OpenAI-compatible HTTP API on loopback, driven by the official `openai` client; outputs
checked against the offline Runner on the same engine."""

import json
import urllib.error
import urllib.request

import openai
import pytest

from jaxserve.config import SamplingParams
from support import server_harness as h
from support.openai_http import openai_client as client

CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a prime number?"}]
CHAT_SAMPLING = dict(max_tokens=9, temperature=0.0, frequency_penalty=1.5)
TEXT = "Roses are red,"
TEXT_SAMPLING = dict(max_tokens=12, temperature=1.0, seed=21, repetition_penalty=5.0)


@pytest.fixture(scope="module")
def offline(tiny_checkpoint):
  """(prompt ids, completion) for the chat and the text case, on the engine the server will use."""
  engine, tokenizer = h.warm_engine(str(tiny_checkpoint))
  chat_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_bos=False)
  text_ids = tokenizer.encode(TEXT)
  chat, text = h.offline(engine, tokenizer, [
      (chat_ids, SamplingParams(**CHAT_SAMPLING)), (text_ids, SamplingParams(**TEXT_SAMPLING))])
  return {"chat": (chat_ids, chat), "text": (text_ids, text)}


@pytest.fixture(scope="module")
def srv_options(offline):  # The offline reference first: it shares the engine with the server.
  return dict(keys=True)


def test_streaming_chat_completion(srv, offline):
  ids, done = offline["chat"]
  stream = client(srv).chat.completions.create(
      model="tiny", messages=CHAT, stream=True, stream_options={"include_usage": True},
      **CHAT_SAMPLING)
  events = list(stream)
  assert events[0].choices[0].delta.role == "assistant"
  content = [e.choices[0].delta.content or "" for e in events if e.choices]
  assert "".join(content) == done.text
  assert len([c for c in content if c]) > 1  # It streamed, not one piece.
  finishes = [e.choices[0].finish_reason for e in events if e.choices]
  assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
  assert events[-1].usage.prompt_tokens == len(ids)
  assert events[-1].usage.completion_tokens == CHAT_SAMPLING["max_tokens"]
  assert len({e.id for e in events}) == 1 and events[0].id.startswith("chatcmpl-")


def test_chat_completion_without_streaming(srv, offline):
  ids, done = offline["chat"]
  out = client(srv).chat.completions.create(model="tiny", messages=CHAT, **CHAT_SAMPLING)
  choice = out.choices[0]
  assert (choice.message.role, choice.message.content, choice.finish_reason) == (
      "assistant", done.text, "length")
  assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
      len(ids), 9, len(ids) + 9)


def test_completions_stream_and_whole(srv, offline):
  ids, done = offline["text"]
  c = client(srv)
  extra = {"repetition_penalty": TEXT_SAMPLING["repetition_penalty"]}  # vLLM's extra field.
  common = dict(model="tiny", prompt=TEXT, max_tokens=12, temperature=1.0, seed=21,
                extra_body=extra)
  whole = c.completions.create(**common)
  assert whole.choices[0].text == done.text and whole.choices[0].finish_reason == "length"
  assert whole.usage.prompt_tokens == len(ids)
  pieces = list(c.completions.create(stream=True, **common))
  assert "".join(p.choices[0].text for p in pieces) == done.text
  by_ids = c.completions.create(model="tiny", prompt=list(ids), max_tokens=12, temperature=1.0,
                                seed=21, extra_body=extra)
  assert by_ids.choices[0].text == done.text


def test_chat_logprobs(srv):
  out = client(srv).chat.completions.create(model="tiny", messages=CHAT, max_tokens=3,
                                            temperature=0.0, logprobs=True, top_logprobs=2)
  entries = out.choices[0].logprobs.content
  assert len(entries) == 3
  for e in entries:
    assert len(e.top_logprobs) == 2
    assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    assert (e.token, e.logprob) == (e.top_logprobs[0].token, e.top_logprobs[0].logprob)  # Greedy.
  assert "".join(e.token for e in entries) == out.choices[0].message.content


def test_models(srv):
  assert [m.id for m in client(srv).models.list()] == ["tiny"]


def test_errors_have_openai_status_codes(srv):
  with pytest.raises(openai.AuthenticationError):
    client(srv, "sk-nope").models.list()
  with pytest.raises(openai.BadRequestError) as e:
    client(srv).chat.completions.create(model="tiny", messages=CHAT, temperature=-2)
  assert "temperature" in str(e.value)
  with pytest.raises(openai.NotFoundError) as e:  # 404, as OpenAI and vLLM answer it.
    client(srv).chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1)
  assert "gpt-4o" in str(e.value)
  with pytest.raises(openai.BadRequestError) as e:
    client(srv).chat.completions.create(model="tiny", messages=[{"role": "user"}], max_tokens=1)
  assert "messages[0]" in str(e.value)
  bob = client(srv, "bob")
  for _ in range(2):
    bob.completions.create(model="tiny", prompt="Hi", max_tokens=1)
  with pytest.raises(openai.RateLimitError) as e:
    bob.completions.create(model="tiny", prompt="Hi", max_tokens=1)
  assert "requests per minute" in str(e.value)


def test_a_body_that_is_not_json_is_a_400(srv):
  req = urllib.request.Request(srv.http_url + "/v1/completions", data=b"{nope", method="POST",
                               headers={"Authorization": f"Bearer {h.KEYS['alice']}"})
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(req, timeout=10)
  assert e.value.code == 400
  assert json.loads(e.value.read())["error"]["code"] == "invalid_argument"


def test_closing_the_stream_aborts_the_request(srv):
  h.wait_idle(srv)
  decoded_before = srv.scheduler.num_decode_tokens
  stream = client(srv).chat.completions.create(model="tiny", messages=CHAT, stream=True,
                                               max_tokens=95, temperature=1.0, seed=4,
                                               extra_body={"ignore_eos": True})
  for _, _ in zip(range(3), stream):
    pass
  stream.close()
  h.wait_idle(srv)
  assert srv.scheduler.num_decode_tokens - decoded_before < 60


@pytest.mark.parametrize("body", [
    {"messages": CHAT, "stop_token_ids": [{"a": 1}]},
    {"messages": CHAT, "stop_token_ids": "7"},
    {"messages": CHAT, "stop": 5},
    {"messages": CHAT, "stop": [""]},
    {"messages": CHAT, "max_tokens": "5"},
    {"messages": CHAT, "max_tokens": 2.5},
    {"messages": CHAT, "seed": 2**63},
    {"messages": CHAT, "n": 0},
    {"messages": CHAT, "logprobs": "yes"},
    {"messages": CHAT, "logprobs": True, "top_logprobs": 50},
    {"messages": CHAT, "stream": True, "stream_options": 3},
    {"messages": CHAT, "priority": "high"},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"messages": "hello"},
    {"messages": [[]]},
    [1, 2],
])
def test_bad_bodies_get_a_400_and_the_server_keeps_serving(srv, body):
  req = urllib.request.Request(srv.http_url + "/v1/chat/completions", method="POST",
                               data=json.dumps(body).encode(),
                               headers={"Authorization": f"Bearer {h.KEYS['alice']}"})
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(req, timeout=10)
  assert e.value.code == 400, e.value.read()
  out = client(srv).chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
  assert out.choices[0].finish_reason in ("length", "stop")

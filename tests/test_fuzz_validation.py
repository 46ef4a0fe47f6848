"""Property tests of request validation and of streamed detokenization with stop strings.

Validation, whatever a client sends: either a request the engine can run (every value within
its range, the prompt and max_tokens within the context window, the sampling row buildable), or
an INVALID_ARGUMENT `ApiError` naming the bad field; never any other exception. Each case spoils
one field of a valid request (the rest stay in range), so a refusal must name that field, and a
spoilt value that is in range after all must run. Checked for `client_fields.sampling_params`, the
OpenAI body parser (openai_request.py) and the gRPC request conversion, each followed by the
service's own checks (`Service.prepare`) on the real SmolLM2 tokenizer; and for raw bytes.

Detokenization (beyond tests/test_detokenizer.py): SmolLM2's single-byte tokens fed apart, with
special tokens kept or skipped; and stop strings on top (stop.OutputText), cut from the stream.
"""

from __future__ import annotations

import json
import math
import re
import types
from typing import Any, Callable

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from jaxserve.api import grpc_api, openai_request
from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.batching.constrained import Constraints
from jaxserve.batching.plan import EngineInfo
from jaxserve.batching.stop import OutputText
from jaxserve.config import SamplingParams
from jaxserve.engine.sampling_state import SamplingRow
from jaxserve.serving import client_fields, gateway
from jaxserve.serving.gateway import ApiError, Status
from jaxserve.serving.metrics import Metrics
from jaxserve.serving.requests import Prompt
from jaxserve.serving.service import Service
from jaxserve.text.detokenizer import IncrementalDetokenizer

MAX_MODEL_LEN = 128
SETTINGS = hypothesis.settings(max_examples=200, deadline=None, derandomize=True,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])
# The fields a client may set, written out here rather than read from the code under test.
SAMPLING_FIELDS = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
                   "ignore_eos"]


@pytest.fixture(scope="module")
def service(smol):
  """The service's checks over the real tokenizer; no engine behind it (nothing is submitted)."""
  info = EngineInfo(num_slots=1, page_size=16, num_pages=2, max_model_len=MAX_MODEL_LEN,
                    max_prefill_len=16, can_share_pages=True, vocab_size=smol.vocab_size)
  # The serving core's constraint gate compiles with the engine thread's real Constraints.
  runner = types.SimpleNamespace(engine_info=info,
                                 constraints=Constraints(smol, info.vocab_size, info.num_slots))
  return Service(runner, smol, "tiny", gateway.Gateway(), Metrics())


# JSON-ish values: what a decoded body can hold (NaN and Infinity included: Python's json reads
# them), with the boundaries of every range drawn often.
_EDGES = [0, 1, -1, 2, -2, 20, 21, 64, 65, 256, 257, 2**31, 2**63 - 1, 2**63, 10**400, 0.0, -0.0,
          0.5, 1.0, 1.0000001, 2.0, 2.5, 3.4e38, 3.5e38, 1e308, float("nan"), float("inf"),
          float("-inf"), "", "x", "5", True, False, None]
_SCALARS = st.one_of(st.sampled_from(_EDGES), st.integers(), st.floats(), st.text(max_size=6),
                     st.booleans(), st.none())
_JSON = st.recursive(_SCALARS, lambda v: st.lists(v, max_size=5) | st.dictionaries(
    st.text(max_size=4), v, max_size=3), max_leaves=8)
# JSON can carry lone surrogates ("\ud800"), which are no text a tokenizer can take.
_ANY_CODE_POINTS = st.lists(st.one_of(st.characters(), st.sampled_from(["\ud800", "\udfff"])),
                            max_size=20).map("".join)
_JSON_TEXT = st.one_of(st.text(max_size=20), _ANY_CODE_POINTS)
_STOP_TEXT = st.text(min_size=1, max_size=4)
_IDS = st.lists(st.integers(0, 49151), max_size=3)
# In range: a request whose fields all come from here runs.
_VALID = {
    "temperature": st.floats(0, 4), "top_k": st.integers(-1, 200),
    "top_p": st.floats(0, 1, exclude_min=True), "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.01, 4), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "seed": st.integers(-2**63, 2**63 - 1),
    "stop": st.lists(_STOP_TEXT, max_size=3), "stop_token_ids": _IDS, "ignore_eos": st.booleans(),
}


def _expect_invalid(error: ApiError, names) -> None:
  """An INVALID_ARGUMENT whose message names one of `names` as a word: `stop` is not named by
  "stop_token_ids[0] ...", nor `n` by any message with an n in it."""
  hypothesis.event("refused")
  # NOT_FOUND: a model this server does not serve (404 over HTTP, as OpenAI answers it).
  assert error.status is (Status.NOT_FOUND if "is not served here" in error.message
                          else Status.INVALID_ARGUMENT)
  named = [n for n in names if re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", error.message)]
  assert named, (error.message, names)


def _assert_runnable(sp: SamplingParams, vocab_size: int) -> None:
  """Every field in its range, by rules written out here, and the engine's row builds finite."""
  hypothesis.event("accepted")
  real = lambda x: type(x) in (int, float) and math.isfinite(x)
  assert real(sp.temperature) and sp.temperature >= 0
  assert type(sp.top_k) is int and sp.top_k >= 0
  assert real(sp.top_p) and 0 < sp.top_p <= 1
  assert real(sp.min_p) and 0 <= sp.min_p <= 1
  assert real(sp.repetition_penalty) and sp.repetition_penalty > 0
  assert real(sp.presence_penalty) and -2 <= sp.presence_penalty <= 2
  assert real(sp.frequency_penalty) and -2 <= sp.frequency_penalty <= 2
  assert sp.seed is None or (type(sp.seed) is int and -2**63 <= sp.seed < 2**63)
  assert type(sp.max_tokens) is int and sp.max_tokens >= 1
  assert type(sp.stop) is tuple and len(sp.stop) <= 64
  assert all(type(s) is str and 1 <= len(s) <= 256 for s in sp.stop)
  assert type(sp.stop_token_ids) is tuple and len(sp.stop_token_ids) <= 256
  assert all(type(i) is int and i >= 0 for i in sp.stop_token_ids)
  assert type(sp.ignore_eos) is bool and type(sp.logprobs) is int and 0 <= sp.logprobs <= 20
  with np.errstate(over="raise"):  # A value past float32 would turn into inf on the device.
    row = SamplingRow.from_params(sp, seed=sp.seed or 0, prompt_ids=(), output_ids=(),
                                  vocab_size=vocab_size)
  floats = {k: v for k, v in row.values.items() if v.dtype.kind == "f"}
  bias = floats.pop("logit_bias")  # -inf outside allowed_token_ids; never NaN or +inf.
  assert all(np.isfinite(v).all() for v in floats.values())
  assert not np.isnan(bias).any() and (bias < np.inf).all()


@st.composite
def _one_bad_field(draw, valid: dict, names: list[str], garbage: Callable[[str], Any]):
  """(target, its value, in_range, the other fields): every field but the target is in range;
  the target's value is in range (in_range True) or anything at all."""
  target = draw(st.sampled_from(names))
  others = draw(st.lists(st.sampled_from(sorted(set(valid) - {target})), max_size=3, unique=True))
  in_range = target in valid and draw(st.booleans())
  value = draw(valid[target] if in_range else garbage(target))
  return target, value, in_range, {f: draw(valid[f]) for f in others}


def _garbage(field: str) -> st.SearchStrategy:
  """Anything, the edges of the field's range often."""
  return st.one_of(_VALID[field], _SCALARS, _SCALARS, _JSON) if field in _VALID else _JSON


@SETTINGS
@hypothesis.given(case=_one_bad_field(_VALID, SAMPLING_FIELDS + ["temprature", "max_tokens"],
                                      _garbage),
                  max_tokens=st.integers(1, 127), logprobs=st.one_of(st.none(), st.integers(0, 20)))
def test_property_sampling_params_are_in_range_or_refused_by_name(case, max_tokens, logprobs):
  target, value, in_range, fields = case
  fields[target] = value
  try:
    sp = client_fields.sampling_params(fields, max_tokens, logprobs)
  except ApiError as e:
    assert not in_range, e.message
    _expect_invalid(e, [target])
    return
  _assert_runnable(sp, 128)
  assert (sp.max_tokens, sp.logprobs) == (max_tokens, 0 if logprobs is None else max(logprobs, 1))
  for name, v in fields.items():  # What the client set is what runs.
    assert getattr(sp, name) == (tuple(v) if name in ("stop", "stop_token_ids") else v)


def _assert_prepared(service, prepared) -> None:
  ids, sp = prepared.prompt_ids, prepared.sampling
  assert ids and all(type(i) is int and 0 <= i < service.vocab_size for i in ids)
  assert len(ids) + sp.max_tokens <= MAX_MODEL_LEN
  assert all(i < service.vocab_size for i in sp.stop_token_ids)
  _assert_runnable(sp, service.vocab_size)


# OpenAI bodies. In range: short prompts and max_tokens <= 16, so any mix fits the context.
_TEXT = st.text(min_size=1, max_size=20)
_VALID_ROLES = st.sampled_from(["system", "user", "assistant"])
_MESSAGES = st.lists(st.fixed_dictionaries({"role": _VALID_ROLES, "content": st.text(max_size=20)}),
                     min_size=1, max_size=2)
_HTTP_VALID = {
    **_VALID, "stop": st.one_of(_STOP_TEXT, _VALID["stop"]),
    "prompt": st.one_of(_TEXT, st.lists(st.integers(0, 49151), min_size=1, max_size=8)),
    "messages": _MESSAGES, "max_tokens": st.integers(1, 16), "model": st.sampled_from(["tiny", ""]),
    "n": st.just(1), "stream": st.booleans(), "truncate_prompt": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "priority": st.integers(-5, 5), "user": st.text(max_size=5),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=4),
    "allowed_token_ids": st.lists(st.integers(0, 49151), min_size=1, max_size=3),
    "store": st.booleans(), "metadata": st.just({"a": "b"}), "service_tier": st.just("auto"),
}
_COMPLETION_VALID = {**_HTTP_VALID, "logprobs": st.integers(0, 20)}
# top_logprobs 0: above 0 it needs logprobs true (refused without, as OpenAI does), and the
# fields are drawn one by one.
_CHAT_VALID = {**_HTTP_VALID, "logprobs": st.booleans(), "top_logprobs": st.just(0),
               "max_completion_tokens": st.integers(1, 16)}
_ROLES = st.sampled_from(["system", "user", "assistant", "tool", "wizard", "", None, 5, ["user"]])
_PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                         "text": st.one_of(_JSON_TEXT, _SCALARS)}), max_size=2)
_MESSAGE = st.one_of(st.fixed_dictionaries(
    {"role": _ROLES, "content": st.one_of(_JSON_TEXT, _SCALARS, _PARTS)}), _JSON)
_HTTP_GARBAGE = {  # Near misses as well as any JSON.
    "prompt": st.one_of(_JSON_TEXT, st.lists(st.integers(-2, 50_000), max_size=4),
                        st.lists(_JSON_TEXT, max_size=2)),
    "messages": st.lists(_MESSAGE, max_size=3),
    "stop_token_ids": st.lists(st.integers(-2, 60_000) | st.integers(49150, 49153), max_size=3),
    "stream_options": st.fixed_dictionaries({"include_usage": _SCALARS}),
}
# The fields whose bad values reach furthest (the tokenizer, the engine's stop ids) drawn more.
_BODY_KEYS = sorted(set(_CHAT_VALID) | {"temprature", "best_of", "echo", "tools"}) + [
    "prompt", "messages"] * 10 + ["stop_token_ids", "stop", "max_tokens", "temperature"] * 2


def _http_garbage(field: str) -> st.SearchStrategy:
  near = _HTTP_GARBAGE.get(field, _VALID.get(field, _SCALARS))
  return st.one_of(near, near, near, _SCALARS, _JSON, st.none())  # None: as if not sent.


@hypothesis.settings(SETTINGS, max_examples=300)
@hypothesis.given(chat=st.booleans(), data=st.data())
def test_property_http_bodies_run_or_are_refused_by_name(service, chat, data):
  valid = _CHAT_VALID if chat else _COMPLETION_VALID
  valid = {k: v for k, v in valid.items() if k != ("prompt" if chat else "messages")}
  target, value, in_range, body = data.draw(_one_bad_field(valid, _BODY_KEYS, _http_garbage))
  text_key = "messages" if chat else "prompt"
  body.setdefault(text_key, data.draw(valid[text_key]))
  body[target] = value
  parse = openai_request.chat_request if chat else openai_request.completion_request
  try:
    req = parse(body)
    prepared = service.prepare(req.input)
  except ApiError as e:
    assert not in_range, e.message
    _expect_invalid(e, [target])
    return
  assert type(req.stream) is bool and type(req.include_usage) is bool
  _assert_prepared(service, prepared)


@SETTINGS
@hypothesis.given(text=_ANY_CODE_POINTS, where=st.sampled_from(["prompt", "content", "part"]))
@hypothesis.example(text="\x16", where="prompt")  # Found by this property: it tokenizes to [].
def test_property_any_code_points_are_tokenized_or_refused_by_name(service, text, where):
  """Text fields as JSON can spell them, lone surrogates and all."""
  chat = {"content": [{"role": "user", "content": text}],
          "part": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
  try:
    if where == "prompt":
      req = openai_request.completion_request({"prompt": text, "max_tokens": 4})
    else:
      req = openai_request.chat_request({"messages": chat[where], "max_tokens": 4})
    ids = service.prepare(req.input).prompt_ids
  except ApiError as e:
    _expect_invalid(e, ["prompt", "messages[0].content"])
    # Empty: no text, or text the tokenizer drops whole (SmolLM2's drops "\x16").
    if "is empty" in e.message or (text == "" and where == "prompt"):
      assert where == "prompt" and "is empty" in e.message and not service.tokenizer.encode(text)
    return
  assert all(0 <= i < service.vocab_size for i in ids)
  text.encode("utf-8")  # Only valid Unicode got through.


@SETTINGS
@hypothesis.given(messages=st.lists(_MESSAGE, max_size=3))
def test_property_chat_messages_are_rendered_or_refused_by_name(service, messages):
  try:
    req = openai_request.chat_request({"messages": messages, "max_tokens": 4})
    ids = service.prepare(req.input).prompt_ids
  except ApiError as e:
    # Which message, or which of its fields; a prompt too long for the window names the prompt.
    _expect_invalid(e, ["messages", *(f"messages[{n}]" for n in range(len(messages))), "prompt"])
    return
  assert all(0 <= i < service.vocab_size for i in ids)
  assert all(m["role"] in ("system", "user", "assistant", "tool") for m in messages)


@SETTINGS
@hypothesis.given(data=st.one_of(st.binary(max_size=64),
                                 _JSON.map(lambda v: json.dumps(v).encode()),
                                 _JSON_TEXT.map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_property_any_body_bytes_parse_to_an_object_or_are_refused(data):
  try:
    body = openai_request.parse_body(data)
  except ApiError as e:
    _expect_invalid(e, ["request body"])
    return
  assert isinstance(body, dict) and body == json.loads(data)


# gRPC requests: every field within its proto type.
_PROTO_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
_CHAT = lambda roles, min_size: st.lists(
    st.tuples(roles, _PROTO_TEXT), min_size=min_size, max_size=2).map(
    lambda m: pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in m]))
_GRPC_VALID = {
    **_VALID, "max_tokens": st.integers(1, 16), "logprobs": st.integers(0, 20),
    "chunk_tokens": st.integers(0, 8), "priority": st.integers(-2**31, 2**31 - 1),
    "request_id": st.text(st.characters(categories=["L", "N"]), max_size=12),
    "model": st.sampled_from(["", "tiny"]), "truncate_prompt": st.booleans(),
    "text": _TEXT, "token_ids": st.lists(st.integers(0, 49151), min_size=1, max_size=8).map(
        lambda i: pb.TokenIds(ids=i)),
    "chat": _CHAT(st.sampled_from(["system", "user", "assistant"]), 1),
}
_DOUBLE = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0, 1e39, 1e308]), st.floats())
_GRPC_GARBAGE = {
    **{f: _DOUBLE for f in ("temperature", "top_p", "min_p", "repetition_penalty",
                            "presence_penalty", "frequency_penalty")},
    "top_k": st.integers(-2**31, 2**31 - 1), "seed": st.sampled_from([-2**63, -1, 2**63 - 1]),
    "max_tokens": st.integers(0, 2**32 - 1) | st.integers(0, 130),
    "logprobs": st.integers(0, 2**32 - 1) | st.integers(0, 22),
    "chunk_tokens": st.integers(0, 2**32 - 1) | st.integers(4090, 4100),
    "stop": st.lists(_PROTO_TEXT, max_size=70),
    "stop_token_ids": st.lists(st.integers(-2**31, 2**31 - 1) | st.integers(49150, 49153),
                               max_size=3),
    "ignore_eos": st.booleans(), "priority": st.integers(-2**31, 2**31 - 1),
    "request_id": _PROTO_TEXT | st.text(min_size=250, max_size=260),
    "truncate_prompt": st.booleans(),
    "model": st.sampled_from(["", "tiny", "gpt-4"]), "text": _PROTO_TEXT,
    "token_ids": st.lists(st.integers(-2**31, 2**31 - 1) | st.integers(0, 100), max_size=140).map(
        lambda i: pb.TokenIds(ids=i)),
    "chat": _CHAT(st.sampled_from(["user", "system", "assistant", "bot", ""]), 0),
}
_PROMPTS = ("text", "token_ids", "chat")


@SETTINGS
@hypothesis.given(data=st.data())
def test_property_grpc_requests_run_or_are_refused_by_name(service, data):
  valid = {k: v for k, v in _GRPC_VALID.items() if k not in _PROMPTS}
  target, value, in_range, fields = data.draw(_one_bad_field(
      {**valid, **{p: _GRPC_VALID[p] for p in _PROMPTS}}, sorted(_GRPC_GARBAGE),
      lambda f: _GRPC_GARBAGE[f]))
  for prompt in _PROMPTS:  # Exactly one prompt (a oneof): the target, or one in range.
    fields.pop(prompt, None)
  if target not in _PROMPTS:
    prompt = data.draw(st.sampled_from(_PROMPTS))
    fields[prompt] = data.draw(_GRPC_VALID[prompt])
  request = pb.GenerateRequest(**fields, **{target: value})
  try:
    prepared = service.prepare(grpc_api.generate_input(request))
    chunk_tokens = prepared.chunk_tokens
  except ApiError as e:
    assert not in_range, e.message
    # A prompt is named as the prompt, its token ids or its chat messages.
    _expect_invalid(e, [target, *(["prompt", "messages"] if target in _PROMPTS else [])])
    return
  assert 1 <= chunk_tokens <= client_fields.MAX_CHUNK_TOKENS
  _assert_prepared(service, prepared)


@SETTINGS
@hypothesis.given(data=st.binary(max_size=64))
def test_property_any_grpc_bytes_decode_or_become_an_invalid_argument(data):
  request = grpc_api._decoder(pb.GenerateRequest)(data)
  try:
    request = grpc_api._decoded(request)
  except ApiError as e:
    _expect_invalid(e, ["not a valid message"])
    return
  assert isinstance(request, pb.GenerateRequest)


# Detokenization: SmolLM2's byte-level BPE has a token per byte; the bytes of a multi-byte
# character, fed apart and mixed with whole tokens, must never show up split.


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> character table, written out from its definition."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  table, n = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b], n = chr(256 + n), n + 1
  return table


@pytest.fixture(scope="module")
def byte_tokens(smol):
  ids = {b: smol.token_to_id(c) for b, c in _bytes_to_unicode().items()}
  ids = {b: i for b, i in ids.items() if i is not None}
  assert smol.detokenize([ids[0xC3], ids[0xA9]]) == "é"  # Two byte tokens make one character.
  return ids


def _smol_ids(smol, byte_tokens):
  multi = [byte_tokens[b] for b in "é日😀".encode() if b in byte_tokens]
  return st.one_of(st.sampled_from(multi), st.sampled_from(sorted(byte_tokens.values())),
                   st.sampled_from(smol.encode("Hi <|im_end|> there, world!")
                                   + sorted(smol.stop_ids)),
                   st.integers(0, smol.vocab_size - 1))


@hypothesis.settings(SETTINGS, max_examples=150)
@hypothesis.given(data=st.data())
def test_property_byte_tokens_stream_to_the_full_decode(smol, byte_tokens, data):
  ids = data.draw(st.lists(_smol_ids(smol, byte_tokens), max_size=30))
  skip = data.draw(st.booleans())
  detok = IncrementalDetokenizer(smol, skip_special_tokens=skip)
  deltas, pos = [], 0
  while pos < len(ids):
    size = data.draw(st.integers(1, 3))
    deltas.append(detok.add(ids[pos:pos + size]))
    pos += size
  deltas.append(detok.flush())
  full = smol.detokenize(ids, skip_special_tokens=skip)
  assert "".join(deltas) == full
  if "\ufffd" not in full:  # A character is never sent in two halves.
    assert not any("\ufffd" in d for d in deltas)


@hypothesis.settings(SETTINGS, max_examples=150)
@hypothesis.given(data=st.data())
def test_property_stop_strings_cut_the_stream_before_the_first_stop(smol, byte_tokens, data):
  ids = data.draw(st.lists(_smol_ids(smol, byte_tokens), min_size=1, max_size=30))
  full = smol.detokenize(ids)
  # Stop strings that occur in the text (substrings of it), and some that may not.
  some = st.text(min_size=1, max_size=3)
  cut = st.tuples(st.integers(0, len(full) - 1), st.integers(1, 6)).map(
      lambda p: full[p[0]:p[0] + p[1]]) if full else some
  stops = data.draw(st.lists(st.one_of(cut, some), max_size=3))
  out = OutputText(IncrementalDetokenizer(smol), SamplingParams(stop=stops), frozenset())
  sent, pos = [], 0
  while pos < len(ids) and out.stop_string is None:
    size = data.draw(st.integers(1, 3))
    sent.append(out.add(ids[pos:pos + size]))
    pos += size
  sent.append(out.finish())
  text = "".join(sent)
  assert text == out.text and full.startswith(text)
  assert not any(s in text for s in stops)  # No stop string, whole, was ever sent.
  hypothesis.event(f"stopped: {out.stop_string is not None}")
  if out.stop_string is None:
    assert text == full
  else:
    assert out.stop_string in stops and full[len(text):].startswith(out.stop_string)


def test_a_developer_message_is_a_system_one_from_either_front_end(service):
  """OpenAI's `developer` role: the service maps it, so gRPC chat gets it as HTTP does."""
  def ids(role):
    return service.prompts.encode(Prompt(messages=[{"role": role, "content": "Be brief."},
                                           {"role": "user", "content": "Hi"}]))
  assert ids("developer") == ids("system") != ids("user")

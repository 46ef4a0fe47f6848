"""Malformed requests, one table over gRPC and HTTP: each gets a specific status and a message
naming the field or the problem, and after each the server is still healthy and serves the next
valid request; after them all, no slot or KV page is left taken."""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from typing import Any, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.api.proto import jaxserve_pb2 as pb
from support import server_harness as h

VOCAB = 49152  # The tiny checkpoint has the default model's (SmolLM2's) tokenizer.
INVALID = grpc.StatusCode.INVALID_ARGUMENT
HUGE = "a" * 10_000_000  # 10 MB: over both front ends' 8 MiB limit.
LONG = "word " * 400_000  # 2 MB: under the limit, but far more than 128 tokens of any text.
CHAT = [{"role": "user", "content": "Hi"}]


@dataclasses.dataclass
class Client:
  channel: grpc.Channel
  http_url: str

  def generate(self, req: pb.GenerateRequest, metadata=h.auth()) -> tuple[Any, str]:
    try:
      msgs = list(h.stub(self.channel).Generate(req, metadata=metadata, timeout=30))
      return grpc.StatusCode.OK, pb.FinishReason.Name(msgs[-1].finish_reason)
    except grpc.RpcError as e:
      return e.code(), e.details()

  def tokenize(self, req: pb.TokenizeRequest) -> tuple[Any, str]:
    try:
      return grpc.StatusCode.OK, str(h.stub(self.channel).Tokenize(req, metadata=h.auth(),
                                                                   timeout=30))
    except grpc.RpcError as e:
      return e.code(), e.details()

  def raw(self, method: str, data: bytes) -> tuple[Any, str]:
    """Sends `data` as the request message as it is: bytes no protobuf library would write."""
    call = self.channel.unary_stream(f"/jaxserve.v1.Jaxserve/{method}",
                                     request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
    try:
      list(call(data, metadata=h.auth(), timeout=30))
      return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
      return e.code(), e.details()

  def http(self, path: str, data: bytes | None, method: str = "POST",
           key: str = h.KEYS["alice"]) -> tuple[int, str]:
    """(status, the error message of an OpenAI-shaped JSON error body)."""
    req = urllib.request.Request(self.http_url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {key}"})
    try:
      with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
      assert e.headers["Content-Type"].startswith("application/json")
      error = json.loads(e.read())["error"]
      assert set(error) >= {"message", "type", "code"}
      return e.code, error["message"]


@dataclasses.dataclass(frozen=True)
class Case:
  id: str
  send: Callable[[Client], tuple[Any, str]]  # -> (status, message)
  status: Any  # A grpc.StatusCode, or an HTTP status.
  named: str  # In the message: the field, the value or the problem.

  @property
  def over_http(self) -> bool:
    return isinstance(self.status, int)


def gen(case_id: str, named: str, status=INVALID, **fields) -> Case:
  return Case(case_id, lambda c: c.generate(pb.GenerateRequest(**fields)), status, named)


def ids(*token_ids: int) -> pb.TokenIds:
  return pb.TokenIds(ids=token_ids)


def chat(*messages: tuple[str, str]) -> pb.ChatMessages:
  return pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])


def raw(case_id: str, method: str, data: bytes, named: str) -> Case:
  return Case(case_id, lambda c: c.raw(method, data), INVALID, named)


def post(case_id: str, body: Any, named: str, status: int = 400, path: str = "/v1/completions",
         **kw) -> Case:
  """`body` bytes go as they are; anything else as JSON."""
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  return Case(case_id, lambda c: c.http(path, data, **kw), status, named)


def post_chat(case_id: str, body: Any, named: str, status: int = 400) -> Case:
  return post(case_id, body, named, status, path="/v1/chat/completions")


def _bad_utf8(req, good: bytes, bad: bytes) -> bytes:
  """The request's bytes with `good` replaced by `bad` (same length: the framing stays right)."""
  assert len(good) == len(bad)
  data = req.SerializeToString()
  assert data.count(good) == 1
  return data.replace(good, bad)


P = {"prompt": "Hi", "max_tokens": 1}  # A valid completions body, to spoil one field at a time.
M = {"messages": CHAT, "max_tokens": 1}

CASES = [
    # gRPC Generate: the prompt.
    gen("grpc-empty-text", "prompt is empty", text=""),
    gen("grpc-no-prompt", "exactly one of text, token ids or chat", max_tokens=1),
    gen("grpc-empty-token-ids", "prompt is empty", token_ids=ids()),
    gen("grpc-token-id-past-vocab", f"token_ids[1] is {VOCAB}, outside the vocabulary",
        token_ids=ids(5, VOCAB)),
    gen("grpc-negative-token-id", "token_ids[0] is -1", token_ids=ids(-1)),
    gen("grpc-no-chat-messages", "messages must be a non-empty list", chat=chat()),
    gen("grpc-unknown-chat-role", "messages[1] has role 'wizard'",
        chat=chat(("user", "Hi"), ("wizard", "x"))),
    gen("grpc-empty-chat-role", "messages[0] has role ''", chat=chat(("", "Hi"))),
    gen("grpc-image-to-text-model", "model 'tiny' does not accept images", chat=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="Hi", images=[b"\x89PNG"])])),
    gen("grpc-prompt-over-the-context", "context window", token_ids=ids(*range(1, 126)),
        max_tokens=4),
    gen("grpc-unknown-model", "model 'gpt-4' is not served here", status=grpc.StatusCode.NOT_FOUND,
        text="Hi", model="gpt-4"),
    gen("grpc-too-many-token-ids-checked-before-each-id", "cannot fit in the context window",
        token_ids=ids(*([VOCAB + 5] * 200))),  # The length is refused before any id is read.
    # gRPC Generate: sampling.
    gen("grpc-temperature-nan", "temperature must be >= 0 and finite (at most 3.4e38), got nan",
        text="Hi", temperature=float("nan")),
    gen("grpc-temperature-inf", "temperature must be >= 0 and finite", text="Hi",
        temperature=float("inf")),
    gen("grpc-temperature-negative",
        "temperature must be >= 0 and finite (at most 3.4e38), got -0.5",
        text="Hi", temperature=-0.5),
    gen("grpc-top-p-zero", "top_p must be in (0, 1], got 0.0", text="Hi", top_p=0.0),
    gen("grpc-top-p-above-one", "top_p must be in (0, 1], got 1.01", text="Hi", top_p=1.01),
    gen("grpc-top-k-negative", "top_k must be an int >= 0 (or -1: off), got -2", text="Hi",
        top_k=-2),
    gen("grpc-min-p-above-one", "min_p", text="Hi", min_p=1.5),
    gen("grpc-repetition-penalty-zero", "repetition_penalty", text="Hi", repetition_penalty=0.0),
    gen("grpc-presence-penalty-nan", "presence_penalty", text="Hi", presence_penalty=float("nan")),
    gen("grpc-frequency-penalty-minus-inf", "frequency_penalty", text="Hi",
        frequency_penalty=float("-inf")),
    gen("grpc-max-tokens-zero", "max_tokens must be in [1, 128)", text="Hi", max_tokens=0),
    gen("grpc-max-tokens-huge", "max_tokens must be in [1, 128)", text="Hi", max_tokens=2**32 - 1),
    gen("grpc-logit-bias-over-100", "logit_bias[7] must be a number in [-100, 100]", text="Hi",
        logit_bias={7: 100.5}),
    gen("grpc-logit-bias-past-vocab", f"logit_bias has token id {VOCAB}", text="Hi",
        logit_bias={VOCAB: 1.0}),
    gen("grpc-allowed-token-id-past-vocab", f"allowed_token_ids[1] is {VOCAB}", text="Hi",
        allowed_token_ids=[3, VOCAB]),
    gen("grpc-logprobs-21", "logprobs must be in [0, 20], got 21", text="Hi", logprobs=21),
    gen("grpc-chunk-tokens-huge", "chunk_tokens", text="Hi", chunk_tokens=2**31),
    gen("grpc-10000-stop-strings", "stop must hold at most 64 strings, not 10000", text="Hi",
        stop=[f"s{i}" for i in range(10_000)]),
    gen("grpc-empty-stop-string", "stop[1] must be a non-empty string", text="Hi", stop=["x", ""]),
    gen("grpc-stop-string-too-long", "stop[0] must be a non-empty string of at most 256",
        text="Hi", stop=["x" * 10_000]),
    gen("grpc-stop-token-id-past-vocab", f"stop_token_ids[1] is {VOCAB}", text="Hi",
        stop_token_ids=[2, VOCAB]),
    gen("grpc-stop-token-id-negative", "stop_token_ids[0] is -3", text="Hi", stop_token_ids=[-3]),
    gen("grpc-request-id-too-long", "request_id must be at most 256", text="Hi",
        request_id="r" * 1000),
    gen("grpc-request-id-control-chars", "request_id", text="Hi", request_id="a\nb"),
    # gRPC: keys, sizes, bytes that are no message.
    Case("grpc-no-key", lambda c: c.generate(pb.GenerateRequest(text="Hi"), metadata=()),
         grpc.StatusCode.UNAUTHENTICATED, "missing API key"),
    Case("grpc-wrong-key", lambda c: c.generate(pb.GenerateRequest(text="Hi"),
                                                metadata=(("authorization", "Bearer sk-no"),)),
         grpc.StatusCode.UNAUTHENTICATED, "invalid API key"),
    gen("grpc-10mb-prompt", "larger than max", status=grpc.StatusCode.RESOURCE_EXHAUSTED,
        text=HUGE),
    gen("grpc-2mb-prompt", "cannot fit in the context window", text=LONG),
    gen("grpc-2mb-chat", "cannot fit in the context window", chat=chat(("user", LONG))),
    Case("grpc-tokenize-2mb", lambda c: c.tokenize(pb.TokenizeRequest(text=LONG)), INVALID,
         "cannot fit in the context window"),
    raw("grpc-text-not-utf8", "Generate",
        _bad_utf8(pb.GenerateRequest(text="hello", max_tokens=1), b"hello", b"hel\xffo"),
        "String field had bad UTF-8"),
    raw("grpc-chat-content-not-utf8", "Generate",
        _bad_utf8(pb.GenerateRequest(chat=chat(("user", "hello"))), b"hello", b"he\xc3\x28o"),
        "bad UTF-8"),
    raw("grpc-not-protobuf", "Generate", b"\xff\xff\xff\xff", "not a valid message"),
    raw("grpc-truncated-message", "Generate",
        pb.GenerateRequest(text="hello").SerializeToString()[:4], "not a valid message"),
    raw("grpc-model-info-not-protobuf", "GetModelInfo", b"\x0a\x05ab", "not a valid message"),
    # gRPC Tokenize.
    Case("tokenize-unknown-model", lambda c: c.tokenize(pb.TokenizeRequest(text="Hi", model="x")),
         grpc.StatusCode.NOT_FOUND, "model 'x'"),
    Case("tokenize-no-prompt", lambda c: c.tokenize(pb.TokenizeRequest()), INVALID,
         "exactly one of"),
    Case("tokenize-unknown-chat-role",
         lambda c: c.tokenize(pb.TokenizeRequest(chat=chat(("robot", "Hi")))), INVALID,
         "messages[0] has role 'robot'"),
    raw("tokenize-text-not-utf8", "Tokenize",
        _bad_utf8(pb.TokenizeRequest(text="hello"), b"hello", b"\xfehell"), "bad UTF-8"),
    # HTTP: the body.
    post("http-not-json", b"{nope", "the request body is not JSON"),
    post("http-empty-body", b"", "the request body is not JSON"),
    post("http-json-array", [P], "must be a JSON object, got an array"),
    post("http-json-string", "Hi", "must be a JSON object, got a string"),
    post("http-not-utf8", b'{"prompt": "caf\xe9", "max_tokens": 1}', "not valid UTF-8"),
    post("http-nested-too-deeply", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    post("http-10mb-body", {"prompt": HUGE}, "over the limit of 8388608 bytes", status=413),
    post("http-2mb-prompt", {"prompt": LONG}, "cannot fit in the context window"),
    post("http-lone-surrogate", b'{"prompt": "a\\ud800b", "max_tokens": 1}',
         "prompt is not valid Unicode"),
    post("http-wrong-key", P, "invalid API key", status=401, key="sk-nope"),
    post("http-get-not-post", None, "does not take GET", status=405, method="GET"),
    post("http-no-such-path", P, "no endpoint /v1/complete", status=404, path="/v1/complete"),
    # HTTP /v1/completions: fields.
    post("http-no-prompt", {"max_tokens": 1}, "prompt must be a string, a list of token ids"),
    post("http-prompt-number", {**P, "prompt": 7}, "prompt must be a string"),
    post("http-empty-prompt", {**P, "prompt": ""}, "prompt is empty"),
    post("http-prompt-mixed-list", {**P, "prompt": ["a", 5]}, "or a list of those, got ['a', 5]"),
    post("http-prompt-id-past-vocab", {**P, "prompt": [1, VOCAB]}, "prompt token_ids[1]"),
    post("http-prompt-id-bool", {**P, "prompt": [True, 1]}, "token_ids[0] must be a token id"),
    post("http-prompt-id-string", {**P, "prompt": [1, "a"]}, "token_ids[1] must be a token id"),
    post("http-too-many-token-ids-checked-before-each-id", {**P, "prompt": [1, "a", VOCAB] * 100},
         "cannot fit in the context window"),  # The length is refused before any id is read.
    post("http-max-tokens-negative", {**P, "max_tokens": -5}, "max_tokens must be an int >= 1"),
    post("http-max-tokens-huge", {**P, "max_tokens": 10**30}, "max_tokens must be in [1, 128)"),
    post("http-max-tokens-string", {**P, "max_tokens": "5"}, "max_tokens must be an int"),
    post("http-temperature-nan", b'{"prompt": "Hi", "temperature": NaN}', "temperature"),
    post("http-temperature-infinity", b'{"prompt": "Hi", "temperature": Infinity}', "temperature"),
    post("http-temperature-true", {**P, "temperature": True},
         "temperature must be >= 0 and finite"),
    post("http-temperature-1e39", {**P, "temperature": 1e39}, "(at most 3.4e38), got 1e+39"),
    post("http-temperature-string", {**P, "temperature": "hot"}, "temperature"),
    post("http-temperature-too-big-for-a-float", {**P, "temperature": 10**400}, "temperature"),
    post("http-top-p-two", {**P, "top_p": 2}, "top_p must be in (0, 1]"),
    post("http-top-k-negative", {**P, "top_k": -2}, "top_k"),
    post("http-seed-float", {**P, "seed": 1.5}, "seed"),
    post("http-seed-over-64-bits", {**P, "seed": 2**63}, "seed must be None or a signed 64-bit"),
    post("http-ignore-eos-string", {**P, "ignore_eos": "yes"}, "ignore_eos must be true or false"),
    post("http-10000-stop-strings", {**P, "stop": ["s"] * 10_000}, "stop must hold at most 64"),
    post("http-stop-number", {**P, "stop": 5}, "stop must be a list of strings"),
    post("http-stop-object", {**P, "stop": {"a": 1}}, "stop must be a list of strings"),
    post("http-stop-token-id-past-vocab", {**P, "stop_token_ids": [10**6]}, "stop_token_ids[0]"),
    post("http-stop-token-ids-string", {**P, "stop_token_ids": "7"}, "stop_token_ids"),
    post("http-n-0", {**P, "n": 0}, "n must be in [1, 64]"),
    post("http-best-of-below-n", {**P, "n": 3, "best_of": 2}, "best_of must be an int >= n (3)"),
    post("http-logit-bias-over-100", {**P, "logit_bias": {"5": 101}},
         "logit_bias[5] must be a number in [-100, 100]"),
    post("http-logit-bias-301-ids", {**P, "logit_bias": {str(i): 1 for i in range(301)}},
         "at most 300 token ids"),
    post("http-logit-bias-not-an-id", {**P, "logit_bias": {"the": 1}}, "keys must be token ids"),
    post("http-logit-bias-past-vocab", {**P, "logit_bias": {str(VOCAB): 1}},
         f"logit_bias has token id {VOCAB}"),
    post("http-allowed-token-ids-empty", {**P, "allowed_token_ids": []},
         "allowed_token_ids must be a non-empty list"),
    post("http-response-format-bad-schema", {**P, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "json_schema constraint is invalid"),
    post("http-guided-regex-unclosed", {**P, "guided_regex": "(("}, "regex constraint is invalid"),
    post("http-guided-json-and-regex", {**P, "guided_json": {}, "guided_regex": "a"},
         "give at most one of response_format"),
    post("http-unknown-field", {**P, "temprature": 0.5}, "does not take 'temprature'"),
    # vllm-router adds these at their defaults, which are taken (tests/test_router.py); others
    # ask for what jaxserve does not do.
    post("http-router-field-off-default", {**P, "skip_special_tokens": False},
         "does not take 'skip_special_tokens'"),
    post_chat("http-continue-final-message", {"messages": CHAT, "continue_final_message": True},
              "does not take 'continue_final_message'"),
    post("http-unknown-model", {**P, "model": "gpt-4o"}, "model 'gpt-4o' is not served",
         status=404),
    post("http-unknown-model-route", None, "model 'gpt-4o' is not served", status=404,
         method="GET", path="/v1/models/gpt-4o"),
    post("http-tokenize-both-prompts", {"prompt": "a", "messages": CHAT}, "exactly one of prompt",
         path="/tokenize"),
    post("http-tokenize-unknown-field", {"prompt": "a", "text": "b"}, "does not take 'text'",
         path="/tokenize"),
    post("http-tokenize-unknown-model", {"prompt": "a", "model": "x"}, "model 'x'", status=404,
         path="/tokenize"),
    post("http-detokenize-past-vocab", {"tokens": [1, VOCAB]}, f"tokens[1] is {VOCAB}",
         path="/detokenize"),
    post("http-detokenize-not-a-list", {"tokens": "12"}, "tokens must be a list",
         path="/detokenize"),
    post("http-model-not-a-string", {**P, "model": ["tiny"]}, "model must be a string"),
    post("http-stream-string", {**P, "stream": "yes"}, "stream must be true or false"),
    post("http-include-usage-string", {**P, "stream": True, "stream_options": {"include_usage": 1}},
         "include_usage must be true or false"),
    post("http-truncate-prompt-string", {**P, "truncate_prompt": "no"}, "truncate_prompt"),
    post("http-priority-string", {**P, "priority": "high"}, "priority must be an int"),
    # HTTP /v1/chat/completions.
    post_chat("chat-no-messages", {"max_tokens": 1}, "messages must be a non-empty list"),
    post_chat("chat-empty-messages", {**M, "messages": []}, "messages must be a non-empty list"),
    post_chat("chat-message-not-object", {**M, "messages": ["Hi"]},
              "messages[0] must be an object"),
    post_chat("chat-unknown-role", {**M, "messages": [{"role": "wizard", "content": "x"}]},
              "messages[0] has role 'wizard'"),
    post_chat("chat-role-not-string", {**M, "messages": [{"role": ["user"], "content": "x"}]},
              "messages[0].role must be a string"),
    post_chat("chat-no-content", {**M, "messages": [{"role": "user"}]},
              "messages[0].content must be a string"),
    post_chat("chat-content-number", {**M, "messages": [{"role": "user", "content": 5}]},
              "messages[0].content must be a string"),
    post_chat("chat-image-part", {**M, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
              "model 'tiny' does not accept images: it is a text-only model"),
    post_chat("chat-audio-part", {**M, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {}}]}]}, "messages[0].content[0] must be a text "
              "part {\"type\": \"text\", \"text\": ...} or an image part"),
    post_chat("chat-text-part-not-string", {**M, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0]"),
    post_chat("chat-lone-surrogate", b'{"messages": [{"role": "user", "content": "\\udc80"}]}',
              "messages[0].content is not valid Unicode"),
    post_chat("chat-logprobs-string", {**M, "logprobs": "yes"}, "logprobs must be true or false"),
    post_chat("chat-top-logprobs-50", {**M, "logprobs": True, "top_logprobs": 50},
              "top_logprobs must be an int in [0, 20]"),
    post_chat("chat-top-logprobs-without-logprobs", {**M, "top_logprobs": 3},
              "top_logprobs needs logprobs: true"),
    post_chat("chat-max-completion-tokens-zero", {**M, "max_completion_tokens": 0},
              "max_completion_tokens must be an int >= 1"),
    post_chat("chat-tools", {**M, "tools": [{"type": "function"}]}, "tools must be a list of"),
    post_chat("chat-tool-calls-not-a-list", {**M, "messages": [
        {"role": "assistant", "content": None, "tool_calls": "x"}]},
              "messages[0].tool_calls must be a list"),
]


@pytest.fixture(scope="module")
def srv_options():
  return dict(keys=True)


@pytest.fixture(scope="module")
def client(srv):
  with grpc.insecure_channel(srv.grpc_address) as channel:
    info = h.stub(channel).GetModelInfo(pb.GetModelInfoRequest(), metadata=h.auth(), timeout=30)
    assert info.vocab_size == VOCAB
    yield Client(channel, srv.http_url)


def test_the_table_is_big_and_covers_both_front_ends():
  assert len(CASES) >= 40
  assert len({c.id for c in CASES}) == len(CASES)
  assert sum(c.over_http for c in CASES) >= 20 and sum(not c.over_http for c in CASES) >= 20


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_request_is_refused_by_name_and_the_server_keeps_serving(client, case):
  status, message = case.send(client)
  assert (status, case.named in message) == (case.status, True), message[:500]
  assert len(message) <= 1100  # Bad values are quoted cut short, not echoed whole.
  health = health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(),
                                                             timeout=10)
  assert health.status == health_pb2.HealthCheckResponse.SERVING
  if case.over_http:
    status, body = client.http("/v1/completions", json.dumps(P).encode())
    assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] in ("length", "stop")
  else:
    assert client.generate(pb.GenerateRequest(text="Hi", max_tokens=1)) in (
        (grpc.StatusCode.OK, "FINISH_REASON_LENGTH"), (grpc.StatusCode.OK, "FINISH_REASON_STOP"))


def test_after_the_table_every_slot_and_block_is_free(client, srv):
  h.wait_idle(srv)


def test_a_long_prompt_is_cut_to_its_tail_with_truncate_prompt(client):
  """The same 2 MB that is refused above is taken, cut before tokenizing, with truncate_prompt."""
  assert client.generate(pb.GenerateRequest(text=LONG + "end", max_tokens=2, ignore_eos=True,
                                            truncate_prompt=True)) == (
      grpc.StatusCode.OK, "FINISH_REASON_LENGTH")

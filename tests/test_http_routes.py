"""What real OpenAI / vLLM clients send beyond the basics (issue 17): the health, model and
tokenizer routes, OpenAI's fields that do not apply here, logit_bias, and the defaults and
logprob details clients read; outputs checked against the offline Runner on a twin of the
served engine (its own KV cache). And vLLM's admin routes for a training loop (issue 49): pause
and resume under a load of streams loses none, sleep and wake_up give the same text."""

import concurrent.futures
import pathlib
import time
import urllib.parse

import openai
import pytest

from jaxserve.api import http_admin
from jaxserve.batching.runner import Runner
from jaxserve.config import Constraint, SamplingParams
from jaxserve.loading import checkpoint
from support import server_harness as h
from support.openai_http import call
from support.openai_http import openai_client as client
from support.tiny import count_compiles

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
EMOJI = "\U0001F600"  # Four UTF-8 bytes: SmolLM2 spells it as byte-level pieces.


@pytest.fixture(scope="module")
def srv_options(tmp_path_factory):
  return dict(keys=True, weights_roots=(str(tmp_path_factory.mktemp("weights")),))


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
  return h.warm_engine(str(tiny_checkpoint))[1]


def test_completions_default_to_16_tokens_and_chat_to_the_rest_of_the_window(srv):
  """Defect: /v1/completions without max_tokens ran to the end of the window (OpenAI: 16)."""
  out = client(srv).completions.create(model="tiny", prompt="Once", extra_body={"ignore_eos": True})
  assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (16, "length")
  chat = client(srv).chat.completions.create(model="tiny", messages=CHAT,
                                             extra_body={"ignore_eos": True})
  assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 128  # The whole window.


def test_a_small_token_limit_cuts_a_request_without_max_tokens_instead_of_refusing_it(srv):
  """Defect: a 60 tokens/minute key got 429 for any chat without max_tokens (its admission
  reserved the whole 128-token window), with a message naming a max_tokens never sent."""
  out = client(srv, "carol").chat.completions.create(model="tiny", messages=CHAT,
                                                     extra_body={"ignore_eos": True})
  assert out.usage.prompt_tokens + out.usage.completion_tokens == 60
  assert out.choices[0].finish_reason == "length"
  with pytest.raises(openai.RateLimitError) as e:  # The minute's 60 tokens are spent.
    client(srv, "carol").chat.completions.create(model="tiny", messages=CHAT)
  assert "max_tokens" not in str(e.value) and "tokens per minute" in str(e.value)


def test_openai_fields_that_do_not_apply_are_taken_and_developer_acts_as_system(srv):
  c = client(srv)
  base = dict(model="tiny", max_tokens=6, temperature=0)
  plain = c.chat.completions.create(messages=CHAT, **base).choices[0].message.content
  extras = dict(store=False, metadata={"team": "a"}, service_tier="auto",
                parallel_tool_calls=False, user="u-1", response_format={"type": "text"})
  assert c.chat.completions.create(messages=CHAT, **base,
                                   **extras).choices[0].message.content == plain
  developer = [{"role": "developer", "content": CHAT[0]["content"]}, CHAT[1]]
  assert c.chat.completions.create(messages=developer, **base).choices[0].message.content == plain
  assert c.completions.create(prompt="Hi", user="u-1", **base).choices[0].finish_reason
  status, body = call(srv, "/v1/chat/completions", {"messages": CHAT, "temprature": 1})
  assert status == 400 and "does not take 'temprature'" in body["error"]["message"]


def test_logit_bias_and_allowed_token_ids_steer_the_tokens(srv, tokenizer):
  token = tokenizer.encode(" banana", add_bos=False)[-1]
  out = client(srv).completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0,
                                       logit_bias={str(token): 100},
                                       extra_body={"ignore_eos": True})
  assert tokenizer.encode(out.choices[0].text, add_bos=False) == [token] * 5
  allowed = [token, token + 1]
  status, body = call(srv, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 8, "seed": -7,
                                               "allowed_token_ids": allowed, "ignore_eos": True,
                                               "logprobs": 0})
  assert status == 200, body
  assert set(tokenizer.encode(body["choices"][0]["text"], add_bos=False)) <= set(allowed)


def test_no_bias_or_allowed_ids_or_constraint_compiles_anything(tiny_checkpoint):
  # A twin of the served engine: its compiled steps, its own KV cache (server_harness).
  engine, tokenizer = h.reference_engine(str(tiny_checkpoint))
  runner = Runner(engine, tokenizer)
  prompts = [[5, 6, 7], list(range(40, 75))]
  settings = [SamplingParams(max_tokens=4, logit_bias={9: 5.0, 100: -100}),
              SamplingParams(max_tokens=4, temperature=0, allowed_token_ids=[1, 2, 3]),
              SamplingParams(max_tokens=4, top_k=-1, seed=-3, logit_bias={"11": 50}),
              # Constrained rows, prefill and decode, beside free ones in the same steps.
              SamplingParams(max_tokens=6, constraint=Constraint.regex("[a-z]{3,9}")),
              SamplingParams(max_tokens=6, temperature=0, constraint=Constraint.json_object())]
  with count_compiles() as counts:
    runner.generate([(p, s) for p in prompts for s in settings])
  assert counts == {"trace": 0, "compile": 0}


def test_chat_logprob_bytes_are_each_token_s_own_bytes_even_inside_a_character(srv, tokenizer):
  """Defect: every piece of a multi-byte character reported the bytes of U+FFFD."""
  pieces = tokenizer.encode(EMOJI, add_bos=False)
  assert len(pieces) > 1  # The test needs a character split over tokens.
  status, body = call(srv, "/v1/chat/completions", {
      "messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": 1,
      "allowed_token_ids": [pieces[0]]})
  assert status == 200, body
  entry = body["choices"][0]["logprobs"]["content"][0]
  assert bytes(entry["bytes"]) == EMOJI.encode()[:len(bytes(entry["bytes"]))] != b""
  assert bytes(entry["bytes"]) != "\ufffd".encode()


def test_completion_logprobs_have_text_offsets_whole_and_streamed(srv):
  body = {"prompt": "The cat", "max_tokens": 6, "temperature": 0, "logprobs": 2,
          "ignore_eos": True}
  status, whole = call(srv, "/v1/completions", body)
  lp = whole["choices"][0]["logprobs"]
  lengths = [len(t) for t in lp["tokens"]]
  assert lp["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
  stream = client(srv).completions.create(model="tiny", stream=True, **{
      k: v for k, v in body.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True})
  streamed = [o for e in stream if e.choices[0].logprobs for o in e.choices[0].logprobs.text_offset]
  assert streamed == lp["text_offset"]


def test_health_models_version_and_tokenizer_routes(srv, tokenizer):
  assert call(srv, "/health") == (200, "")
  assert call(srv, "/v1/models/tiny")[1]["id"] == "tiny"
  status, body = call(srv, "/v1/models/gpt-4o")
  assert status == 404 and body["error"]["code"] == "model_not_found"
  assert isinstance(call(srv, "/version")[1]["version"], str)
  status, body = call(srv, "/tokenize", {"prompt": "Hello there", "return_token_strs": True})
  assert body["tokens"] == tokenizer.encode("Hello there") and body["count"] == len(body["tokens"])
  assert body["max_model_len"] == 128 and len(body["token_strs"]) == body["count"]
  status, chat = call(srv, "/tokenize", {"model": "tiny", "messages": CHAT})
  assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_bos=False)
  assert call(srv, "/detokenize", {"tokens": body["tokens"]}) == (200, {"prompt": "Hello there"})
  status, info = call(srv, "/tokenizer_info")
  assert status == 200 and info["eos_token_id"] == tokenizer.eos_id
  assert info["chat_template"] == tokenizer.chat_template


def test_health_is_503_once_draining(tiny_checkpoint):
  st = h.start_tiny(str(tiny_checkpoint))
  try:
    assert call(st, "/health")[0] == 200
    st.call(st.server.drain())
    status, body = call(st, "/health")
    assert status == 503 and "shutting down" in body["error"]["message"]
  finally:
    st.close()


# vLLM's admin routes for a training loop (http_admin.py): pause / resume, sleep / wake_up.

LOAD = [f"Story {i}: once upon a time" for i in range(5)] * 2  # 10 streams for 4 slots.
# Logprobs too: the tiny random model repeats a token, whose logprobs still tell contexts apart.
LONG = dict(model="tiny", max_tokens=100, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True})


class Load:
  """Streams each prompt at once, each on its own thread, with the official client; counts each
  one's chunks as they come."""

  def __init__(self, srv, prompts):
    self.chunks = [0] * len(prompts)
    self._pool = concurrent.futures.ThreadPoolExecutor(len(prompts))
    self.futures = [self._pool.submit(self._one, srv, i, p) for i, p in enumerate(prompts)]

  def _one(self, srv, i, prompt) -> tuple[str, int, list[float]]:
    text, usage, logprobs = "", None, []
    for event in client(srv).completions.create(prompt=prompt, stream=True,
                                                stream_options={"include_usage": True}, **LONG):
      if event.choices:
        text += event.choices[0].text
        logprobs += event.choices[0].logprobs.token_logprobs
        self.chunks[i] += 1
      usage = event.usage or usage
    return text, usage.completion_tokens, logprobs

  def wait_started(self, n: int) -> None:
    deadline = time.monotonic() + 60
    while sum(c > 0 for c in self.chunks) < n:
      assert time.monotonic() < deadline, self.chunks
      time.sleep(0.002)

  def results(self) -> list[tuple[str, int, list[float]]]:
    out = [f.result(120) for f in self.futures]
    self._pool.shutdown()
    return out


def engine_state(srv) -> tuple[list[int], int]:
  """(each running request's tokens, how many wait), read on the engine thread between steps:
  the clients' threads may lag behind what the server did."""
  scheduler, runner = srv.scheduler, srv.server.service.runner
  return srv.call(runner.on_engine(lambda: ([len(r.all_token_ids) for r in scheduler.running],
                                            len(scheduler.waiting))))


def frozen(srv, seconds: float = 0.4) -> bool:
  """No running request got a token for `seconds`."""
  engine_state(srv)  # Once a second read returns, the step in flight at the pause is back.
  before = engine_state(srv)[0]
  time.sleep(seconds)
  return engine_state(srv)[0] == before


def admin(srv, path: str, method: str = "POST", key: str | None = "ops", **query):
  return call(srv, path + ("?" + urllib.parse.urlencode(query) if query else ""), method=method,
              key=key)


@pytest.fixture(scope="module")
def unpaused(srv):
  """What LOAD and the late prompts give with no pause: (text, tokens, logprobs within 1e-3)."""
  prompts = LOAD[:5] + ["Late one", "Late two"]
  return {p: (text, tokens, pytest.approx(logprobs, abs=1e-3))
          for p, (text, tokens, logprobs) in zip(prompts, Load(srv, prompts).results())}


def test_admin_routes_are_an_admin_keys_and_take_vllms_parameters(srv):
  for method, path, _ in http_admin.ROUTES:
    assert admin(srv, path, method, key=None)[0] == 401, path
    status, body = admin(srv, path, method, key="alice")
    assert status == 403 and "admin key" in body["error"]["message"], path
  status, body = admin(srv, "/pause", mode="freeze")
  assert status == 400 and "'abort', 'wait', 'keep'" in body["error"]["message"]
  assert admin(srv, "/sleep", level="3")[0] == 400
  assert admin(srv, "/wake_up", tags="everything")[0] == 400
  assert admin(srv, "/is_paused", "GET") == admin(srv, "/is_sleeping", "GET")[:1] + (
      {"is_paused": False},)


@pytest.mark.parametrize("mode", ["keep", "wait"])
def test_pause_and_resume_under_a_streaming_load_lose_no_request(srv, unpaused, mode):
  """keep: every stream stops where it is, and goes on after /resume; wait: /pause answers once
  the running ones have finished, and no other starts. Streams sent while paused wait. Each one
  ends with all its 100 tokens, the text of a run without the pause."""
  load = Load(srv, LOAD)
  load.wait_started(4)  # Every slot runs; the other 6 wait.
  assert admin(srv, "/pause", mode=mode) == (200, {"status": "paused"})
  assert admin(srv, "/is_paused", "GET") == (200, {"is_paused": True})
  running, waiting = engine_state(srv)
  assert waiting and (bool(running) if mode == "keep" else not running)  # wait: all finished.
  late = Load(srv, ["Late one", "Late two"])
  assert frozen(srv) and not any(late.chunks)
  assert admin(srv, "/resume") == (200, {"status": "resumed"})
  assert load.results() == [unpaused[p] for p in LOAD]
  assert late.results() == [unpaused["Late one"], unpaused["Late two"]]
  assert all(tokens == 100 for _, tokens, _ in unpaused.values())
  assert admin(srv, "/is_paused", "GET") == (200, {"is_paused": False})


def test_sleep_and_wake_up_give_the_same_greedy_text_and_keep_what_arrived(srv, unpaused):
  """Level 1 (the served engine's weights are shared with the other tests' reference twin, so
  not 2; test_training_loop.py sleeps both levels). A stream sent while asleep waits, and ends
  after /wake_up as without the sleep; /sleep while asleep, or after `keep` froze a running
  stream, is 409 and changes nothing."""
  status, body = admin(srv, "/sleep", level="1")
  assert status == 200 and body["level"] == 1 and body["freed_bytes"] > 0
  assert admin(srv, "/is_sleeping", "GET") == (200, {"is_sleeping": True})
  assert admin(srv, "/is_paused", "GET") == (200, {"is_paused": True})
  late = Load(srv, ["Late one"])
  status, body = admin(srv, "/sleep", level="2")
  assert status == 409 and "asleep already" in body["error"]["message"]
  time.sleep(0.4)
  assert not any(late.chunks) and engine_state(srv)[1] == 1
  assert admin(srv, "/wake_up") == (200, "")
  assert late.results() == [unpaused["Late one"]]
  assert admin(srv, "/is_sleeping", "GET") == (200, {"is_sleeping": False})
  assert admin(srv, "/is_paused", "GET") == (200, {"is_paused": False})
  load = Load(srv, LOAD[:1])
  load.wait_started(1)
  assert admin(srv, "/pause", mode="keep")[0] == 200
  status, body = admin(srv, "/sleep", mode="keep")
  assert status == 409 and "1 requests are running" in body["error"]["message"]
  assert admin(srv, "/is_sleeping", "GET") == (200, {"is_sleeping": False})
  assert admin(srv, "/resume")[0] == 200
  assert load.results() == [unpaused[LOAD[0]]]


def test_update_weights_from_disk_takes_a_checkpoint_and_refuses_what_does_not_fit(
    srv, srv_options, tiny_checkpoint):
  """SGLang's /update_weights_from_disk: the served logprobs change with the folder's weights
  and come back exactly with the original ones; a folder outside --weights-root (a symlink to
  one included), a body without a path and a misshaped weight are refused by name."""
  root = pathlib.Path(srv_options["weights_roots"][0])
  cfg, params, tokenizer = checkpoint.restore(tiny_checkpoint)
  checkpoint.save(root / "original", cfg, params, tokenizer)
  checkpoint.save(root / "changed", cfg, {**params, "final_norm": params["final_norm"] * 0.1},
                  tokenizer)
  body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 4, "temperature": 0,
          "logprobs": 2, "ignore_eos": True}
  logprobs = lambda: call(srv, "/v1/completions", body)[1]["choices"][0]["logprobs"]
  before = logprobs()
  update = lambda path, **kw: call(srv, "/update_weights_from_disk", {"model_path": str(path),
                                                                       **kw}, key="ops")
  try:
    with count_compiles() as counts:
      assert update(root / "changed") == (200, {"success": True, "message":
                                                f"weights updated from {root / 'changed'}"})
      changed = logprobs()
      assert update(root / "original", in_flight="abort")[0] == 200
      assert logprobs() == before  # The same weights: the same numbers, no page of "changed".
    assert counts == {"trace": 0, "compile": 0}
  finally:
    update(root / "original")
  assert changed["token_logprobs"] != pytest.approx(before["token_logprobs"], abs=1e-3)
  (root / "link").symlink_to(tiny_checkpoint)
  for path in (tiny_checkpoint, root / "link", root / "missing"):
    status, out = update(path)
    assert status == 404 and "under this server's weight roots" in out["error"]["message"]
  assert call(srv, "/update_weights_from_disk", {}, key="ops")[0] == 400
  assert update(root / "original", in_flight="later")[0] == 400
  cfg2, params2, _ = checkpoint.restore(tiny_checkpoint)
  params2["layers"] = {**params2["layers"], "wq": params2["layers"]["wq"][:, :-1]}
  checkpoint.save(root / "misshaped", cfg2, params2, tokenizer)
  status, out = update(root / "misshaped")
  assert status == 400 and "wq" in out["error"]["message"], out
  assert logprobs() == before  # Refused: nothing changed.

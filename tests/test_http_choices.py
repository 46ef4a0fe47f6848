"""/v1/completions as lm-eval and batch clients use it: echo with prompt logprobs (max_tokens 0
too), vLLM's prompt_logprobs, n > 1, best_of, several prompts, streamed choices by index. Values
are checked against the offline Runner on a twin of the served engine (its own KV cache)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.batching.runner import Runner
from jaxserve.config import SamplingParams
from support import openai_http
from support import server_harness as h

TEXT = "Roses are red, violets are"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
  """The references' engine: never the served one, whose KV pages its prefix cache points to."""
  return h.reference_engine(str(tiny_checkpoint))


def offline(engine, prompt_ids, **sampling):
  (out,) = h.offline(*engine, [(prompt_ids, SamplingParams(**sampling))])
  return out


def post(srv, body, path="/v1/completions"):
  # The server here has no API keys.
  return openai_http.post(srv, body, path, key=None, timeout=120)


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_echo_gives_the_prompt_logprobs_then_the_generated_ones(srv, engine, max_tokens):
  _, tokenizer = engine
  ids = tokenizer.encode(TEXT)
  ref = offline(engine, ids, temperature=0, max_tokens=max(max_tokens, 1), logprobs=2,
                prompt_logprobs=2)
  out = post(srv, {"prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": max_tokens,
                   "temperature": 0})
  (choice,) = out["choices"]
  lp = choice["logprobs"]
  shown = list(ref.token_ids) if max_tokens else []
  assert len(lp["tokens"]) == len(ids) + len(shown)
  assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
  want = [p.logprob for p in ref.prompt_logprobs[1:]]
  np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], want, rtol=1e-6, atol=1e-5)
  for pos in range(1, len(ids)):  # The top 2, and the prompt's own token beside them.
    top = lp["top_logprobs"][pos]
    assert lp["tokens"][pos] in top and 2 <= len(top) <= 3
    assert max(top.values()) == pytest.approx(ref.prompt_logprobs[pos].top_logprobs[0], abs=1e-5)
  assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1])
  assert choice["text"] == TEXT + ref.text * bool(max_tokens)
  assert out["usage"]["prompt_tokens"] == len(ids)
  assert out["usage"]["completion_tokens"] == len(shown)
  assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_echo_of_token_ids_and_vllm_prompt_logprobs(srv, engine):
  _, tokenizer = engine
  ids = tokenizer.encode(TEXT)
  ref = offline(engine, ids, temperature=0, max_tokens=1, prompt_logprobs=3)
  out = post(srv, {"prompt": ids, "echo": True, "max_tokens": 1, "temperature": 0,
                   "prompt_logprobs": 3})
  (choice,) = out["choices"]
  assert choice["logprobs"] is None  # Echo without logprobs: the text alone.
  assert choice["text"] == tokenizer.detokenize(ids, skip_special_tokens=False) + ref.text
  entries = choice["prompt_logprobs"]
  assert len(entries) == len(ids) and entries[0] is None
  for pos in range(1, len(ids)):
    mine, want = entries[pos][str(ids[pos])], ref.prompt_logprobs[pos]
    assert mine["logprob"] == pytest.approx(want.logprob, abs=1e-5) and mine["rank"] == want.rank
    ranks = sorted(e["rank"] for k, e in entries[pos].items() if k != str(ids[pos]))
    assert ranks == [1, 2, 3] and len(entries[pos]) in (3, 4)


def test_n_choices_with_seeds_share_the_prompt_pages(srv, engine):
  _, tokenizer = engine
  ids = tokenizer.encode(TEXT * 3)  # Over two pages of 16.
  cached_before = srv.scheduler.num_cached_tokens
  # The tiny random model is very sure of itself: a high temperature makes the runs differ.
  out = post(srv, {"prompt": TEXT * 3, "n": 3, "max_tokens": 6, "temperature": 30.0, "seed": 5})
  assert [c["index"] for c in out["choices"]] == [0, 1, 2]
  for j, choice in enumerate(out["choices"]):
    assert choice["text"] == offline(engine, ids, temperature=30.0, max_tokens=6, seed=5 + j).text
  assert len({c["text"] for c in out["choices"]}) > 1
  assert out["usage"]["prompt_tokens"] == len(ids)  # Counted once.
  assert out["usage"]["completion_tokens"] == 18
  # Runs 1 and 2 reused run 0's full pages.
  assert srv.scheduler.num_cached_tokens - cached_before >= 2 * 16 * (len(ids) // 16)



def count_calls(monkeypatch, obj, *names) -> dict[str, int]:
  """Wraps each method of `obj` in a spy that counts its calls and runs the real one."""
  calls = dict.fromkeys(names, 0)
  for name in names:
    real = getattr(obj, name)

    def spy(*args, _real=real, _name=name, **kwargs):
      calls[_name] += 1
      return _real(*args, **kwargs)

    monkeypatch.setattr(obj, name, spy)
  return calls


def test_n_runs_share_one_tokenization_of_their_prompt(srv, engine, monkeypatch):
  _, tokenizer = engine
  calls = count_calls(monkeypatch, srv.server.service.tokenizer, "encode", "apply_chat_template")
  messages = [{"role": "user", "content": TEXT}]
  sampling = {"max_tokens": 5, "temperature": 30.0, "seed": 5}
  out = post(srv, {"messages": messages, "n": 4, **sampling}, "/v1/chat/completions")
  assert calls == {"encode": 1, "apply_chat_template": 1}
  ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_bos=False)
  assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
  for j, choice in enumerate(out["choices"]):
    want = offline(engine, ids, **{**sampling, "seed": 5 + j}).text
    assert choice["message"]["content"] == want
  assert out["usage"]["completion_tokens"] == 20
  calls.update(encode=0)
  out = post(srv, {"prompt": ["The sky is", "Once upon a time"], "n": 3, "max_tokens": 2})
  assert calls["encode"] == 2 and len(out["choices"]) == 6  # Once per prompt.

def test_several_prompts_with_n_are_choices_in_order(srv, engine):
  _, tokenizer = engine
  prompts = ["The sky is", [int(i) for i in tokenizer.encode("Once upon a time")]]
  out = post(srv, {"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 0})
  texts = [c["text"] for c in out["choices"]]
  assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
  want = [offline(engine, tokenizer.encode(prompts[0]), temperature=0, max_tokens=4).text,
          offline(engine, prompts[1], temperature=0, max_tokens=4).text]
  assert texts == [want[0], want[0], want[1], want[1]]
  assert out["usage"]["prompt_tokens"] == len(tokenizer.encode(prompts[0])) + len(prompts[1])
  assert out["usage"]["completion_tokens"] == 16


def test_best_of_returns_the_likeliest_runs(srv, engine):
  _, tokenizer = engine
  ids = tokenizer.encode(TEXT)
  runs = [offline(engine, ids, temperature=30.0, max_tokens=5, seed=11 + j) for j in range(4)]
  assert len({r.text for r in runs}) == 4
  out = post(srv, {"prompt": TEXT, "n": 2, "best_of": 4, "max_tokens": 5, "temperature": 30.0,
                   "seed": 11})
  # Runner outputs carry no logprobs per token here: score them from a logprobs run.
  (e, _) = engine
  score = lambda r: sum(lp.logprob for lp in _logprobs_of(e, tokenizer, ids, r))
  best = sorted(runs, key=score, reverse=True)[:2]
  assert [c["text"] for c in out["choices"]] == [r.text for r in best]
  assert all(c["logprobs"] is None for c in out["choices"])  # Not asked for.
  assert out["usage"]["completion_tokens"] == 20  # Every run was generated.


def _logprobs_of(engine, tokenizer, ids, run):
  """The chosen-token logprobs of `run`'s tokens: its prompt plus output, scored by the engine."""
  whole = list(ids) + list(run.token_ids)
  (scored,) = Runner(engine, tokenizer).generate(
      [(whole, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))])
  return scored.prompt_logprobs[len(ids):]


def test_reference_runs_leave_the_served_engine_s_kv_alone(srv, engine, tiny_checkpoint):
  """The references ran on the served engine, writing pages the server's prefix cache pointed
  to; a server answer read after them could then differ from its reference for that alone."""
  served = h.warm_engine(str(tiny_checkpoint))[0]
  assert h.wait_until(lambda: h.idle(srv.scheduler))
  before = [np.asarray(x) for x in jax.tree.leaves(served.cache)]
  offline(engine, list(range(5, 60)), temperature=0, max_tokens=3)
  after = [np.asarray(x) for x in jax.tree.leaves(served.cache)]
  assert all(np.array_equal(b, a) for b, a in zip(before, after))


def test_streamed_choices_carry_their_index(srv):
  body = {"prompt": ["The sky is", "Grass is"], "n": 2, "max_tokens": 5, "temperature": 30.0,
          "seed": 3, "stream": True, "stream_options": {"include_usage": True}}
  events = post(srv, body)
  whole = post(srv, {**body, "stream": False})
  texts = {}
  for e in events[:-1]:
    (choice,) = e["choices"]
    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
  assert texts == {c["index"]: c["text"] for c in whole["choices"]}
  assert events[-1]["usage"]["completion_tokens"] == 20
  assert events[-1]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_streamed_echo_puts_the_prompt_first(srv):
  events = post(srv, {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 3,
                      "temperature": 0, "stream": True})
  first = events[0]["choices"][0]
  assert first["text"].startswith(TEXT) and first["logprobs"]["token_logprobs"][0] is None
  offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
  text = "".join(e["choices"][0]["text"] for e in events)
  assert offsets == sorted(offsets) and offsets[0] == 0 and len(offsets) == len(
      [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]])
  assert text.startswith(TEXT)


def test_grpc_prompt_logprobs_on_the_first_response(srv, engine):
  import grpc

  from jaxserve.api.proto import jaxserve_pb2 as pb

  _, tokenizer = engine
  ids = tokenizer.encode(TEXT)
  ref = offline(engine, ids, temperature=0, max_tokens=2, prompt_logprobs=2)
  with grpc.insecure_channel(srv.grpc_address) as channel:
    msgs = h.generate(h.stub(channel), pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), temperature=0, max_tokens=2, prompt_logprobs=2), None)
  first = msgs[0].prompt_logprobs
  assert [e.token_id for e in first] == ids and not any(m.prompt_logprobs for m in msgs[1:])
  assert not first[0].HasField("logprob") and first[0].rank == 0
  for entry, want in zip(first[1:], ref.prompt_logprobs[1:]):
    assert entry.logprob == pytest.approx(want.logprob, abs=1e-5) and entry.rank == want.rank
    assert [t.token_id for t in entry.top] == list(want.top_ids)
  assert [t for m in msgs for t in m.token_ids] == list(ref.token_ids)

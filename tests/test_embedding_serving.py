"""Pooling models served (issue 51): `serve --task embed`'s /v1/embeddings through the official
openai client (float and base64), vLLM's /v1/rerank and /v1/score request shapes, the gateway's
keys and token limits, and every bad input a 400 naming the problem; the gRPC Embed and Score
methods, which answer as the HTTP routes do. One server of a tiny random Qwen3 embedding model (the
default model's tokenizer); references from transformers."""

import base64
import re

import grpc
import numpy as np
import pytest

from jaxserve import llm
from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.batching.pooled import MAX_INPUTS
from jaxserve.config import AttentionBackend, EngineConfig
from support import hf_tiny
from support import server_harness as h
from support.openai_http import call, openai_client, post

torch = pytest.importorskip("torch")

ENGINE = EngineConfig(num_slots=4, page_size=8, num_pages=80, max_model_len=128,
                      prefill_buckets=(16, 32), compilation_cache_dir=None,
                      attention_backend=AttentionBackend.REFERENCE)
TEXTS = ["Hi", "Paris is the capital of France.",
         "The quick brown fox jumps over the lazy dog. " * 3]


@pytest.fixture(scope="module")
def served(default_model, tmp_path_factory):
  """(server, transformers model, tokenizer): `jaxserve serve --task embed`'s loader, with keys."""
  root = tmp_path_factory.mktemp("embed_serving")
  hf = hf_tiny.save_qwen3(default_model[1], root / "model")
  loaded = llm.load_engine(str(root / "model"), ENGINE, "tiny-embed", task="embed")
  cfg = h.server.ServerConfig(grpc_port=0, http_port=0, keys_file=h.write_keys(root / "k.json"))
  st = h.ServerThread(h.server.Server(lambda: loaded, cfg)).start()
  yield st, hf, loaded.tokenizer
  st.close()


def reference(hf, ids) -> np.ndarray:
  """sentence-transformers' embedding of a last-token pooling model: the final-normed last
  hidden state at the last token, L2-normalized."""
  with torch.no_grad():
    x = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
  return x / np.linalg.norm(x)


def test_openai_client_embeddings_float_and_base64(served):
  st, hf, tok = served
  client = openai_client(st)
  want = [reference(hf, tok.encode(t)) for t in TEXTS]
  for fmt in ("float", "base64"):
    out = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format=fmt)
    got = [np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64"
           else np.asarray(d.embedding) for d in out.data]
    assert [d.index for d in out.data] == [0, 1, 2]
    for g, w in zip(got, want):
      assert np.abs(g - w).max() < 1e-5
    assert out.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)
  # Token ids in; the client's default (base64 on the wire, decoded by the client).
  ids = tok.encode(TEXTS[1])
  out = client.embeddings.create(model="tiny-embed", input=[ids])
  assert np.abs(np.asarray(out.data[0].embedding) - want[1]).max() < 1e-5


def test_truncate_prompt_tokens_keeps_the_end(served):
  st, hf, tok = served
  ids = tok.encode(TEXTS[2])
  out = post(st, {"input": TEXTS[2], "truncate_prompt_tokens": 7}, "/v1/embeddings")
  assert np.abs(np.asarray(out["data"][0]["embedding"]) - reference(hf, ids[-7:])).max() < 1e-5
  assert out["usage"]["prompt_tokens"] == 7


def test_rerank_and_score_in_vllms_shapes(served):
  st, hf, tok = served
  query, docs = "Where is Paris?", ["Paris is in France.", "Bananas are yellow.", "A tower."]
  q = reference(hf, tok.encode(query))
  cosines = [float(q @ reference(hf, tok.encode(d))) for d in docs]
  out = post(st, {"model": "tiny-embed", "query": query, "documents": docs, "top_n": 2},
             "/v1/rerank")
  best = sorted(range(3), key=lambda i: -cosines[i])[:2]
  assert [r["index"] for r in out["results"]] == best
  for r in out["results"]:
    assert r["relevance_score"] == pytest.approx(cosines[r["index"]], abs=1e-5)
    assert r["document"] == {"text": docs[r["index"]]}
  out = post(st, {"model": "tiny-embed", "text_1": query, "text_2": docs}, "/v1/score")
  assert [d["score"] for d in out["data"]] == pytest.approx(cosines, abs=1e-5)
  assert [d["object"] for d in out["data"]] == ["score"] * 3


@pytest.mark.parametrize("body,message", [
    ({"input": []}, "input is empty"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, f"at most {MAX_INPUTS} inputs"),
    ({"input": [[5] * 200]}, "cannot fit in the context window"),
    ({"input": "word " * 200}, "context window"),
    ({"input": "a", "dimensions": 16}, "dimensions 16: .*not trained to be cut"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": [1.5]}, r"input\[0\] must be a string"),
    ({"input": "a", "temperature": 1}, "does not take 'temperature'"),
])
def test_bad_embedding_requests_are_400s_naming_the_problem(served, body, message):
  status, out = call(served[0], "/v1/embeddings", body, method="POST")
  assert status == 400, out
  assert re.search(message, out["error"]["message"]), out


def test_bad_score_requests_are_400s(served):
  st = served[0]
  status, out = call(st, "/v1/rerank", {"query": "q", "documents": []}, method="POST")
  assert status == 400 and "documents is empty" in out["error"]["message"]
  status, out = call(st, "/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, method="POST")
  assert status == 400 and "one text against many" in out["error"]["message"]


def test_the_gateways_keys_and_token_limits_apply(served):
  st = served[0]
  assert call(st, "/v1/embeddings", {"input": "a"}, method="POST", key=None)[0] == 401
  status, out = call(st, "/v1/embeddings", {"input": "word " * 70}, method="POST", key="carol")
  assert status == 429, out  # carol: 60 tokens a minute.


def test_a_generation_server_refuses_embeddings_by_name(srv):
  status, out = call(srv, "/v1/embeddings", {"input": "a"}, method="POST")
  assert status == 400
  assert "--task embed" in out["error"]["message"]


def grpc_call(st, method: str, request, key: str | None = "alice"):
  """(the response, None) or (None, the RpcError) of one unary call to `method` as `key` (a
  name in KEYS, or any other string sent as it is; None sends no key)."""
  metadata = (("authorization", f"Bearer {h.KEYS.get(key, key)}"),) if key else None
  with grpc.insecure_channel(st.grpc_address) as channel:
    try:
      return getattr(h.stub(channel), method)(request, metadata=metadata, timeout=60), None
    except grpc.RpcError as e:
      return None, e


def embed_request(*inputs, **fields) -> pb.EmbedRequest:
  items = [pb.EmbedInput(text=i) if isinstance(i, str) else
           pb.EmbedInput(token_ids=pb.TokenIds(ids=i)) for i in inputs]
  return pb.EmbedRequest(inputs=items, **fields)


def test_grpc_embed_answers_as_v1_embeddings(served):
  st, hf, tok = served
  ids = tok.encode(TEXTS[1])
  http = post(st, {"input": TEXTS}, "/v1/embeddings")
  out, err = grpc_call(st, "Embed", embed_request(*TEXTS, ids, model="tiny-embed"))
  assert err is None, err
  got = [np.asarray(e.values) for e in out.embeddings]
  assert len(got) == 4 and out.model == "tiny-embed"
  for g, d in zip(got, http["data"]):
    assert np.abs(g - np.asarray(d["embedding"])).max() < 1e-6
  for g, text in zip(got, [*TEXTS, TEXTS[1]]):
    assert np.abs(g - reference(hf, tok.encode(text))).max() < 1e-5
  assert out.usage.prompt_tokens == http["usage"]["prompt_tokens"] + len(ids)
  # normalize=false: the pooled row as the model left it, which normalizes to the embedding.
  raw, _ = grpc_call(st, "Embed", embed_request(TEXTS[1], normalize=False))
  raw = np.asarray(raw.embeddings[0].values, np.float64)
  assert abs(np.linalg.norm(raw) - 1) > 1e-3
  assert np.abs(raw / np.linalg.norm(raw) - got[1]).max() < 1e-5
  # truncate_prompt_tokens keeps the last tokens, as over HTTP.
  cut, _ = grpc_call(st, "Embed", embed_request(TEXTS[2], truncate_prompt_tokens=7))
  want = reference(hf, tok.encode(TEXTS[2])[-7:])
  assert np.abs(np.asarray(cut.embeddings[0].values) - want).max() < 1e-5
  assert cut.usage.prompt_tokens == 7


def test_grpc_score_answers_as_v1_score_and_rerank(served):
  st, hf, tok = served
  query, docs = "Where is Paris?", ["Paris is in France.", "Bananas are yellow.", "A tower."]
  q = reference(hf, tok.encode(query))
  cosines = [float(q @ reference(hf, tok.encode(d))) for d in docs]
  out, err = grpc_call(st, "Score", pb.ScoreRequest(query=query, documents=docs))
  assert err is None, err
  assert list(out.scores) == pytest.approx(cosines, abs=1e-5)
  score = post(st, {"text_1": query, "text_2": docs}, "/v1/score")
  assert list(out.scores) == pytest.approx([d["score"] for d in score["data"]], abs=1e-6)
  rerank = post(st, {"query": query, "documents": docs}, "/v1/rerank")
  by_index = {r["index"]: r["relevance_score"] for r in rerank["results"]}
  assert list(out.scores) == pytest.approx([by_index[i] for i in range(3)], abs=1e-6)
  assert out.usage.prompt_tokens == score["usage"]["prompt_tokens"]


INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("method,request_,code,message", [
    ("Embed", pb.EmbedRequest(), INVALID, "input is empty"),
    ("Embed", pb.EmbedRequest(inputs=[pb.EmbedInput()]), INVALID, r"inputs\[0\] must be a text"),
    ("Embed", embed_request("a", dimensions=16), INVALID, "dimensions 16: .*not trained to be cut"),
    ("Embed", embed_request("a", truncate_prompt_tokens=0), INVALID, "truncate_prompt_tokens"),
    ("Embed", embed_request([5] * 200), INVALID, "cannot fit in the context window"),
    ("Embed", embed_request("a", model="other"), grpc.StatusCode.NOT_FOUND, "other"),
    ("Score", pb.ScoreRequest(query="q"), INVALID, "documents is empty"),
    ("Score", pb.ScoreRequest(query="word " * 200, documents=["d"]), INVALID, "context window"),
])
def test_bad_grpc_pooling_requests_name_the_problem(served, method, request_, code, message):
  _, err = grpc_call(served[0], method, request_)
  assert err is not None and err.code() == code, err
  assert re.search(message, err.details()), err.details()


def test_grpc_pooling_bytes_that_are_no_message_are_invalid_argument(served):
  with grpc.insecure_channel(served[0].grpc_address) as channel:
    embed = channel.unary_unary("/jaxserve.v1.Jaxserve/Embed")  # Raw bytes in and out.
    with pytest.raises(grpc.RpcError) as e:
      embed(b"\x0a\x05\x0a\x03\xff\xfe\xfd", metadata=h.auth(), timeout=60)  # Bad UTF-8.
  assert e.value.code() == INVALID and "not a valid message" in e.value.details()


def test_grpc_pooling_takes_the_gateways_keys_and_limits(served):
  st = served[0]
  for key in (None, "sk-not-a-key"):
    _, err = grpc_call(st, "Embed", embed_request("a"), key=key)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    _, err = grpc_call(st, "Score", pb.ScoreRequest(query="q", documents=["d"]), key=key)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
  _, err = grpc_call(st, "Embed", embed_request("word " * 70), key="carol")  # 60 tokens a minute.
  assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "token" in err.details(), err
  assert grpc_call(st, "Embed", embed_request("a"), key="carol")[1] is None  # Refunded: room.
  for _ in range(2):  # bob: 2 requests a minute.
    assert grpc_call(st, "Score", pb.ScoreRequest(query="q", documents=["d"]), key="bob")[1] is None
  _, err = grpc_call(st, "Embed", embed_request("a"), key="bob")
  assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err


def test_a_generation_server_refuses_grpc_pooling_by_name(srv):
  for method, request_ in (("Embed", embed_request("a")),
                           ("Score", pb.ScoreRequest(query="q", documents=["d"]))):
    _, err = grpc_call(srv, method, request_, key=None)
    assert err is not None and err.code() == INVALID, err
    assert f"{method}: this server generates text" in err.details()
    assert "--task embed" in err.details()

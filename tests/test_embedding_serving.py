"""Pooling models served (issue 51): `serve --task embed`'s /v1/embeddings through the official
openai client (float and base64), vLLM's /v1/rerank and /v1/score request shapes, the gateway's
keys and token limits, and every bad input a 400 naming the problem. One server of a tiny random
Qwen3 embedding model (the default model's tokenizer); references from transformers."""

import base64
import re

import numpy as np
import pytest

from jaxserve import llm
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

"""Pooling models (issue 51), offline: `LLM(task="embed").embed` equals transformers' last hidden
state pooled and normalized as sentence-transformers does (last token; mean, read from a model's
modules.json), for a batch of mixed lengths cut into chunks; `LLM(task="rerank").score` equals
the softmax of transformers' "no"/"yes" logits; nothing compiles after warm-up. Tiny random Qwen3
models with the default model's tokenizer, built offline."""

import numpy as np
import pytest

from jaxserve.batching import pooled
from jaxserve.config import AttentionBackend, EngineConfig
from jaxserve.llm import LLM
from support import hf_tiny
from support.tiny import count_compiles

torch = pytest.importorskip("torch")

ENGINE = EngineConfig(num_slots=4, page_size=8, num_pages=80, max_model_len=128,
                      prefill_buckets=(16, 32), max_prefill_seqs=4, compilation_cache_dir=None,
                      attention_backend=AttentionBackend.REFERENCE)
# Mixed lengths: shorter than a chunk, several chunks (the budget is one 32-token bucket).
TEXTS = ["Hi", "The quick brown fox jumps over the lazy dog. " * 4,
         "Paris is the capital of France.",
         "One two three four five six seven eight nine ten eleven twelve thirteen fourteen."]
DOCS = ["Paris is in France.", "Bananas are yellow fruit rich in potassium.", "The Eiffel tower."]


@pytest.fixture(scope="module")
def last(default_model, tmp_path_factory):
  """(transformers model, LLM(task="embed")): last-token pooling, the decoder default."""
  path = tmp_path_factory.mktemp("qwen3_embed")
  hf = hf_tiny.save_qwen3(default_model[1], path, sentence_transformers=False)
  return hf, LLM(str(path), task="embed", engine_config=ENGINE)


@pytest.fixture(scope="module")
def mean(default_model, tmp_path_factory):
  path = tmp_path_factory.mktemp("qwen3_mean")
  hf = hf_tiny.save_qwen3(default_model[1], path, sentence_transformers=True)
  return hf, LLM(str(path), task="embed", engine_config=ENGINE)


def hidden(hf, ids) -> np.ndarray:
  """transformers' last_hidden_state [T, D] (the final norm applied), float64."""
  with torch.no_grad():
    return hf.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()


def unit(x):
  return x / np.linalg.norm(x)


def assert_close(ours, want):
  assert ours.shape == want.shape
  assert np.abs(ours - want).max() < 1e-5
  assert float(unit(ours) @ unit(want)) > 0.99999


def test_last_token_embeddings_match_transformers(last):
  hf, llm = last
  ids = [llm.encode(t) for t in TEXTS]
  assert max(len(i) for i in ids) > 32 and min(len(i) for i in ids) < 16
  for vec, i in zip(llm.embed(TEXTS), ids):
    assert_close(vec, unit(hidden(hf, i)[-1]))
  raw = llm.embed(TEXTS[1], normalize=False)[0]  # Token ids in, no normalization.
  assert_close(raw, hidden(hf, ids[1])[-1])
  assert llm.embed([ids[1]])[0] == pytest.approx(unit(raw), abs=1e-6)


def test_mean_pooling_read_from_sentence_transformers_files(mean):
  hf, llm = mean
  vecs = llm.embed(TEXTS)
  for vec, text in zip(vecs, TEXTS):
    assert_close(vec, unit(hidden(hf, llm.encode(text)).mean(0)))
  cut = llm.embed(TEXTS[:1], dimensions=16)[0]  # Matryoshka: cut, then normalized.
  assert_close(cut, unit(hidden(hf, llm.encode(TEXTS[0])).mean(0)[:16]))
  with pytest.raises(ValueError, match="dimensions 20: .* 16, 32, 64"):
    llm.embed(TEXTS[:1], dimensions=20)


def test_embedding_score_is_cosine_similarity(last):
  hf, llm = last
  q = hidden(hf, llm.encode("Where is Paris?"))[-1]
  want = [float(unit(q) @ unit(hidden(hf, llm.encode(d))[-1])) for d in DOCS]
  assert llm.score("Where is Paris?", DOCS) == pytest.approx(want, abs=1e-5)


def test_bad_input_is_refused_by_name(last):
  _, llm = last
  with pytest.raises(ValueError, match="input is empty"):
    llm.embed([])
  with pytest.raises(ValueError, match="dimensions 16: .*not trained to be cut"):
    llm.embed(["a"], dimensions=16)
  with pytest.raises(ValueError, match="context window"):
    llm.embed([[5] * 200])
  with pytest.raises(ValueError, match="LLM\\(task='rerank'\\)"):
    llm._pooler(pooled.Task.RERANK)


def test_reranker_scores_match_transformers_yes_no_softmax(default_model, tmp_path_factory):
  path = tmp_path_factory.mktemp("qwen3_rerank")
  hf = hf_tiny.save_qwen3(default_model[1], path, sentence_transformers=False)
  llm = LLM(str(path), task="rerank", engine_config=ENGINE)
  no, yes = (llm.tokenizer.encode(w, add_bos=False)[0] for w in ("no", "yes"))
  want = []
  for d in DOCS:
    ids = llm.encode(pooled.rerank_prompt("Where is Paris?", d))
    with torch.no_grad():
      logits = hf(torch.tensor([ids])).logits[0, -1].double()
    want.append(float(torch.softmax(logits[[no, yes]], 0)[1]))
  assert llm.score("Where is Paris?", DOCS) == pytest.approx(want, abs=1e-5)
  assert len(set(round(w, 4) for w in want)) == len(DOCS)  # The documents score apart.


def test_no_compiles_after_warmup_across_lengths(last):
  _, llm = last
  llm.embed(TEXTS)
  with count_compiles() as counts:
    for n in (1, 7, 16, 17, 33, 90):
      llm.embed([[11 + i for i in range(n)], [5] * (n + 3)])
  assert counts["compile"] == 0

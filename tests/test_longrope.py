"""Phi-3.5-mini's LongRoPE against transformers: a tiny random Phi-3 whose original context is 64
positions of 256 (Phi-3.5-mini: 4k of 128k), with short and long factors far apart. A sequence
of at most 64 tokens runs on the short factors, a longer one on the long ones, q and k scaled by
the attention factor either way; from safetensors and from GGUF."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from jaxserve.batching.runner import Runner
from jaxserve.config import (
  AttentionBackend,
  EngineConfig,
  LongRope,
  ModelConfig,
  SamplingParams,
  SchedulerConfig,
  readers,
)
from jaxserve.engine.engine import Engine
from jaxserve.loading import checkpoint, weights
from support import hf_tiny
from support.mock_engine import MockTokenizer
from support.tiny import count_compiles, dense_logits

pytest.importorskip("torch")
pytest.importorskip("transformers")

ORIGINAL = 64
SHORT = [1.0 + 0.1 * i for i in range(8)]  # head_dim 16: 8 frequencies.
LONG = [2.0 ** i for i in range(8)]
PHI35 = dict(hf_tiny.SMALL, max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
             pad_token_id=0,
             rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(transformers model, its directory, jaxserve model)."""
  hf = hf_tiny.build("Phi3Config", PHI35)
  path = tmp_path_factory.mktemp("phi35")
  hf.save_pretrained(path)
  return hf, path, checkpoint.build_model(*weights.load_hf_dir(path))


def test_config_reads_longrope_as_transformers_does(tiny):
  """The factor defaults to 256 / 64: attention factor sqrt(1 + ln 4 / ln 64)."""
  cfg = tiny[2].cfg
  assert cfg.rope_scaling == LongRope(tuple(SHORT), tuple(LONG), ORIGINAL,
                                      math.sqrt(1 + math.log(4) / math.log(ORIGINAL)))
  assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_logits_match_transformers_below_and_above_the_original_length(tiny):
  """64 tokens (the original length: short factors) and 128 (long factors at every position,
  as transformers picks one set for the whole forward): logits at every position."""
  hf, _, model = tiny
  ids = [int(i) for i in np.random.default_rng(0).integers(0, hf_tiny.VOCAB, 128)]
  short, long = (np.asarray(dense_logits(model, ids[:n], page_size=4)) for n in (64, 128))
  assert np.abs(short - hf_tiny.logits(hf, ids[:64])).max() < 1e-4
  assert np.abs(long - hf_tiny.logits(hf, ids)).max() < 1e-4
  assert np.abs(long[:64] - short).max() > 1e-2  # The two sets differ: the test can fail.


def stepped_greedy(hf, prompt: list[int], n: int) -> list[int]:
  """transformers' model run as an engine runs it: the prompt, then one token a step on its KV
  cache (its `generate` for Phi-3 instead drops the cache and recomputes the whole sequence on
  the long factors at the step that passes the original length)."""
  import torch

  with torch.no_grad():
    out = hf(torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for position in range(len(prompt), len(prompt) + n - 1):
      out = hf(torch.tensor([tokens[-1:]]), cache=out.cache, use_cache=True,
               position_ids=torch.tensor([[position]]))
      tokens.append(int(out.logits[0, -1].argmax()))
  return tokens


def test_greedy_through_the_engine_matches_transformers(tiny, checked):
  """Batched in one step: a 60-token prompt (short factors, then long ones from the decode step
  that passes 64, the keys cached before keeping theirs) and a 70-token one (long from the
  start): transformers' greedy tokens, the model stepped on its cache; a sequence picks its set
  whatever shares its step. No compile after warm-up."""
  hf, _, model = tiny
  engine = Engine(model, EngineConfig(num_slots=2, page_size=4, num_pages=90, max_model_len=96,
                                      prefill_buckets=(160,), compilation_cache_dir=None,
                                      attention_backend=AttentionBackend.REFERENCE))
  engine.warmup()
  runner = checked(Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=160)))
  rng = np.random.default_rng(1)
  prompts = [[int(i) for i in rng.integers(0, hf_tiny.VOCAB, n)] for n in (60, 70)]
  params = SamplingParams(temperature=0, max_tokens=12)
  with count_compiles() as counts:
    results = runner.generate([(p, params) for p in prompts])
  assert counts == {"trace": 0, "compile": 0}
  for prompt, result in zip(prompts, results):
    assert list(result.token_ids) == stepped_greedy(hf, prompt, 12)
  # Past the original length from its prompt on, transformers' generate agrees too.
  assert list(results[1].token_ids) == hf_tiny.greedy(hf, prompts[1], 12)


def test_gguf_gives_the_same_model(tiny):
  """llama.cpp's converter writes the factors as tensors and the attention factor as float32
  metadata: the same config (to float32), the same logits past the original length."""
  hf, path, model = tiny
  hf_tiny.write_gguf(hf, path / "model.gguf", "phi3")
  cfg, params = weights.load_gguf(path / "model.gguf")
  ours, theirs = cfg.rope_scaling, model.cfg.rope_scaling
  assert isinstance(ours, LongRope) and ours.original_max_position == ORIGINAL
  for field in ("short_factor", "long_factor", "attention_factor"):
    np.testing.assert_allclose(getattr(ours, field), getattr(theirs, field), rtol=1e-6)
  same = dataclasses.replace(cfg, rope_scaling=theirs, norm_eps=model.cfg.norm_eps,
                             name=model.cfg.name)
  assert same == model.cfg
  ids = [int(i) for i in np.random.default_rng(0).integers(0, hf_tiny.VOCAB, 128)]
  ours = np.asarray(dense_logits(checkpoint.build_model(cfg, params), ids, page_size=4))
  assert np.abs(ours - hf_tiny.logits(hf, ids)).max() < 1e-4


def test_longrope_with_the_wrong_number_of_factors_is_refused():
  hf = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
        "num_attention_heads": 4, "max_position_embeddings": 256,
        "original_max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}
  with pytest.raises(ValueError, match="LongRope needs head_dim / 2 = 4 short and long factors"):
    readers.from_hf(hf)

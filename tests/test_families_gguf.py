"""Qwen3, Mistral (a `llama` file with a window on every layer) and Phi-3 (fused QKV and gate/up)
from GGUF: a tiny random transformers model of each, written as llama.cpp's converter writes
that family (support/hf_tiny.py), loaded by jaxserve. The config and the parameters are the ones
its safetensors give; logits at every position within 1e-4 of transformers, and transformers'
greedy tokens."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import ModelFamily, readers
from jaxserve.loading import checkpoint, weights
from support import hf_tiny
from support.tiny import dense_logits

pytest.importorskip("torch")
pytest.importorskip("transformers")

# family -> (GGUF architecture, a llama file's sliding_window key, the family jaxserve reads)
FILES = {"qwen3": ("qwen3", None, ModelFamily.QWEN3),
         "mistral": ("llama", 8, ModelFamily.MISTRAL),
         "phi3": ("phi3", None, ModelFamily.PHI3)}


@pytest.fixture(scope="module", params=sorted(FILES))
def family(request, tmp_path_factory):
  """(name, transformers model, jaxserve model from the GGUF, config and params from the
  safetensors of the same model)."""
  name = request.param
  arch, window, _ = FILES[name]
  hf = hf_tiny.build(*hf_tiny.FAMILIES[name])
  path = tmp_path_factory.mktemp(name)
  hf.save_pretrained(path)
  hf_tiny.write_gguf(hf, path / "model.gguf", arch, window)
  cfg, params = weights.load_gguf(path / "model.gguf")
  return name, hf, checkpoint.build_model(cfg, params), weights.load_hf_dir(path)


def test_config_and_parameters_are_the_safetensors_ones(family):
  """Float32 tensors: GGUF and safetensors give the same numbers, fused ones split alike."""
  name, _, model, (hf_cfg, hf_params) = family
  assert model.cfg.family is FILES[name][2]
  # GGUF stores the epsilon as float32.
  assert model.cfg.norm_eps == pytest.approx(hf_cfg.norm_eps, rel=1e-6)
  assert model.cfg == dataclasses.replace(hf_cfg, name=model.cfg.name, norm_eps=model.cfg.norm_eps)
  ours = nnx.to_pure_dict(nnx.state(model))
  assert jax.tree.structure(ours) == jax.tree.structure(hf_params)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(hf_params)):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_logits_match_transformers_at_every_position(family):
  """40 tokens: Mistral's and Phi-3's positions past their 8-token window see only it."""
  hf_tiny.assert_logits_match(family[1], family[2])


def test_greedy_tokens_match_transformers(family):
  """12 greedy tokens after a 23-token prompt, each the argmax of a full forward."""
  _, hf, model, _ = family
  prompt = [int(i) for i in np.random.default_rng(1).integers(0, hf_tiny.VOCAB, 23)]
  ids = list(prompt)
  for _ in range(12):
    ids.append(int(np.argmax(np.asarray(dense_logits(model, ids, page_size=4))[-1])))
  assert ids[len(prompt):] == hf_tiny.greedy(hf, prompt, 12)


@pytest.mark.parametrize("arch, extra, message", [
    ("qwen3moe", {}, "unsupported GGUF architecture 'qwen3moe'.*jaxserve serves.*qwen3"),
    ("llama", {"llama.expert_count": 8}, "llama GGUF with experts")])
def test_gguf_it_cannot_run_is_refused_by_name(arch, extra, message):
  meta = {"general.architecture": arch, f"{arch}.attention.head_count": 4,
          f"{arch}.embedding_length": 64, f"{arch}.block_count": 2,
          f"{arch}.feed_forward_length": 96, "tokenizer.ggml.tokens": ["a"] * 8, **extra}
  with pytest.raises(ValueError, match=message):
    readers.from_gguf(meta, has_output=True)

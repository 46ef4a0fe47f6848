"""Loaders: Hugging Face safetensors directories, GGUF files, and our orbax checkpoints, each
checked against transformers running the same weights."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.cli import main as cli
from jaxserve.loading import checkpoint, weights
from support import hf_tiny
from support.tiny import dense_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = [3, 17, 42, 99, 5, 64, 23, 88, 7, 31, 12]
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def hf_model(kind: str):
  torch.manual_seed(0)
  if kind == "llama3":  # Untied head, GQA, Llama-3.1 RoPE scaling.
    cfg = transformers.LlamaConfig(**SMALL, tie_word_embeddings=False, rope_theta=500000.0,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0,
                                                     low_freq_factor=1.0, high_freq_factor=4.0,
                                                     original_max_position_embeddings=64))
    return transformers.LlamaForCausalLM(cfg).eval()
  return transformers.Qwen2ForCausalLM(
      transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)).eval()


def torch_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_hf_directory_matches_transformers(tmp_path, kind):
  model = hf_model(kind)
  model.save_pretrained(tmp_path)
  cfg, params = weights.load_hf_dir(tmp_path)
  assert cfg.qkv_bias == (kind == "qwen2") and cfg.tie_embeddings == (kind == "qwen2")
  ours = dense_logits(checkpoint.build_model(cfg, params), IDS)
  np.testing.assert_allclose(np.asarray(ours), torch_logits(model, IDS), atol=1e-4)


def test_gguf_with_llama_cpp_row_order_matches_transformers(tmp_path):
  """Un-permuting llama.cpp's Q/K rows is what makes the logits agree."""
  model = transformers.LlamaForCausalLM(
      transformers.LlamaConfig(**SMALL, tie_word_embeddings=False)).eval()
  hf_tiny.write_gguf(model, tmp_path / "tiny.gguf", "llama")
  cfg, params = weights.load_gguf(tmp_path / "tiny.gguf")
  ours = dense_logits(checkpoint.build_model(cfg, params), IDS)
  np.testing.assert_allclose(np.asarray(ours), torch_logits(model, IDS), atol=1e-4)


def test_convert_then_restore_gives_the_same_model(tmp_path, default_model):
  """`jaxserve convert` of a HF directory (with the default model's tokenizer) round-trips."""
  model = hf_model("qwen2")
  src, dst = tmp_path / "hf", tmp_path / "ckpt"
  model.save_pretrained(src)
  default_model[1].save(src)
  assert cli.main(["convert", str(src), str(dst)]) == 0
  cfg, params, tok = checkpoint.restore(dst)
  ref_cfg, ref_params = weights.load_hf_dir(src)
  assert cfg == ref_cfg
  np.testing.assert_array_equal(params["layers"]["bq"], ref_params["layers"]["bq"])
  assert tok.encode("Hello, world!") == default_model[1].encode("Hello, world!")
  ours = dense_logits(checkpoint.load_model(str(dst))[0], IDS)
  np.testing.assert_allclose(np.asarray(ours), torch_logits(model, IDS), atol=1e-4)


def test_every_tensor_type_of_both_packaged_ggufs_dequantizes():
  """SmolLM2 (F32, Q8_0, Q4_1) and Gemma 3 (F32, Q8_0, Q5_0, Q4_K, Q6_K): one tensor of each type
  comes out finite, float32, shaped [out, in] and spread like real weights. (The exact checks of
  the dequantized models are their logits against transformers, in test_real_model.py and
  test_gemma3.py.)"""
  import gguf

  from jaxserve.loading import pull

  seen = {}
  for model in (pull.SMOLLM2, pull.GEMMA3):
    for t in gguf.GGUFReader(str(pull.gguf_path(model))).tensors:
      seen.setdefault(t.tensor_type.name, t)
  assert {"F32", "Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"} <= set(seen)
  for name, t in seen.items():
    w = weights.dequantize(t)
    assert w.shape == tuple(reversed([int(d) for d in t.shape])), name
    assert w.dtype == np.float32 and np.isfinite(w).all(), name
    assert 0 < float(np.std(w)) < 10, name  # Real weights: spread out, not garbage.

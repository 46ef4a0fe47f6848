"""ModelConfigs from a Hugging Face `config.json` or GGUF metadata, for every family.

Llama-family readers here; Gemma 3's in config/gemma3.py.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxserve.config import gemma3
from jaxserve.config.model import ModelConfig, RopeScaling

# The text-only model, and the multimodal one (4B, 12B, 27B), read as its text model.
GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


def from_hf(hf: Mapping[str, Any], name: str = "model") -> ModelConfig:
  """Builds a config from a Hugging Face `config.json` dict."""
  arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
  if arch in GEMMA3_ARCHITECTURES or hf.get("model_type") in ("gemma3_text", "gemma3"):
    return gemma3.from_hf(hf, name)
  if arch not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
    raise ValueError(f"unsupported architecture {arch!r}: jaxserve runs Llama-family models")
  num_heads = hf["num_attention_heads"]
  # transformers >= 5 writes `rope_parameters` (theta included) instead of rope_theta/rope_scaling.
  rope = hf.get("rope_parameters") or {}
  theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
  scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                       else None)
  if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
    scaling = RopeScaling(scaling["factor"], scaling["low_freq_factor"],
                          scaling["high_freq_factor"],
                          scaling["original_max_position_embeddings"])
  elif scaling:
    raise ValueError(f"unsupported rope_scaling {scaling!r}")
  return ModelConfig(
      vocab_size=hf["vocab_size"],
      dim=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads", num_heads),
      head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
      hidden_dim=hf["intermediate_size"],
      norm_eps=hf.get("rms_norm_eps", 1e-5),
      rope_theta=theta,
      rope_scaling=scaling,
      max_seq_len=hf.get("max_position_embeddings", 2048),
      tie_embeddings=hf.get("tie_word_embeddings", False),
      qkv_bias=arch == "Qwen2ForCausalLM" or hf.get("attention_bias", False),
      name=name,
  )

def from_gguf(meta: Mapping[str, Any], has_output: bool, name: str = "model") -> ModelConfig:
  """Builds a config from GGUF metadata (`meta` maps key -> python value)."""
  arch = meta["general.architecture"]
  if arch == "gemma3":
    return gemma3.from_gguf(meta, has_output, name)
  if arch not in ("llama", "mistral", "qwen2"):
    raise ValueError(f"unsupported GGUF architecture {arch!r}: jaxserve runs Llama-family models")
  p = arch + "."
  num_heads = meta[p + "attention.head_count"]
  dim = meta[p + "embedding_length"]
  scaling = None
  if meta.get(p + "rope.scaling.type") == "llama3" or (p + "rope.scaling.low_freq_factor") in meta:
    scaling = RopeScaling(meta[p + "rope.scaling.factor"], meta[p + "rope.scaling.low_freq_factor"],
                          meta[p + "rope.scaling.high_freq_factor"],
                          meta[p + "rope.scaling.original_context_length"])
  vocab = meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
  return ModelConfig(
      vocab_size=vocab,
      dim=dim,
      num_layers=meta[p + "block_count"],
      num_heads=num_heads,
      num_kv_heads=meta.get(p + "attention.head_count_kv", num_heads),
      head_dim=meta.get(p + "attention.key_length", dim // num_heads),
      hidden_dim=meta[p + "feed_forward_length"],
      norm_eps=meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5),
      rope_theta=meta.get(p + "rope.freq_base", 10000.0),
      rope_scaling=scaling,
      max_seq_len=meta.get(p + "context_length", 2048),
      tie_embeddings=not has_output,
      qkv_bias=arch == "qwen2",
      name=name,
  )

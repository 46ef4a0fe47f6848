"""ModelConfigs from a Hugging Face `config.json` or GGUF metadata, for every family.

Llama-family readers here; Gemma 3's in config/gemma3.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from jaxserve.config import gemma3, qwen_vl
from jaxserve.config.model import LongRope, ModelConfig, ModelFamily, RopeScaling

# The text-only model, and the multimodal one (4B, 12B, 27B), read as its text model.
GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


# Architecture -> family of the Llama block and its variants (model/llama.py).
HF_FAMILIES = {
    "LlamaForCausalLM": ModelFamily.LLAMA, "Qwen2ForCausalLM": ModelFamily.LLAMA,
    "MistralForCausalLM": ModelFamily.MISTRAL, "Qwen3ForCausalLM": ModelFamily.QWEN3,
    "Qwen3MoeForCausalLM": ModelFamily.QWEN3_MOE, "MixtralForCausalLM": ModelFamily.MIXTRAL,
    "Phi3ForCausalLM": ModelFamily.PHI3,
}
QWEN_VL_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
SERVED = (*HF_FAMILIES, *GEMMA3_ARCHITECTURES, *QWEN_VL_ARCHITECTURES)


def from_hf(hf: Mapping[str, Any], name: str = "model") -> ModelConfig:
  """Builds a config from a Hugging Face `config.json` dict."""
  arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
  if arch in GEMMA3_ARCHITECTURES or hf.get("model_type") in ("gemma3_text", "gemma3"):
    return gemma3.from_hf(hf, name)
  if arch in QWEN_VL_ARCHITECTURES or hf.get("model_type") == "qwen2_5_vl":
    return _qwen_vl(hf, name)
  if arch not in HF_FAMILIES:
    raise ValueError(f"unsupported architecture {arch!r} (model_type "
                     f"{hf.get('model_type')!r}): jaxserve serves {', '.join(SERVED)}")
  family = HF_FAMILIES[arch]
  if family is ModelFamily.PHI3:
    _check_phi3(hf)
  num_heads = hf["num_attention_heads"]
  cfg = ModelConfig(
      vocab_size=hf["vocab_size"],
      dim=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads", num_heads),
      head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
      hidden_dim=hf["intermediate_size"],
      norm_eps=hf.get("rms_norm_eps", 1e-5),
      max_seq_len=hf.get("max_position_embeddings", 2048),
      tie_embeddings=hf.get("tie_word_embeddings", False),
      qkv_bias=arch == "Qwen2ForCausalLM" or hf.get("attention_bias", False),
      name=name,
      family=family,
      **_hf_rope(hf, hf.get("max_position_embeddings", 2048)),
  )
  return dataclasses.replace(cfg, **_hf_window(hf, cfg), **_hf_experts(hf, family))


def _qwen_vl(hf: Mapping[str, Any], name: str) -> ModelConfig:
  """Qwen2.5-VL: a Qwen2 text model rotated by M-RoPE, and its vision side (config/qwen_vl.py).
  Published configs give the text model's keys at the top; transformers 5 nests them under
  `text_config`, its RoPE under `rope_parameters`."""
  text = {**hf, **hf.get("text_config", {})}
  rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
  if "mrope_section" not in rope:
    raise ValueError(f"a Qwen2.5-VL config without an mrope_section in its RoPE: {rope!r}")
  theta = text.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
  plain = {**text, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": None,
           "rope_parameters": None, "rope_theta": theta}
  return dataclasses.replace(from_hf(plain, name), mrope_section=tuple(rope["mrope_section"]),
                             vision=qwen_vl.from_hf(hf))


def _hf_rope(hf: Mapping[str, Any], max_positions: int) -> dict[str, Any]:
  # transformers >= 5 writes `rope_parameters` (theta included) instead of rope_theta/rope_scaling.
  rope = hf.get("rope_parameters") or {}
  theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
  scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                       else None)
  kind = scaling and scaling.get("rope_type", scaling.get("type"))
  if kind == "llama3":
    scaling = RopeScaling(scaling["factor"], scaling["low_freq_factor"],
                          scaling["high_freq_factor"],
                          scaling["original_max_position_embeddings"])
  elif kind in ("longrope", "su"):  # transformers reads Phi-3's early "su" as longrope.
    # A top-level original_max_position_embeddings (Phi-3's) wins, as in transformers.
    original = hf.get("original_max_position_embeddings",
                      scaling.get("original_max_position_embeddings", max_positions))
    scaling = longrope(scaling["short_factor"], scaling["long_factor"], original, max_positions,
                       scaling.get("factor"), scaling.get("attention_factor"))
  elif scaling:
    raise ValueError(f"unsupported rope_scaling {scaling!r}")
  return {"rope_theta": theta, "rope_scaling": scaling}


def longrope(short, long, original: int, max_positions: int, factor: float | None = None,
             attention_factor: float | None = None) -> LongRope:
  """transformers' LongRoPE parameters: without an attention factor, sqrt(1 + ln(factor) /
  ln(original)), where the factor defaults to max_positions / original (Phi-3's configs name
  none); 1 when the factor is at most 1."""
  if attention_factor is None:
    factor = factor or max_positions / original
    attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
  return LongRope(tuple(float(x) for x in short), tuple(float(x) for x in long), int(original),
                  float(attention_factor))


def _check_phi3(hf: Mapping[str, Any]) -> None:
  """Phi-3 rotates every dimension of a head, as jaxserve does (RoPE as it is, or LongRoPE:
  the 128k models, Phi-3.5-mini); Phi-4-mini rotates a part only."""
  scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  if scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
    raise ValueError("phi3 with partial_rotary_factor != 1 (Phi-4-mini): jaxserve rotates "
                     "every dimension of a head")


def _hf_window(hf: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  """Mistral (Mixtral, Phi-3) attend to the last `sliding_window` positions on every layer, when
  the config sets one shorter than the context; without one, Mistral is a Llama. Qwen2/3 write
  a window but use it only with `use_sliding_window`, which no released model sets."""
  window = hf.get("sliding_window")
  if hf.get("use_sliding_window"):
    raise ValueError(f"{cfg.family.value} with use_sliding_window: jaxserve does not run "
                     "Qwen's per-layer windows (no released model sets it)")
  if cfg.family not in (ModelFamily.MISTRAL, ModelFamily.MIXTRAL, ModelFamily.PHI3):
    return {}
  if not window or window >= cfg.max_seq_len:
    family = ModelFamily.LLAMA if cfg.family is ModelFamily.MISTRAL else cfg.family
    return {"family": family}
  return {"sliding_window": window, "local_layers": (True,) * cfg.num_layers}


def _hf_experts(hf: Mapping[str, Any], family: ModelFamily) -> dict[str, Any]:
  """Both route with a softmax over every expert, then take the top k; Mixtral always
  renormalises the k weights, Qwen3-MoE when `norm_topk_prob` says so."""
  if family is ModelFamily.MIXTRAL:
    return {"num_experts": hf["num_local_experts"], "experts_per_token": hf["num_experts_per_tok"],
            "expert_hidden_dim": hf["intermediate_size"], "norm_topk": True}
  if family is not ModelFamily.QWEN3_MOE:
    return {}
  if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
    raise ValueError("qwen3_moe with dense layers (mlp_only_layers, decoder_sparse_step): "
                     "jaxserve runs Qwen3-MoE with experts on every layer, as released")
  return {"num_experts": hf.get("num_experts", hf.get("num_local_experts")),
          "experts_per_token": hf["num_experts_per_tok"],
          "expert_hidden_dim": hf["moe_intermediate_size"],
          "norm_topk": hf.get("norm_topk_prob", False)}


# GGUF architecture -> family of the Llama block and its variants. A Mistral GGUF is `llama`
# (llama.cpp's converter writes MistralForCausalLM as a Llama); its window makes it MISTRAL.
GGUF_FAMILIES = {"llama": ModelFamily.LLAMA, "mistral": ModelFamily.LLAMA,
                 "qwen2": ModelFamily.LLAMA, "qwen3": ModelFamily.QWEN3, "phi3": ModelFamily.PHI3}


def from_gguf(meta: Mapping[str, Any], has_output: bool, name: str = "model",
              rope_factors=None) -> ModelConfig:
  """Builds a config from GGUF metadata (`meta` maps key -> python value); `rope_factors`: a
  Phi-3 file's LongRoPE factors (short, long), which it stores as tensors."""
  arch = meta["general.architecture"]
  if arch == "gemma3":
    return gemma3.from_gguf(meta, has_output, name)
  if arch not in GGUF_FAMILIES:
    raise ValueError(f"unsupported GGUF architecture {arch!r}: jaxserve serves "
                     f"{', '.join((*GGUF_FAMILIES, 'gemma3'))}")
  p = arch + "."
  if meta.get(p + "expert_count"):
    raise ValueError(f"{arch} GGUF with experts (Mixtral, Qwen3-MoE): jaxserve reads mixtures "
                     "of experts from Hugging Face safetensors only")
  num_heads = meta[p + "attention.head_count"]
  dim = meta[p + "embedding_length"]
  context = meta.get(p + "context_length", 2048)
  vocab = meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
  cfg = ModelConfig(
      vocab_size=vocab,
      dim=dim,
      num_layers=meta[p + "block_count"],
      num_heads=num_heads,
      num_kv_heads=meta.get(p + "attention.head_count_kv", num_heads),
      head_dim=meta.get(p + "attention.key_length", dim // num_heads),
      hidden_dim=meta[p + "feed_forward_length"],
      norm_eps=meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5),
      rope_theta=meta.get(p + "rope.freq_base", 10000.0),
      rope_scaling=_gguf_rope_scaling(meta, p, context, rope_factors),
      max_seq_len=context,
      tie_embeddings=not has_output,
      qkv_bias=arch == "qwen2",
      name=name,
      family=GGUF_FAMILIES[arch],
  )
  window = meta.get(p + "attention.sliding_window")
  return dataclasses.replace(cfg, **_gguf_window(arch, window, cfg))


def _gguf_rope_scaling(meta: Mapping[str, Any], p: str, context: int, rope_factors):
  """Llama 3.1's scaling, from its keys; LongRoPE, from a Phi-3 file's factor tensors (with the
  attention factor llama.cpp's converter computed as transformers does)."""
  if rope_factors is not None:
    return longrope(*rope_factors, meta[p + "rope.scaling.original_context_length"], context,
                    attention_factor=meta.get(p + "rope.scaling.attn_factor"))
  if meta.get(p + "rope.scaling.type") == "llama3" or (p + "rope.scaling.low_freq_factor") in meta:
    return RopeScaling(meta[p + "rope.scaling.factor"], meta[p + "rope.scaling.low_freq_factor"],
                       meta[p + "rope.scaling.high_freq_factor"],
                       meta[p + "rope.scaling.original_context_length"])
  return None


def _gguf_window(arch: str, window: int | None, cfg: ModelConfig) -> dict[str, Any]:
  """A Llama (Mistral) or Phi-3 GGUF with a window shorter than its context attends to the last
  `window` positions on every layer, as its Hugging Face config says (_hf_window). llama.cpp's
  converter writes 0 for a Phi-3 without one, and no key for Mistral 7B v0.1, which it (and so
  jaxserve) then runs as a Llama."""
  if arch not in ("llama", "mistral", "phi3") or not window or window >= cfg.max_seq_len:
    return {}
  family = ModelFamily.MISTRAL if cfg.family is ModelFamily.LLAMA else cfg.family
  return {"family": family, "sliding_window": window, "local_layers": (True,) * cfg.num_layers}

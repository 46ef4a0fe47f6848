"""Gemma 3 text-model configs, from a Hugging Face `config.json` or from GGUF metadata.

Gemma 3 interleaves local layers (attention over the last `sliding_window` positions, RoPE base
10,000) with global ones (all positions, RoPE base 1,000,000, linear RoPE scaling on the larger
models). Which layers are local is read from the config, never assumed: Hugging Face lists
`layer_types` (or, in older configs, a period `sliding_window_pattern`: every n-th layer is
global); GGUF files may carry `<arch>.attention.sliding_window_pattern`, and llama.cpp's period
of 6 applies when they do not.

The multimodal Gemma 3 models (4B, 12B, 27B: `Gemma3ForConditionalGeneration`) nest their
text model's keys under `text_config`, and their published configs give only the keys that differ
from transformers' `Gemma3TextConfig` defaults (the 4B's has no head counts), so a missing key
takes that default (`TEXT_DEFAULTS`), as transformers reads it. Their vision side is
config/vision.py's `VisionConfig` (ModelConfig.vision).

Gemma 3 replaced Gemma 2's attention soft-capping with qk-norm: a config's
`attn_logit_softcapping` is ignored, as transformers' Gemma 3 ignores it. The final-logit cap
is applied when a config sets one.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxserve.config import vision
from jaxserve.config.model import ModelConfig, ModelFamily

LOCAL_ROPE_THETA = 10_000.0  # Gemma 3's local base, and llama.cpp's when a GGUF names none.
GLOBAL_ROPE_THETA = 1_000_000.0
DEFAULT_PATTERN = 6  # Five local layers, then one global, in every released Gemma 3.
# The only Gemma 3 whose query_pre_attn_scalar (dim / heads = 168) is not its head dim (128).
# GGUF has no key for it: llama.cpp picks it by the layer count in the same way.
_GEMMA3_27B_LAYERS = 62


# transformers' Gemma3TextConfig() defaults (checked against it by tests/test_capacity.py).
# RoPE and the layer pattern are left out: their keys' absence picks a spelling (see _hf_rope).
TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "tie_word_embeddings": True,
}


def text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The text model's keys, defaults filled in: a multimodal config's `text_config`, or `hf`."""
  return {**TEXT_DEFAULTS, **hf.get("text_config", hf)}


def pattern_layers(num_layers: int, period: int) -> tuple[bool, ...]:
  """Local (True) unless the layer closes a period: (i + 1) % period == 0 is global."""
  return tuple(bool((i + 1) % period) for i in range(num_layers))


def from_hf(hf: Mapping[str, Any], name: str = "model") -> ModelConfig:
  """A `Gemma3ForCausalLM` / `gemma3_text` config.json (transformers 4 or 5 spelling), or a
  `Gemma3ForConditionalGeneration` one: its text model, and its vision side (config/vision.py)."""
  image_side = vision.from_hf(hf)
  hf = text_config(hf)
  num_layers, num_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
  if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
    raise ValueError(f"unsupported Gemma 3 activation {hf['hidden_activation']!r}")
  if hf.get("use_bidirectional_attention"):
    raise ValueError("bidirectional Gemma 3 (an encoder) cannot generate")
  if hf.get("attention_bias"):
    raise ValueError("Gemma 3 with attention biases: no released model has them")
  local = _hf_local_layers(hf, num_layers)
  global_theta, factor, local_theta = _hf_rope(hf)
  head_dim = hf["head_dim"]
  return ModelConfig(
      vocab_size=hf["vocab_size"],
      dim=hf["hidden_size"],
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=hf["num_key_value_heads"],
      head_dim=head_dim,
      hidden_dim=hf["intermediate_size"],
      norm_eps=hf["rms_norm_eps"],
      rope_theta=global_theta,
      max_seq_len=hf["max_position_embeddings"],
      tie_embeddings=hf["tie_word_embeddings"],
      name=name,
      family=ModelFamily.GEMMA3,
      sliding_window=hf["sliding_window"] if any(local) else None,
      local_layers=local,
      rope_local_theta=local_theta,
      rope_linear_factor=factor,
      query_pre_attn_scalar=hf["query_pre_attn_scalar"],
      # transformers' Gemma3ForConditionalGeneration caps no logits, whatever its text_config
      # says (no released one sets a cap): its reference outputs are uncapped.
      final_logit_softcapping=None if image_side else hf.get("final_logit_softcapping"),
      vision=image_side,
  )


def _hf_local_layers(hf: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
  types = hf.get("layer_types")
  if types is None:
    period = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", DEFAULT_PATTERN))
    return pattern_layers(num_layers, period)
  return tuple(t == "sliding_attention" for t in types)


def _hf_rope(hf: Mapping[str, Any]) -> tuple[float, float | None, float]:
  """(global base, global linear factor or None, local base). transformers 4 writes rope_theta,
  rope_local_base_freq and rope_scaling (global layers only); 5 writes rope_parameters per
  layer type."""
  params = hf.get("rope_parameters") or {}
  full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
  scaling = hf.get("rope_scaling") or full
  if sliding.get("rope_type", "default") != "default":
    raise ValueError(f"unsupported RoPE for Gemma 3's local layers: {sliding!r}")
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind not in ("default", "linear"):
    raise ValueError(f"unsupported Gemma 3 rope scaling {scaling!r} (want linear)")
  factor = scaling["factor"] if kind == "linear" and scaling["factor"] != 1 else None
  global_theta = hf.get("rope_theta", full.get("rope_theta", GLOBAL_ROPE_THETA))
  local_theta = hf.get("rope_local_base_freq", sliding.get("rope_theta", LOCAL_ROPE_THETA))
  return global_theta, factor, local_theta


def from_gguf(meta: Mapping[str, Any], has_output: bool, name: str = "model") -> ModelConfig:
  """A `gemma3` GGUF file's metadata (`meta`: key -> python value)."""
  p = "gemma3."
  num_layers, num_heads = meta[p + "block_count"], meta[p + "attention.head_count"]
  dim = meta[p + "embedding_length"]
  head_dim = meta.get(p + "attention.key_length", 256)
  window = meta.get(p + "attention.sliding_window")
  local = _gguf_local_layers(meta.get(p + "attention.sliding_window_pattern"), num_layers)
  factor = None
  if meta.get(p + "rope.scaling.type") == "linear" and meta.get(p + "rope.scaling.factor", 1) != 1:
    factor = meta[p + "rope.scaling.factor"]
  return ModelConfig(
      vocab_size=meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"]),
      dim=dim,
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=meta.get(p + "attention.head_count_kv", num_heads),
      head_dim=head_dim,
      hidden_dim=meta[p + "feed_forward_length"],
      norm_eps=meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6),
      rope_theta=meta.get(p + "rope.freq_base", GLOBAL_ROPE_THETA),
      max_seq_len=meta.get(p + "context_length", 131_072),
      tie_embeddings=not has_output,
      name=name,
      family=ModelFamily.GEMMA3,
      sliding_window=window if window and any(local) else None,
      local_layers=local if window else (False,) * num_layers,
      rope_local_theta=meta.get(p + "rope.freq_base_swa", LOCAL_ROPE_THETA),
      rope_linear_factor=factor,
      query_pre_attn_scalar=dim // num_heads if num_layers == _GEMMA3_27B_LAYERS else head_dim,
      final_logit_softcapping=meta.get(p + "final_logit_softcapping"),
  )


def _gguf_local_layers(pattern, num_layers: int) -> tuple[bool, ...]:
  """The GGUF pattern key holds a period (an int) or one flag per layer (True: local)."""
  if pattern is None:
    return pattern_layers(num_layers, DEFAULT_PATTERN)
  if isinstance(pattern, int):
    return pattern_layers(num_layers, pattern)
  flags = tuple(bool(f) for f in pattern)
  if len(flags) != num_layers:
    raise ValueError(f"GGUF sliding_window_pattern has {len(flags)} flags for {num_layers} layers")
  return flags

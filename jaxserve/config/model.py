"""The model: a decoder's shapes and options, from our checkpoints, GGUF metadata or a Hugging Face config."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder (SmolLM2, Llama 2/3, Mistral, Qwen2)."""

  vocab_size: int
  dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  hidden_dim: int
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  max_seq_len: int = 2048
  tie_embeddings: bool = True
  qkv_bias: bool = False
  name: str = "model"

  def __post_init__(self):
    for field in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "hidden_dim", "max_seq_len"):
      if getattr(self, field) <= 0:
        raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(self, field)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                       f"num_kv_heads ({self.num_kv_heads})")

  @property
  def num_params(self) -> int:
    d, h = self.dim, self.head_dim
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += (self.num_heads + 2 * self.num_kv_heads) * h
    layer = attn + 3 * d * self.hidden_dim + 2 * d
    embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * layer + embed + d

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
    d = dict(d)
    if d.get("rope_scaling"):
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return cls(**d)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], name: str = "model") -> ModelConfig:
    """Builds a config from a Hugging Face `config.json` dict."""
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
      raise ValueError(f"unsupported architecture {arch!r}: jaxserve runs Llama-family models")
    num_heads = hf["num_attention_heads"]
    # transformers >= 5 writes `rope_parameters` (theta included) instead of rope_theta/rope_scaling.
    rope = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
      scaling = RopeScaling(scaling["factor"], scaling["low_freq_factor"],
                            scaling["high_freq_factor"],
                            scaling["original_max_position_embeddings"])
    elif scaling:
      raise ValueError(f"unsupported rope_scaling {scaling!r}")
    return cls(
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

  @classmethod
  def from_gguf(cls, meta: Mapping[str, Any], has_output: bool, name: str = "model") -> ModelConfig:
    """Builds a config from GGUF metadata (`meta` maps key -> python value)."""
    arch = meta["general.architecture"]
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
    return cls(
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

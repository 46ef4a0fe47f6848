"""The model: a decoder's shapes and options, from our checkpoints, GGUF metadata or a Hugging
Face config."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

from jaxserve.config.qwen_vl import QwenVisionConfig
from jaxserve.config.vision import VisionConfig


class ModelFamily(enum.Enum):
  """Which decoder a ModelConfig describes, and so which module builds it."""

  LLAMA = "llama"  # SmolLM2, Llama 2/3, Mistral, Qwen2: model/llama.py.
  GEMMA3 = "gemma3"  # Gemma 3 text models: model/gemma3.py (configs read by config/gemma3.py).
  # The Llama block's variants, switches of model/llama.py (configs read by config/readers.py):
  QWEN3 = "qwen3"  # RMSNorm on each query and key head, no QKV bias.
  QWEN3_MOE = "qwen3_moe"  # Qwen3's attention, a mixture of experts for the MLP.
  MISTRAL = "mistral"  # A sliding window on every layer (Mistral 7B v0.1); without one, LLAMA.
  MIXTRAL = "mixtral"  # Llama's attention (a window when set), a mixture of experts.
  PHI3 = "phi3"  # Fused QKV and gate/up in the checkpoint (split at load), a window when set.


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position: int


@dataclasses.dataclass(frozen=True)
class LongRope:
  """Phi-3's LongRoPE (the 128k models, Phi-3.5-mini), as transformers runs it: each frequency
  divided by its factor, the short ones while a sequence is at most `original_max_position`
  long and the long ones past it; q and k both scaled by `attention_factor` after rotation."""

  short_factor: tuple[float, ...]  # [H/2]
  long_factor: tuple[float, ...]  # [H/2]
  original_max_position: int
  attention_factor: float


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder of one of the `ModelFamily`s. The fields after `name` are some families' only:
  a window (Gemma 3, Mistral), Gemma 3's RoPE and scalings, and the mixture of experts."""

  vocab_size: int
  dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  hidden_dim: int
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | LongRope | None = None
  max_seq_len: int = 2048
  tie_embeddings: bool = True
  qkv_bias: bool = False
  name: str = "model"
  family: ModelFamily = ModelFamily.LLAMA
  sliding_window: int | None = None  # Positions a local layer sees, its own included.
  local_layers: tuple[bool, ...] = ()  # Per layer: True for a sliding-window (local) layer.
  rope_local_theta: float | None = None  # Local layers' RoPE base; rope_theta is the global one.
  rope_linear_factor: float | None = None  # Global layers' positions are divided by this.
  query_pre_attn_scalar: float | None = None  # Attention scores are scaled by its -1/2 power.
  final_logit_softcapping: float | None = None  # Logits become cap * tanh(logit / cap).
  num_experts: int = 0  # Experts of each MoE layer (0: a dense MLP of hidden_dim).
  experts_per_token: int = 0  # Experts each token is routed to (top-k).
  expert_hidden_dim: int = 0  # Each expert's SwiGLU hidden dim.
  norm_topk: bool = True  # Renormalise the top-k routing weights to sum to 1.
  # M-RoPE (Qwen2.5-VL): the frequencies each of a token's three positions (time, height,
  # width) turns, summing to head_dim / 2; (): one position, plain RoPE.
  mrope_section: tuple[int, ...] = ()
  # A vision-language model's image side (Gemma 3 4B and up, Qwen2.5-VL); None: text only.
  vision: VisionConfig | QwenVisionConfig | None = None

  def __post_init__(self):
    for field in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "hidden_dim", "max_seq_len"):
      if getattr(self, field) <= 0:
        raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(self, field)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                       f"num_kv_heads ({self.num_kv_heads})")
    if self.local_layers and len(self.local_layers) != self.num_layers:
      raise ValueError(f"ModelConfig.local_layers has {len(self.local_layers)} entries for "
                       f"{self.num_layers} layers")
    if any(self.local_layers) and not (self.sliding_window or 0) > 0:
      raise ValueError("ModelConfig.local_layers needs a positive sliding_window, got "
                       f"{self.sliding_window}")
    if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
      raise ValueError(f"ModelConfig.experts_per_token ({self.experts_per_token}) must be in "
                       f"1..num_experts ({self.num_experts})")
    if self.num_experts and self.expert_hidden_dim <= 0:
      raise ValueError("ModelConfig.expert_hidden_dim must be positive for a mixture of experts")
    s, half = self.rope_scaling, self.head_dim // 2
    if self.mrope_section and (len(self.mrope_section) != 3 or sum(self.mrope_section) != half):
      raise ValueError(f"ModelConfig.mrope_section {self.mrope_section} must be three sections "
                       f"summing to head_dim / 2 = {half}")
    if isinstance(s, LongRope) and not len(s.short_factor) == len(s.long_factor) == half:
      raise ValueError(f"LongRope needs head_dim / 2 = {half} short and long "
                       f"factors, got {len(s.short_factor)} and {len(s.long_factor)}")

  @property
  def qk_norm(self) -> bool:
    return self.family in (ModelFamily.GEMMA3, ModelFamily.QWEN3, ModelFamily.QWEN3_MOE)

  @property
  def num_params(self) -> int:
    """Every parameter, all experts included (what the weights take in memory)."""
    return self._params(self.num_experts)

  @property
  def num_active_params(self) -> int:
    """The parameters one token runs through: its top-k experts only (the FLOPs per token)."""
    return self._params(self.experts_per_token)

  def _params(self, experts: int) -> int:
    d, h = self.dim, self.head_dim
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += (self.num_heads + 2 * self.num_kv_heads) * h
    mlp = 3 * d * self.hidden_dim
    if self.num_experts:  # The router, and the experts a token runs (or all of them).
      mlp = d * self.num_experts + experts * 3 * d * self.expert_hidden_dim
    layer = attn + mlp + 2 * d + (2 * h if self.qk_norm else 0)
    if self.family is ModelFamily.GEMMA3:  # Norms after attention and the MLP.
      layer += 2 * d
    embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    vision = 0 if self.vision is None else self.vision.num_params(d)
    return self.num_layers * layer + embed + d + vision

  def to_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "family": self.family.value}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
    d = dict(d)
    if d.get("rope_scaling"):
      s = dict(d["rope_scaling"])
      if "short_factor" in s:  # JSON gives lists; jit wants a hashable config.
        d["rope_scaling"] = LongRope(**{**s, "short_factor": tuple(s["short_factor"]),
                                        "long_factor": tuple(s["long_factor"])})
      else:
        d["rope_scaling"] = RopeScaling(**s)
    d["family"] = ModelFamily(d.get("family", ModelFamily.LLAMA.value))
    d["local_layers"] = tuple(d.get("local_layers", ()))  # JSON gives a list; jit wants hashable.
    d["mrope_section"] = tuple(d.get("mrope_section", ()))
    if d.get("vision"):
      kind = QwenVisionConfig if "merge_size" in d["vision"] else VisionConfig
      d["vision"] = kind.from_dict(d["vision"])
    return cls(**d)

"""LoRA adapters: the request that names one (vLLM's `LoRARequest`), the part of PEFT's
`adapter_config.json` jaxserve serves, and the projections an adapter may target.

An adapter adds `x @ A @ B * scaling` to a projection's output (A [I, r], B [r, O]; scaling
lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA). Imports no jax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from jaxserve.config.model import ModelConfig

# PEFT's module names of the Llama block's projections -> the model's weights (model/llama.py).
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


def target_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  """(I, O) of each target's A [I, r] and B [r, O], by our weight name; attention's heads
  flattened as transformers' projections have them (head-major: n * H + h)."""
  D, F = cfg.dim, cfg.hidden_dim
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return {"wq": (D, q), "wk": (D, kv), "wv": (D, kv), "wo": (q, D),
          "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}


@dataclasses.dataclass(frozen=True)
class LoRARequest:
  """One adapter a request runs under, as vLLM's `vllm.lora.request.LoRARequest(lora_name,
  lora_int_id, lora_path)`: the id is unique per adapter (> 0; 0 is the base model)."""

  lora_name: str
  lora_int_id: int
  lora_path: str = ""

  def __post_init__(self):
    if not isinstance(self.lora_name, str) or not self.lora_name:
      raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got "
                       f"{self.lora_name!r}")
    if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or (
        self.lora_int_id < 1):
      raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1 (0 is the base model), got "
                       f"{self.lora_int_id!r}")

  @property
  def cache_key(self) -> str:
    """What the prefix cache keys this adapter's pages by (batching/kv_pages.py)."""
    return f"{self.lora_int_id}\0{self.lora_name}"


# adapter_config.json fields that change what an adapter computes and that jaxserve does not run:
# refused by name when set (PEFT writes them at these defaults).
_UNSUPPORTED = {"modules_to_save": None, "use_dora": False, "bias": "none",
                "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
                "layer_replication": None, "use_qalora": False, "lora_bias": False,
                "target_parameters": None, "trainable_token_indices": None}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """What jaxserve reads of a PEFT LoRA adapter_config.json."""

  r: int
  lora_alpha: float
  use_rslora: bool = False
  # The PEFT module names targeted (TARGETS' keys); None: a regex, checked by the tensors found.
  target_modules: tuple[str, ...] | None = None

  @property
  def scaling(self) -> float:
    return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], source: str) -> LoraConfig:
    """Raises ValueError naming the field for a config jaxserve cannot serve (`source`: where
    it was read, for the message)."""
    if d.get("peft_type", "LORA") != "LORA":
      raise ValueError(f"{source}: peft_type {d.get('peft_type')!r} is not LORA")
    for key, default in _UNSUPPORTED.items():
      if d.get(key, default) not in (default, None, [], {}):
        raise ValueError(f"{source}: {key}={d[key]!r} is not supported (LoRA on "
                         f"{', '.join(TARGETS)} only)")
    r, alpha = d.get("r"), d.get("lora_alpha", d.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
      raise ValueError(f"{source}: r must be an int >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
      raise ValueError(f"{source}: lora_alpha must be a finite number, got {alpha!r}")
    targets = d.get("target_modules")
    if isinstance(targets, str):  # A regex over module paths: the tensors say what it matched.
      targets = None
    elif targets is not None:
      targets = tuple(sorted(targets))
      unknown = [t for t in targets if t not in TARGETS]
      if unknown:
        raise ValueError(f"{source}: target_modules {unknown} are not supported (LoRA on "
                         f"{', '.join(TARGETS)} only)")
    return cls(r, float(alpha), bool(d.get("use_rslora", False)), targets)

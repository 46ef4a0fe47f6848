"""The image side of a vision-language model: Gemma 3's SigLIP vision tower, its projector into
the text model, the image tokens of the prompt, and the pixel preprocessing its processor does.

Read from a `Gemma3ForConditionalGeneration` config.json (its `vision_config`, and the image
token ids beside it) and, when the folder has one, its `preprocessor_config.json` (the image
size, mean and std). transformers' SiglipVisionConfig defaults fill what a config leaves out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

# transformers' SiglipVisionConfig() defaults, for the keys a published config may leave out.
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                   "num_attention_heads": 12, "image_size": 224, "patch_size": 16,
                   "layer_norm_eps": 1e-6, "num_channels": 3, "hidden_act": "gelu_pytorch_tanh"}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """One image's path into the text model: image_size x image_size pixels, cut into patches of
  patch_size, through num_layers SigLIP layers, average-pooled to mm_tokens_per_image soft
  tokens, each projected to the text model's width. The prompt holds an image as boi, then
  mm_tokens_per_image image tokens, then eoi."""

  dim: int  # The vision tower's width.
  num_layers: int
  num_heads: int
  hidden_dim: int  # Its MLP's width.
  image_size: int
  patch_size: int
  mm_tokens_per_image: int
  image_token_id: int
  boi_token_id: int
  eoi_token_id: int
  norm_eps: float = 1e-6
  # The processor's: pixels / 255, then (x - mean) / std per channel.
  image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
  image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

  def __post_init__(self):
    side = self.image_size // self.patch_size
    per_side = math.isqrt(self.mm_tokens_per_image)
    if self.image_size % self.patch_size:
      raise ValueError(f"VisionConfig.image_size {self.image_size} is not a multiple of its "
                       f"patch_size {self.patch_size}")
    if per_side * per_side != self.mm_tokens_per_image or side % per_side:
      raise ValueError(f"VisionConfig.mm_tokens_per_image {self.mm_tokens_per_image} must be "
                       f"a square whose side divides the {side} patches a side")
    if self.dim % self.num_heads:
      raise ValueError(f"VisionConfig.dim {self.dim} is not a multiple of num_heads "
                       f"{self.num_heads}")

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @property
  def pool(self) -> int:
    """The side of the square of patches averaged into one soft token."""
    return (self.image_size // self.patch_size) // math.isqrt(self.mm_tokens_per_image)

  @property
  def num_image_tokens(self) -> int:
    """Prompt positions one image takes: boi, its soft tokens, eoi."""
    return self.mm_tokens_per_image + 2

  def num_params(self, text_dim: int) -> int:
    d, c = self.dim, 3 * self.patch_size ** 2
    layer = 4 * (d * d + d) + 2 * d * self.hidden_dim + self.hidden_dim + d + 4 * d
    tower = c * d + d + self.num_patches * d + self.num_layers * layer + 2 * d
    return tower + d + d * text_dim  # The projector's norm and matrix.

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> VisionConfig:
    return cls(**hashable(d))


def hashable(d: Mapping[str, Any]) -> dict[str, Any]:
  """A config dict read from JSON with its lists as tuples: jit wants a hashable config."""
  return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def from_hf(hf: Mapping[str, Any], preprocessor: Mapping[str, Any] | None = None
            ) -> VisionConfig | None:
  """A Gemma3ForConditionalGeneration config.json's vision side (None for a text-only one);
  `preprocessor`: its preprocessor_config.json, when the folder has one."""
  if "vision_config" not in hf:
    return None
  v = {**SIGLIP_DEFAULTS, **hf["vision_config"]}
  if v["hidden_act"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
    raise ValueError(f"unsupported SigLIP activation {v['hidden_act']!r}")
  if v["num_channels"] != 3:
    raise ValueError(f"a vision tower of {v['num_channels']} channels: only RGB is supported")
  p = preprocessor or {}
  if p.get("do_pan_and_scan"):
    raise ValueError("Gemma 3's pan-and-scan crops are not supported")
  size = p.get("size") or {}
  if size and size.get("height", v["image_size"]) != v["image_size"]:
    raise ValueError(f"the processor resizes to {size}, the vision tower takes "
                     f"{v['image_size']} pixels a side")
  return VisionConfig(
      dim=v["hidden_size"], num_layers=v["num_hidden_layers"], num_heads=v["num_attention_heads"],
      hidden_dim=v["intermediate_size"], image_size=v["image_size"], patch_size=v["patch_size"],
      mm_tokens_per_image=hf.get("mm_tokens_per_image", 256),
      image_token_id=hf.get("image_token_id", hf.get("image_token_index", 262_144)),
      boi_token_id=hf.get("boi_token_id", hf.get("boi_token_index", 255_999)),
      eoi_token_id=hf.get("eoi_token_id", hf.get("eoi_token_index", 256_000)),
      norm_eps=v["layer_norm_eps"],
      image_mean=tuple(p.get("image_mean", (0.5, 0.5, 0.5))),
      image_std=tuple(p.get("image_std", (0.5, 0.5, 0.5))))

"""Qwen2.5-VL's image side: its vision tower (a windowed-attention ViT whose patches are merged
merge_size x merge_size into one token of the text model's width), the image tokens of its
prompt, and the pixel preprocessing its processor does.

Read from a `Qwen2_5_VLForConditionalGeneration` config.json (its `vision_config`, and the image
token ids beside it) and, when the folder has one, its `preprocessor_config.json` (the pixel
bounds, mean and std). transformers' Qwen2_5_VLVisionConfig defaults fill what a config leaves
out.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxserve.config.vision import hashable

# transformers' Qwen2_5_VLVisionConfig() defaults, for the keys a published config may leave out.
QWEN_VISION_DEFAULTS = {"depth": 32, "hidden_size": 3584, "hidden_act": "silu",
                        "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
                        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                        "window_size": 112, "out_hidden_size": 3584,
                        "fullatt_block_indexes": (7, 15, 23, 31)}
# OpenAI CLIP's per-channel mean and std, the processor's defaults.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SMALLEST_BUCKET = 64  # Patches; each next bucket is 4 times the last.
# The engine resizes an image to at most this many pixels (1,280 tokens), whatever the folder's
# processor allows: transformers' own Qwen2VLImageProcessor default, where the published
# configs' 12,845,056 would make a 65,536-patch encoder bucket (vLLM users set max_pixels for the
# same reason). Up to it, an image's pixels equal the processor's.
MAX_PIXELS = 1_003_520


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
  """An image's path into the text model: resized so each side is a multiple of patch_size *
  merge_size and its area within [min_pixels, max_pixels], cut into patch_size squares (the one
  frame repeated temporal_patch_size times), through num_layers ViT layers (full_layers attend
  over the whole image, the others within windows of window_size pixels a side), then each
  merge_size x merge_size square of patches merged into one token of out_dim. The prompt holds an
  image as vision_start, its tokens (image_token_id), then vision_end."""

  dim: int  # The vision tower's width.
  num_layers: int
  num_heads: int
  hidden_dim: int  # Its MLP's width.
  out_dim: int  # The merger's output: the text model's width.
  image_token_id: int
  vision_start_token_id: int
  vision_end_token_id: int
  patch_size: int = 14
  temporal_patch_size: int = 2
  merge_size: int = 2
  window_size: int = 112  # Pixels a side of a window-attention window.
  full_layers: tuple[int, ...] = (7, 15, 23, 31)  # Layers that attend over the whole image.
  norm_eps: float = 1e-6
  min_pixels: int = 3136
  max_pixels: int = 12_845_056
  # The processor's: pixels / 255, then (x - mean) / std per channel.
  image_mean: tuple[float, float, float] = CLIP_MEAN
  image_std: tuple[float, float, float] = CLIP_STD
  max_patches: int = 0  # The most patches an image may take; 0: max_pixels // patch_size**2.

  def __post_init__(self):
    if not self.max_patches:
      object.__setattr__(self, "max_patches", self.max_pixels // self.patch_size ** 2)
    if self.dim % self.num_heads or (self.dim // self.num_heads) % 4:
      raise ValueError(f"QwenVisionConfig.dim {self.dim} over {self.num_heads} heads must give "
                       "a head dim that is a multiple of 4 (its rotary splits it in four)")
    if self.window_size % (self.patch_size * self.merge_size):
      raise ValueError(f"QwenVisionConfig.window_size {self.window_size} is not a multiple of "
                       f"patch_size * merge_size ({self.patch_size * self.merge_size})")

  @property
  def patch_dim(self) -> int:
    """Values of one patch: 3 channels x temporal_patch_size frames x patch_size**2 pixels."""
    return 3 * self.temporal_patch_size * self.patch_size ** 2

  @property
  def merge_unit(self) -> int:
    """Patches merged into one token."""
    return self.merge_size ** 2

  @property
  def buckets(self) -> tuple[int, ...]:
    """The encoder's padded patch counts: 64 * 4**k, up to the first that holds max_patches."""
    out = [SMALLEST_BUCKET]
    while out[-1] < self.max_patches:
      out.append(out[-1] * 4)
    last = -(-self.max_patches // self.merge_unit) * self.merge_unit  # The last: just enough.
    return (*out[:-1], max(last, SMALLEST_BUCKET)) if len(out) > 1 else tuple(out)

  @property
  def boi_token_id(self) -> int:  # The names the Gemma 3 side gives the markers.
    return self.vision_start_token_id

  @property
  def eoi_token_id(self) -> int:
    return self.vision_end_token_id

  @property
  def num_image_tokens(self) -> int:
    """The fewest prompt positions an image takes: start, its tokens at min_pixels, end."""
    return max(1, self.min_pixels // (self.patch_size * self.merge_size) ** 2) + 2

  def bucket(self, num_patches: int) -> int:
    """The smallest bucket that holds num_patches; ValueError when none does."""
    for b in self.buckets:
      if num_patches <= b:
        return b
    raise ValueError(f"an image of {num_patches} patches is over the encoder's limit of "
                     f"{self.buckets[-1]} (max_patches {self.max_patches})")

  def num_params(self, text_dim: int) -> int:
    """The tower's parameters, its merger's output `text_dim` wide (out_dim is the text width)."""
    d, f, m = self.dim, self.hidden_dim, self.dim * self.merge_unit
    layer = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * (d * f + f) + (f * d + d)
    merger = d + (m * m + m) + (m * text_dim + text_dim)
    return self.patch_dim * d + self.num_layers * layer + merger

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> QwenVisionConfig:
    return cls(**hashable(d))


def from_hf(hf: Mapping[str, Any], preprocessor: Mapping[str, Any] | None = None
            ) -> QwenVisionConfig | None:
  """A Qwen2_5_VLForConditionalGeneration config.json's vision side (None for a text-only one);
  `preprocessor`: its preprocessor_config.json, when the folder has one."""
  if "vision_config" not in hf:
    return None
  v = {**QWEN_VISION_DEFAULTS, **hf["vision_config"]}
  _check_vision(v)
  p = preprocessor or {}
  for ours, theirs in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                       ("spatial_merge_size", "merge_size")):
    if p.get(theirs, v[ours]) != v[ours]:
      raise ValueError(f"the processor's {theirs} is {p[theirs]}, the vision tower's {ours} "
                       f"{v[ours]}")
  size = p.get("size") or {}
  return QwenVisionConfig(
      dim=v["hidden_size"], num_layers=v["depth"], num_heads=v["num_heads"],
      hidden_dim=v["intermediate_size"], out_dim=v["out_hidden_size"],
      image_token_id=hf.get("image_token_id", 151_655),
      vision_start_token_id=hf.get("vision_start_token_id", 151_652),
      vision_end_token_id=hf.get("vision_end_token_id", 151_653),
      patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"],
      merge_size=v["spatial_merge_size"], window_size=v["window_size"],
      full_layers=tuple(v["fullatt_block_indexes"]),
      min_pixels=p.get("min_pixels", size.get("shortest_edge", 3136)),
      max_pixels=min(p.get("max_pixels", size.get("longest_edge", MAX_PIXELS)), MAX_PIXELS),
      image_mean=tuple(p.get("image_mean", CLIP_MEAN)),
      image_std=tuple(p.get("image_std", CLIP_STD)))


def _check_vision(v: Mapping[str, Any]) -> None:
  """ValueError for a vision_config this tower does not compute as transformers does."""
  if v["hidden_act"] != "silu":
    raise ValueError(f"unsupported Qwen2.5-VL vision activation {v['hidden_act']!r}: only a "
                     "SiLU-gated MLP (the merger's GELU is fixed)")
  channels = v.get("in_chans", v["in_channels"])
  if channels != 3:
    raise ValueError(f"a vision tower of {channels} channels: only RGB is supported")
  theta = (v.get("rope_parameters") or {}).get("rope_theta", 10000.0)
  if theta != 10000.0:
    raise ValueError(f"a vision rotary base of {theta}: only transformers' 10000 is supported")

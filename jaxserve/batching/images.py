"""A request's image as the engine takes it: decoded pixels and a content hash.

The front ends decode what a client sent (serving/media.py: PNG, JPEG or WebP, converted to RGB);
the engine side preprocesses `pixels` for its vision encoder, and folds `hash` into the page keys
of the image's tokens, so that two prompts of the same text and different images never share
cached pages while the same image twice does (as vLLM's multimodal hashing). It lives here, below
both branches, because the offline API (llm.py) and the engine may not import serving/.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Image:
  """One decoded image. Compared by `hash`: the pixels are megabytes."""

  pixels: np.ndarray  # [H, W, 3] uint8, RGB.
  hash: str  # content_hash(pixels).

  @classmethod
  def of(cls, pixels: np.ndarray) -> Image:
    """An Image of RGB pixels, hashed; raises ValueError unless `pixels` is [H, W, 3] uint8."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3 or not pixels.size:
      raise ValueError(f"an image must be [H, W, 3] uint8 RGB pixels, got {pixels.dtype} "
                       f"{list(pixels.shape)}")
    pixels = np.ascontiguousarray(pixels)
    pixels.flags.writeable = False  # Its hash must keep describing it.
    return cls(pixels, content_hash(pixels))

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Image) and other.hash == self.hash

  def __hash__(self) -> int:
    return hash(self.hash)

  @property
  def num_bytes(self) -> int:
    return self.pixels.nbytes


def content_hash(pixels: np.ndarray) -> str:
  """SHA-256 of the shape and the pixels: the same picture sent as PNG or as lossless WebP hashes
  the same, since the engine sees the same pixels. (hashlib releases the GIL over megabytes.)"""
  h = hashlib.sha256(np.asarray(pixels.shape, np.int64).tobytes())
  h.update(memoryview(np.ascontiguousarray(pixels)).cast("B"))
  return h.hexdigest()

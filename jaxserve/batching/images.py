"""A request's image as the engine takes it: decoded pixels and a content hash; and where it sits
in the prompt, preprocessed for the vision encoder.

The front ends decode what a client sent (serving/media.py: PNG, JPEG or WebP, converted to RGB);
the engine side preprocesses `pixels` for its vision encoder, and folds `hash` into the page keys
of the image's tokens, so that two prompts of the same text and different images never share
cached pages while the same image twice does (as vLLM's multimodal hashing). It lives here, below
both branches, because the offline API (llm.py) and the engine may not import serving/.

`place_images` (on a worker thread: the resize is the costly part) gives each image its prompt
positions and its pixels as the vision tower takes them (an `ImageSpan`), for
`Runner.new_request(..., images=...)`. Preprocessing is the Pillow processor's (transformers'
Gemma3ImageProcessorPil): a bilinear resize to image_size x image_size in Pillow, then
pixels / 255, then (x - mean) / std per channel, in float32. transformers' default, torchvision
processor resizes with its own bilinear filter, a level or two of 255 apart from Pillow's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from jaxserve.config.vision import VisionConfig


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


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSpan:
  """An image placed in a prompt: its soft tokens are positions [offset, offset + length)."""

  hash: str  # The Image's.
  # The vision tower's input: Gemma 3's [3, S, S] float32 (`preprocess`); Qwen2.5-VL's patches
  # [P, patch_dim] float32 (qwen_images.preprocess).
  pixels: np.ndarray
  offset: int
  length: int
  grid: tuple[int, int, int] = (1, 0, 0)  # Qwen2.5-VL's patch grid (t, h, w); Gemma 3: unused.

  @property
  def end(self) -> int:
    return self.offset + self.length


def page_extras(spans: Sequence[ImageSpan], page_size: int) -> tuple[tuple[str, ...], ...]:
  """Per KV page, the content hashes of the images whose tokens it holds, in order (() none),
  for the page keys (page_keys.py) and the KV events' extra keys; () for a request without
  images."""
  if not spans:
    return ()
  extras: list[tuple[str, ...]] = [()] * ((max(s.end for s in spans) - 1) // page_size + 1)
  for s in spans:
    for i in range(s.offset // page_size, (s.end - 1) // page_size + 1):
      extras[i] += (s.hash,)
  return tuple(extras)


def preprocess(rgb: np.ndarray, vision: VisionConfig) -> np.ndarray:
  """uint8 [H, W, 3] -> float32 [3, S, S]: resized, rescaled and normalized."""
  from PIL import Image as PIL  # Only a process that takes images needs Pillow.

  S = vision.image_size
  resized = np.asarray(PIL.fromarray(rgb).resize((S, S), PIL.Resampling.BILINEAR))
  x = resized.astype(np.float32) * np.float32(1 / 255)
  x = (x - np.asarray(vision.image_mean, np.float32)) / np.asarray(vision.image_std, np.float32)
  return np.ascontiguousarray(x.transpose(2, 0, 1), np.float32)


def from_pil(image) -> Image:
  """A PIL image as an Image; transparency composited onto white, as the processor's
  do_convert_rgb does (a transparent pixel is white, not its hidden colour)."""
  from PIL import Image as PIL

  if "A" in image.getbands() or image.info.get("transparency") is not None:
    rgba = image.convert("RGBA")
    image = PIL.alpha_composite(PIL.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
  return Image.of(np.asarray(image.convert("RGB"), np.uint8))


def expand_text(prompt: str, num_images: int, boi: str, image: str, eoi: str,
                mm_tokens: int) -> str:
  """The processor's prompt: each `boi` placeholder becomes the image's whole sequence (blank
  lines, boi, mm_tokens image tokens, eoi, blank lines); a prompt with none gets one per image
  first, as the processor adds them to an empty text."""
  if boi not in prompt:
    prompt = " ".join([boi] * num_images) + prompt
  if prompt.count(boi) != num_images:
    raise ValueError(f"the prompt has {prompt.count(boi)} {boi} placeholders for {num_images} "
                     "images: one per image")
  return prompt.replace(boi, f"\n\n{boi}{image * mm_tokens}{eoi}\n\n")


def expand_ids(ids: Sequence[int], num_images: int, vision: VisionConfig) -> list[int]:
  """Token ids whose boi tokens each stand for one image -> boi, the image tokens, eoi. Ids
  expanded already (as many image tokens as the images need) pass as they are."""
  ids = list(ids)
  if ids.count(vision.image_token_id) == num_images * vision.mm_tokens_per_image:
    return ids
  if ids.count(vision.boi_token_id) != num_images:
    raise ValueError(f"the prompt has {ids.count(vision.boi_token_id)} image placeholders (token "
                     f"{vision.boi_token_id}) for {num_images} images: one per image")
  out = []
  for t in ids:
    out.extend([t, *[vision.image_token_id] * vision.mm_tokens_per_image, vision.eoi_token_id]
               if t == vision.boi_token_id else [t])
  return out


def place_images(ids: Sequence[int], images: Sequence[Image], vision: VisionConfig
                 ) -> tuple[ImageSpan, ...]:
  """Each image at its run of image tokens in `ids` (expanded: expand_ids, expand_text), in
  order, preprocessed."""
  ids, N = list(ids), vision.mm_tokens_per_image
  starts = [i for i, t in enumerate(ids) if t == vision.image_token_id
            and (i == 0 or ids[i - 1] != vision.image_token_id)]
  runs = [s for s in starts if ids[s:s + N] == [vision.image_token_id] * N]
  if len(runs) != len(images) or len(starts) != len(images):
    raise ValueError(f"the prompt holds {len(starts)} runs of image tokens for {len(images)} "
                     f"images, each of {N} tokens")
  return tuple(ImageSpan(image.hash, preprocess(image.pixels, vision), s, N)
               for image, s in zip(images, runs))

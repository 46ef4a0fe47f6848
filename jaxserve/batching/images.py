"""A request's images, on the host (no jax): the pixels the vision tower takes, made as Gemma 3's
processor makes them, where each image sits in the prompt, and its content hash.

The serving side decodes an image to uint8 [H, W, 3] and hands it to `image_input` (in a worker
thread: the resize is the costly part); `place_images` expands the prompt's placeholders and
gives each image its positions. The engine encodes an image when a prefill chunk first reaches
its tokens (engine/images.py), and the prefix cache keys the pages that hold its tokens by its
hash (page_keys.py), so two requests share those pages only when their images are the same.

Preprocessing is the Pillow processor's (transformers' Gemma3ImageProcessorPil): a bilinear
resize to image_size x image_size in Pillow, then pixels / 255, then (x - mean) / std per
channel, in float32. transformers' default, torchvision processor resizes with its own bilinear
filter, whose values differ from Pillow's by up to a level or two of 255.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from jaxserve.config.vision import VisionConfig


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
  """One image of a request, preprocessed: what the engine encodes and the cache keys by."""

  pixels: np.ndarray  # [3, S, S] float32: the vision tower's input.
  content_hash: bytes  # 32 bytes: the image's identity for the prefix cache.


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSpan:
  """An image placed in a prompt: its soft tokens are positions [offset, offset + length)."""

  image: ImageInput
  offset: int
  length: int

  @property
  def end(self) -> int:
    return self.offset + self.length


def page_extras(spans: Sequence[ImageSpan], page_size: int) -> tuple[bytes, ...]:
  """Per KV page, the content hashes of the images whose tokens it holds (b"": none), for the
  page keys (page_keys.py); () for a request without images."""
  if not spans:
    return ()
  extras = [b""] * ((max(s.end for s in spans) - 1) // page_size + 1)
  for s in spans:
    for i in range(s.offset // page_size, (s.end - 1) // page_size + 1):
      extras[i] += s.image.content_hash
  return tuple(extras)


def content_hash(rgb: np.ndarray) -> bytes:
  """SHA-256 of the decoded pixels and their shape: equal for the same picture in any file
  format (as vLLM hashes an image's pixels, not its bytes)."""
  rgb = np.ascontiguousarray(rgb, np.uint8)
  shape = np.asarray(rgb.shape, "<i4").tobytes()
  return hashlib.sha256(b"image\0" + shape + rgb.tobytes()).digest()


def image_input(rgb: np.ndarray, vision: VisionConfig, content_hash_: bytes | None = None
                ) -> ImageInput:
  """rgb: uint8 [H, W, 3] (a grayscale or RGBA image converted to RGB first, as the processor's
  do_convert_rgb does) -> the image as the engine takes it. `content_hash_`: the serving side's,
  or None to hash the pixels here."""
  rgb = np.asarray(rgb)
  if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or 0 in rgb.shape:
    raise ValueError(f"an image must be uint8 [height, width, 3], got {rgb.dtype} "
                     f"{list(rgb.shape)}")
  return ImageInput(preprocess(rgb, vision), content_hash_ or content_hash(rgb))


def preprocess(rgb: np.ndarray, vision: VisionConfig) -> np.ndarray:
  """uint8 [H, W, 3] -> float32 [3, S, S]: resized, rescaled and normalized."""
  from PIL import Image  # Only a process that takes images needs Pillow.

  S = vision.image_size
  resized = np.asarray(Image.fromarray(rgb).resize((S, S), Image.Resampling.BILINEAR))
  x = resized.astype(np.float32) * np.float32(1 / 255)
  x = (x - np.asarray(vision.image_mean, np.float32)) / np.asarray(vision.image_std, np.float32)
  return np.ascontiguousarray(x.transpose(2, 0, 1), np.float32)


def from_pil(image) -> np.ndarray:
  """A PIL image -> uint8 [H, W, 3]; transparency composited onto white, as the processor's
  do_convert_rgb does (a transparent pixel is white, not its hidden colour)."""
  from PIL import Image

  if "A" in image.getbands() or image.info.get("transparency") is not None:
    rgba = image.convert("RGBA")
    image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
  return np.asarray(image.convert("RGB"), np.uint8)


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


def place_images(ids: Sequence[int], images: Sequence[ImageInput], vision: VisionConfig
                 ) -> tuple[ImageSpan, ...]:
  """Each image at its run of image tokens in `ids` (expanded), in order."""
  ids = list(ids)
  starts = [i for i, t in enumerate(ids) if t == vision.image_token_id
            and (i == 0 or ids[i - 1] != vision.image_token_id)]
  N = vision.mm_tokens_per_image
  runs = [s for s in starts if ids[s:s + N] == [vision.image_token_id] * N]
  if len(runs) != len(images) or len(starts) != len(images):
    raise ValueError(f"the prompt holds {len(starts)} runs of image tokens for {len(images)} "
                     f"images, each of {N} tokens")
  return tuple(ImageSpan(image, s, N) for image, s in zip(images, runs))

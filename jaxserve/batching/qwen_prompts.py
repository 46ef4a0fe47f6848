"""Qwen2.5-VL's images in a prompt (no jax): each image is vision_start, one image token per
merged patch of its resized grid (qwen_images.num_tokens: the count depends on the image's
size), vision_end. The chat template writes `<|vision_start|><|image_pad|><|vision_end|>` per
image part; the processor repeats each `<|image_pad|>` as many times as its image has tokens,
and so does `expand_text` here, before the text is tokenized. A prompt without placeholders gets
one per image first, as for Gemma 3 (images.expand_text).
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.batching import qwen_images
from jaxserve.batching.images import Image, ImageSpan
from jaxserve.config.qwen_vl import QwenVisionConfig


def grid(image: Image, cfg: QwenVisionConfig) -> tuple[int, int, int]:
  """The image's patch grid (1, gh, gw) once resized (no pixels touched)."""
  h, w = qwen_images.smart_resize(*image.pixels.shape[:2], cfg)
  return 1, h // cfg.patch_size, w // cfg.patch_size


def expand_text(prompt: str, images: Sequence[Image], start: str, pad: str, end: str,
                cfg: QwenVisionConfig) -> str:
  """Each `pad` placeholder repeated as many times as its image has tokens (a prompt with none
  gets `start pad end` per image first)."""
  if pad not in prompt:
    prompt = f"{start}{pad}{end}" * len(images) + prompt
  parts = prompt.split(pad)
  if len(parts) - 1 != len(images):
    raise ValueError(f"the prompt has {len(parts) - 1} {pad} placeholders for {len(images)} "
                     "images: one per image")
  out = [parts[0]]
  for image, part in zip(images, parts[1:]):
    out += [pad * qwen_images.num_tokens(grid(image, cfg), cfg), part]
  return "".join(out)


def expand_ids(ids: Sequence[int], images: Sequence[Image], cfg: QwenVisionConfig) -> list[int]:
  """Token ids with one image token per image -> each repeated as its image needs; ids expanded
  already pass as they are."""
  ids, pad = list(ids), cfg.image_token_id
  sizes = [qwen_images.num_tokens(grid(image, cfg), cfg) for image in images]
  if ids.count(pad) == sum(sizes) and sum(sizes) != len(images):
    return ids
  if ids.count(pad) != len(images):
    raise ValueError(f"the prompt has {ids.count(pad)} image placeholders (token {pad}) for "
                     f"{len(images)} images: one per image")
  out, k = [], iter(sizes)
  for t in ids:
    out.extend([pad] * next(k) if t == pad else [t])
  return out


def place_images(ids: Sequence[int], images: Sequence[Image], cfg: QwenVisionConfig
                 ) -> tuple[ImageSpan, ...]:
  """Each image at its run of image tokens in `ids` (expanded), in order, preprocessed into its
  patches; a ValueError when the runs are not the images' lengths."""
  ids, pad = list(ids), cfg.image_token_id
  starts = [i for i, t in enumerate(ids) if t == pad and (i == 0 or ids[i - 1] != pad)]
  if len(starts) != len(images):
    raise ValueError(f"the prompt holds {len(starts)} runs of image tokens for {len(images)} "
                     "images")
  spans = []
  for image, s in zip(images, starts):
    patches, g = qwen_images.preprocess(image.pixels, cfg)
    n = qwen_images.num_tokens(g, cfg)
    run = next((j for j in range(s, len(ids)) if ids[j] != pad), len(ids)) - s
    if run != n:
      raise ValueError(f"an image of {n} tokens (its {g[1]} x {g[2]} patches) has a run of "
                       f"{run} in the prompt")
    spans.append(ImageSpan(image.hash, patches, s, n, g))
  return tuple(spans)

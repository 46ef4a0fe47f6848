"""vLLM's multimodal prompt shape, read for the offline API: `{"prompt": text, "multi_modal_data":
{"image": one or a list}}`, or `"prompt_token_ids"` in place of the text. An image is a PIL
image, uint8 [H, W, 3] RGB pixels, or an images.Image (decoded and hashed already). No jax.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxserve.batching import images as mm
from jaxserve.batching import qwen_prompts
from jaxserve.config.qwen_vl import QwenVisionConfig
from jaxserve.config.vision import VisionConfig

Vision = VisionConfig | QwenVisionConfig


def image_list(prompt: Mapping[str, Any]) -> list:
  """The prompt's images, in order ([] for none); a ValueError for data of another kind."""
  data = prompt.get("multi_modal_data") or {}
  other = sorted(set(data) - {"image"})
  if other:
    raise ValueError(f"multi_modal_data {other}: only 'image' is supported")
  images = data.get("image", [])
  return list(images) if isinstance(images, (list, tuple)) else [images]


def to_image(image) -> mm.Image:
  if isinstance(image, mm.Image):
    return image
  if isinstance(image, np.ndarray):
    return mm.Image.of(image)
  return mm.from_pil(image)  # A PIL image (anything with .convert).


def expand_text(text: str, images: Sequence[mm.Image], markers: Sequence[str],
                vision: Vision) -> str:
  """The text with each image's placeholder expanded as the model's processor does; `markers`:
  the spellings of the boi, image and eoi tokens."""
  if isinstance(vision, QwenVisionConfig):
    return qwen_prompts.expand_text(text, images, *markers, vision)
  return mm.expand_text(text, len(images), *markers, vision.mm_tokens_per_image)


def expand_ids(ids: Sequence[int], images: Sequence[mm.Image], vision: Vision) -> list[int]:
  if isinstance(vision, QwenVisionConfig):
    return qwen_prompts.expand_ids(ids, images, vision)
  return mm.expand_ids(ids, len(images), vision)


def place_images(ids: Sequence[int], images: Sequence[mm.Image], vision: Vision
                 ) -> tuple[mm.ImageSpan, ...]:
  """Each image at its run of image tokens in `ids`, preprocessed for the model's encoder."""
  if isinstance(vision, QwenVisionConfig):
    return qwen_prompts.place_images(ids, images, vision)
  return mm.place_images(ids, images, vision)


def read(prompt: Mapping[str, Any], vision: Vision | None, model_name: str,
         encode: Callable[[str], list[int]], token: Callable[[int], str]
         ) -> tuple[list[int], tuple[mm.ImageSpan, ...]]:
  """(token ids, their images placed) of one prompt dict. `encode(text)`: the tokenizer's (chat
  template and all); `token(id)`: an id's text (the image tokens' spelling)."""
  images = image_list(prompt)
  if images and vision is None:
    raise ValueError(f"model {model_name!r} is text-only: it takes no images, and the prompt has "
                     f"{len(images)}")
  if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
    raise ValueError("a prompt dict needs one of 'prompt' and 'prompt_token_ids'")
  if not images:
    return (list(prompt["prompt_token_ids"]) if "prompt" not in prompt
            else encode(prompt["prompt"])), ()
  inputs = [to_image(im) for im in images]
  if "prompt" in prompt:
    markers = [token(i) for i in (vision.boi_token_id, vision.image_token_id,
                                  vision.eoi_token_id)]
    ids = encode(expand_text(prompt["prompt"], inputs, markers, vision))
  else:
    ids = expand_ids(prompt["prompt_token_ids"], inputs, vision)
  return ids, place_images(ids, inputs, vision)


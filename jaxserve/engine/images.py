"""Images into the step: the vision encoder as its own compiled program, and the step inputs that
put its soft tokens in place of the image tokens' embeddings.

The encoder runs at Gemma 3's one image shape ([1, 3, S, S]), so warm-up compiles it once and no
image compiles anything after. It runs when the first chunk holding an image's tokens is packed;
its soft tokens [Mi, D] come back to the host (one wait for the device, only in a step that
starts an image) and the last MAX_KEPT images' are kept by content hash, so an image whose
tokens two chunks share, or that two requests send, is encoded once. The step takes them as two
arrays, never as static values: `image_rows` [Tp, D] (each packed prefill row's soft token,
zeros for text) and `image_until` [Tp] (the last position of the row's image, -1 for a text
row), from which the step makes each query's attention reach (AttentionMetadata.attend_until).

Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx

from jaxserve.batching.images import ImageSpan
from jaxserve.batching.plan import PrefillChunk
from jaxserve.config import AttentionBackend
from jaxserve.config.vision import VisionConfig

# Encoded images kept on the host: enough for every image a step's chunks can be part-way
# through; an image evicted early is encoded again (same tokens, more time).
MAX_KEPT = 32


def image_args(chunks: Sequence[PrefillChunk], Tp: int, D: int,
               soft_tokens: Callable[[ImageSpan], np.ndarray] | None) -> dict[str, np.ndarray]:
  """image_rows [Tp, D] float32 and image_until [Tp] int32 (StepArgs) for `chunks` packed from
  row 0 of the prefill part; `soft_tokens(span)` -> [Mi, D] (None: no chunk has images). D 0
  (a model without images): none, and a chunk with images is refused."""
  if not D:
    if any(ch.images for ch in chunks):
      raise ValueError("a plan with images for a model that takes none")
    return {}
  rows, until = np.zeros((Tp, D), np.float32), np.full(Tp, -1, np.int32)
  at = 0
  for ch in chunks:
    start, n = ch.start_pos, len(ch.token_ids)
    for span in ch.images:
      lo, hi = max(span.offset, start), min(span.end, start + n)  # Positions in this chunk.
      rows[at + lo - start:at + hi - start] = soft_tokens(span)[lo - span.offset:
                                                                hi - span.offset]
      until[at + lo - start:at + hi - start] = span.end - 1
    at += n
  return dict(image_rows=rows, image_until=until)


def encode(graphdef, params, pixels):
  """pixels [1, 3, S, S] -> soft tokens [Mi, D] float32 (the model's VisionTower)."""
  return nnx.merge(graphdef, params).vision(pixels)[0].astype(np.float32)


class ImageEncoder:
  """The engine's vision encoder: one compiled program, and the soft tokens of recent images."""

  @classmethod
  def of(cls, vision: VisionConfig | None, graphdef, params, backend) -> ImageEncoder | None:
    """A vision-language model's encoder; None for a text-only model. The attention kernels
    take no attend_until: over them an image's tokens attend causally, not both ways as Gemma 3
    was trained to (the jnp backend, the default on CPU, attends as transformers does)."""
    if vision is not None and backend is not AttentionBackend.REFERENCE:
      logging.warning("the %s attention backend attends causally among an image's tokens; "
                      "Gemma 3 attends both ways there (the reference backend does)",
                      backend.value)
    return None if vision is None else cls(graphdef, vision, params)

  def __init__(self, graphdef, vision: VisionConfig, params: Callable[[], object]):
    self.vision = vision
    self._params = params  # The engine's current weights (update_weights may replace them).
    self._encode = jax.jit(encode, static_argnums=0)
    self._graphdef = graphdef
    self._kept: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()

  def soft_tokens(self, image: ImageSpan) -> np.ndarray:
    """[Mi, D] float32: `image`'s, encoded now unless kept."""
    key = image.hash
    if key in self._kept:
      self._kept.move_to_end(key)
      return self._kept[key]
    out = np.asarray(self._encode(self._graphdef, self._params(), image.pixels[None]))
    self._kept[key] = out
    while len(self._kept) > MAX_KEPT:
      self._kept.popitem(last=False)
    return out

  def forget(self) -> None:
    """Drops every kept encoding (new weights encode differently)."""
    self._kept.clear()

  def warmup(self) -> None:
    S = self.vision.image_size
    jax.block_until_ready(self._encode(self._graphdef, self._params(),
                                       np.zeros((1, 3, S, S), np.float32)))

"""Images into the step: the vision encoder as its own compiled program, and the step inputs that
put its soft tokens in place of the image tokens' embeddings.

The encoder runs at Gemma 3's one image shape ([1, 3, S, S]), or at one of Qwen2.5-VL's patch
buckets (QwenVisionConfig.buckets: an image's patches padded to the smallest that holds them), so
warm-up compiles each once and no image compiles anything after. It runs when the first chunk
holding an image's tokens is packed; its soft tokens [Mi, D] come back to the host (one wait for the
device, only in a step that starts an image) and the last MAX_KEPT images' are kept by content hash,
so an image whose tokens two chunks share, or that two requests send, is encoded once. The step
takes them as two arrays, never as static values: `image_rows` [Tp, D] (each packed prefill row's
soft token, zeros for text) and `image_until` [Tp] (the last position of the row's image for Gemma
3, whose image tokens attend both ways; the row's own for Qwen2.5-VL's causal ones; -1 for a text
row), from which the step makes each query's attention reach (AttentionMetadata.attend_until).

Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from jaxserve.batching import mrope, qwen_images
from jaxserve.batching.images import ImageSpan
from jaxserve.batching.plan import PrefillChunk, StepPlan
from jaxserve.config.qwen_vl import QwenVisionConfig
from jaxserve.config.vision import VisionConfig

Vision = VisionConfig | QwenVisionConfig

# Encoded images kept on the host: enough for every image a step's chunks can be part-way
# through; an image evicted early is encoded again (same tokens, more time).
MAX_KEPT = 32


def image_args(chunks: Sequence[PrefillChunk], Tp: int, D: int,
               soft_tokens: Callable[[ImageSpan], np.ndarray] | None,
               both_ways: bool = True) -> dict[str, np.ndarray]:
  """image_rows [Tp, D] float32 and image_until [Tp] int32 (StepArgs) for `chunks` packed from
  row 0 of the prefill part; `soft_tokens(span)` -> [Mi, D] (None: no chunk has images). D 0
  (a model without images): none, and a chunk with images is refused. `both_ways`: an image's
  tokens see the whole image (Gemma 3); else each sees up to itself (Qwen2.5-VL, causal)."""
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
      if lo >= hi:
        continue  # An image before the chunk (it is there for M-RoPE's positions).
      rows[at + lo - start:at + hi - start] = soft_tokens(span)[lo - span.offset:
                                                                hi - span.offset]
      until[at + lo - start:at + hi - start] = span.end - 1 if both_ways else np.arange(lo, hi)
    at += n
  return dict(image_rows=rows, image_until=until)


def rope_args(chunks: Sequence[PrefillChunk], decode_rows: np.ndarray, Tp: int,
              deltas: np.ndarray | None, merge_size: int) -> dict[str, np.ndarray]:
  """An M-RoPE model's rope_shifts [Bd + Tp, 3] int32 (StepArgs): the decode rows' slots'
  deltas (`deltas` [Bs + 1], ImageEncoder.rope_deltas), then each packed prefill position's
  shifts (batching/mrope.py); padding 0. {} for any other model (merge_size 0)."""
  if not merge_size:
    return {}
  Bd = len(decode_rows)
  out = np.zeros((Bd + Tp, 3), np.int32)
  if deltas is not None:
    out[:Bd] = deltas[decode_rows][:, None]
  at = Bd
  for ch in chunks:
    n = len(ch.token_ids)
    out[at:at + n] = mrope.shifts(ch.images, ch.start_pos, n, merge_size)
    at += n
  return {"rope_shifts": out}


def encode(graphdef, params, *inputs):
  """One image's encoder inputs (`inputs`) -> its soft tokens [rows, D] float32 (the model's
  vision tower: Gemma 3's [1, Mi, D], Qwen2.5-VL's a bucket's [Pb / merge_unit, D])."""
  out = nnx.merge(graphdef, params).vision(*inputs)
  return out.reshape(-1, out.shape[-1]).astype(np.float32)


def inputs(vision, span: ImageSpan) -> tuple[np.ndarray, ...]:
  """The encoder's inputs for one image: Gemma 3's pixels [1, 3, S, S]; Qwen2.5-VL's patches
  padded to their bucket [Pb, patch_dim], with each patch's place and window (qwen_images)."""
  if not isinstance(vision, QwenVisionConfig):
    return (span.pixels[None],)
  P = len(span.pixels)
  Pb = vision.bucket(P)
  patches = np.zeros((Pb, vision.patch_dim), np.float32)
  patches[:P] = span.pixels
  return (patches, *qwen_images.patch_layout(span.grid, vision, Pb))


def input_shapes(vision) -> list[tuple[jax.ShapeDtypeStruct, ...]]:
  """The encoder's input shapes, one tuple per compiled program: Gemma 3's one image shape,
  Qwen2.5-VL's each patch bucket."""
  f32, i32 = np.float32, np.int32
  if not isinstance(vision, QwenVisionConfig):
    S = vision.image_size
    return [(jax.ShapeDtypeStruct((1, 3, S, S), f32),)]
  return [(jax.ShapeDtypeStruct((Pb, vision.patch_dim), f32),
           jax.ShapeDtypeStruct((Pb, 2), i32), jax.ShapeDtypeStruct((Pb,), i32))
          for Pb in vision.buckets]


class ImageEncoder:
  """The engine's vision encoder: one compiled program, and the soft tokens of recent images."""

  @classmethod
  def of(cls, vision: Vision | None, graphdef, params, spec) -> ImageEncoder | None:
    """A vision-language model's encoder; None for a text-only model."""
    return None if vision is None else cls(graphdef, vision, params, spec.config.num_slots)

  def __init__(self, graphdef, vision: Vision, params: Callable[[], object], num_slots: int):
    self.vision = vision
    # Qwen2.5-VL's M-RoPE delta of each slot (batching/mrope.py), set by the chunk that ends its
    # prompt, read by its decode rows; the padding slot's (num_slots) stays 0. None: Gemma 3.
    self._deltas = (np.zeros(num_slots + 1, np.int32) if isinstance(vision, QwenVisionConfig)
                    else None)
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
    out = np.asarray(self._encode(self._graphdef, self._params(), *inputs(self.vision, image)))
    out = out[:image.length]  # A Qwen2.5-VL bucket's padding rows dropped.
    self._kept[key] = out
    while len(self._kept) > MAX_KEPT:
      self._kept.popitem(last=False)
    return out

  def rope_deltas(self, plan: StepPlan) -> np.ndarray | None:
    """[Bs + 1] each slot's M-RoPE delta once `plan`'s prompts that end are in (Packer.pack's
    rope_deltas); None for a model without M-RoPE."""
    if self._deltas is not None:
      for ch in plan.prefills:
        if ch.is_last and not ch.num_drafts:
          self._deltas[ch.slot] = mrope.delta(ch.images, self.vision.merge_size)
    return self._deltas

  def forget(self) -> None:
    """Drops every kept encoding (new weights encode differently)."""
    self._kept.clear()

  def warmup(self) -> None:
    """Compiles the encoder for every input shape (one run of zeros each)."""
    for shapes in input_shapes(self.vision):
      zeros = [np.zeros(x.shape, x.dtype) for x in shapes]
      jax.block_until_ready(self._encode(self._graphdef, self._params(), *zeros))

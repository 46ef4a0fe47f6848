"""Qwen2.5-VL's image preprocessing on the host (numpy and Pillow, no jax): the processor's resize
to a size of whole merged patches, its patches in its order, and each patch's place in the patch
grid and in the vision tower's attention windows, padded to an encoder bucket.

The resize is the Pillow processor's (transformers' Qwen2VLImageProcessorPil): a bicubic resize
in Pillow to smart_resize's size, then pixels / 255, then (x - mean) / std per channel, in
float32. transformers' default processor for Qwen2.5-VL (Qwen2VLImageProcessor) resizes with
torchvision's bicubic filter instead, a level or so of 255 apart from Pillow's.

Patch order: the image's merge_size x merge_size squares of patches row-major, and within each
square its patches row-major, so the patches of one merged token are consecutive. Each patch is
flattened (channel, frame, row, column), the frame (the one image) repeated temporal_patch_size
times: the order of the patch embedding's [Dv, 3, T, p, p] convolution kernel.
"""

from __future__ import annotations

import math

import numpy as np

from jaxserve.config.qwen_vl import QwenVisionConfig

MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, cfg: QwenVisionConfig) -> tuple[int, int]:
  """(h, w) the processor resizes a height x width image to: each a multiple of patch_size *
  merge_size, nearest to the original's, scaled down (rounding down) to at most max_pixels or up
  (rounding up) to at least min_pixels. ValueError for an aspect ratio over 200."""
  if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
    raise ValueError(f"an image of {height} x {width} pixels: its aspect ratio "
                     f"{max(height, width) / min(height, width):.1f} is over "
                     f"{MAX_ASPECT_RATIO}")
  factor = cfg.patch_size * cfg.merge_size
  h, w = round(height / factor) * factor, round(width / factor) * factor
  if h * w > cfg.max_pixels:
    beta = math.sqrt(height * width / cfg.max_pixels)
    h = max(factor, math.floor(height / beta / factor) * factor)
    w = max(factor, math.floor(width / beta / factor) * factor)
  elif h * w < cfg.min_pixels:
    beta = math.sqrt(cfg.min_pixels / (height * width))
    h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
  return h, w


def preprocess(rgb: np.ndarray, cfg: QwenVisionConfig
               ) -> tuple[np.ndarray, tuple[int, int, int]]:
  """uint8 [H, W, 3] -> (patches float32 [P, patch_dim] in the processor's order, the grid
  (1, gh, gw) of patches: P = gh * gw)."""
  from PIL import Image as PIL  # Only a process that takes images needs Pillow.

  h, w = smart_resize(rgb.shape[0], rgb.shape[1], cfg)
  resized = np.asarray(PIL.fromarray(rgb).resize((w, h), PIL.Resampling.BICUBIC))
  x = resized.astype(np.float32) * np.float32(1 / 255)
  x = (x - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
  p, m, T = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
  gh, gw = h // p, w // p
  x = x.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
  x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh / m, gw / m, m, m, 3, p, p]
  x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], T, p, p))  # The frame, T times.
  return np.ascontiguousarray(x.reshape(gh * gw, cfg.patch_dim), np.float32), (1, gh, gw)


def num_tokens(grid: tuple[int, int, int], cfg: QwenVisionConfig) -> int:
  """The image's tokens in the prompt (its merged patches)."""
  t, gh, gw = grid
  return t * gh * gw // cfg.merge_unit


def patch_layout(grid: tuple[int, int, int], cfg: QwenVisionConfig, Pb: int
                 ) -> tuple[np.ndarray, np.ndarray]:
  """(pos int32 [Pb, 2]: each patch's row and column in the patch grid, window int32 [Pb]: the
  attention window its merged token falls in, -1 for the padding rows past the image's patches),
  in preprocess's patch order. Windows tile the grid of merged tokens in squares of window_size /
  merge_size / patch_size a side from its top-left corner (those at the right and bottom edges cut
  short), numbered row-major, as transformers' get_window_index tiles them."""
  t, gh, gw = grid
  m, n = cfg.merge_size, t * gh * gw
  if t != 1 or gh % m or gw % m:
    raise ValueError(f"an image's grid must be (1, gh, gw), each side a multiple of {m}: {grid}")
  if Pb < n or Pb % cfg.merge_unit:
    raise ValueError(f"{Pb} padded rows cannot hold {n} patches in whole merged tokens")
  rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
  order = lambda a: a.reshape(gh // m, m, gw // m, m).transpose(0, 2, 1, 3).reshape(-1)
  rows, cols = order(rows), order(cols)
  side = cfg.window_size // cfg.merge_size // cfg.patch_size  # Merged tokens a window side.
  across = -(-(gw // m) // side)  # Windows across the grid.
  pos = np.zeros((Pb, 2), np.int32)
  window = np.full((Pb,), -1, np.int32)
  pos[:n, 0], pos[:n, 1] = rows, cols
  window[:n] = (rows // m // side) * across + cols // m // side
  return pos, window

"""M-RoPE positions (Qwen2.5-VL) as the host hands them to the step: each token's three rotary
positions (time, height, width) as shifts from its position in the sequence. No jax.

A text token before the first image turns by its own position on all three axes (shift 0). An
image's tokens, its merged patch grid of lh x lw in row-major order, sit at (start, start + row,
start + column), `start` the rotary position the image's first token would have had as text; the
text after an image goes on from start + max(lh, lw), so every later token's three shifts are one
number, the sequence's `delta` (transformers' rope_deltas), which the decode rows use.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxserve.batching.images import ImageSpan


def shift_table(spans: Sequence[ImageSpan], merge_size: int) -> tuple[np.ndarray, int]:
  """([E, 3] int32 shifts of positions [0, E), E the last image's end; delta: every later
  position's shift). `spans`: a sequence's images, each with its patch grid (t, h, w)."""
  end = max((s.end for s in spans), default=0)
  table, shift, at = np.zeros((end, 3), np.int32), 0, 0
  for s in sorted(spans, key=lambda s: s.offset):
    table[at:s.offset] = shift
    _, h, w = s.grid
    lh, lw = h // merge_size, w // merge_size
    start = s.offset + shift  # The rotary position of the image's first token.
    k = np.arange(s.length)
    rope = np.stack([np.zeros_like(k), k // lw, k % lw], 1) + start  # [length, 3]
    table[s.offset:s.end] = rope - (s.offset + k)[:, None]
    shift, at = start + max(lh, lw) - s.end, s.end
  return table, shift


def shifts(spans: Sequence[ImageSpan], start: int, n: int, merge_size: int) -> np.ndarray:
  """[n, 3] int32: the shifts of positions [start, start + n) of a sequence whose images are
  `spans` (all of them that start before start + n)."""
  table, delta = shift_table(spans, merge_size)
  out = np.full((n, 3), delta, np.int32)
  hi = min(start + n, len(table))
  if hi > start:
    out[:hi - start] = table[start:hi]
  return out


def delta(spans: Sequence[ImageSpan], merge_size: int) -> int:
  """The shift of every position after a sequence's last image (0 without images)."""
  return shift_table(spans, merge_size)[1] if spans else 0

"""Random GGUF blocks of every type the loader reads (tests of gguf_blocks and kernels_cpu)."""

from __future__ import annotations

import numpy as np

from jaxserve.loading import gguf_blocks

# The byte offsets of each block type's float16 fields (d, and m or dmin): random bytes
# elsewhere are a valid block of any type.
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, rng) -> np.ndarray:
  size, nbytes, _ = gguf_blocks.READERS[type_name]
  blocks = rng.integers(0, 256, (rows * cols // size, nbytes), dtype=np.uint8)
  for at in F16_FIELDS[type_name]:
    f16 = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
    blocks[:, at:at + 2] = f16.view(np.uint8).reshape(-1, 2)
  return blocks.reshape(rows, -1)

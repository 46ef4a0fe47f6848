"""A fingerprint of an engine's weights, for P/D (api/kv_link.ModelIdentity): two servers
exchange KV pages only when the weights that computed them are the same.

Cheap and independent of placement: for every parameter array, its path in the tree, dtype
and shape, and the bytes of `SAMPLES` elements at evenly spaced flat positions (gathered on the
device, a few KiB in all), hashed once. Another checkpoint of the same architecture (a
fine-tune changes every element), another dtype or quantization, differs; the same weights
sharded another way (--tp) do not.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np

SAMPLES = 64


def weights_fingerprint(params) -> str:
  h = hashlib.sha256()
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    h.update(f"{jax.tree_util.keystr(path)} {x.dtype} {tuple(x.shape)}\n".encode())
    if x.size:
      at = np.linspace(0, x.size - 1, min(SAMPLES, x.size)).astype(np.int64)
      h.update(np.asarray(x.reshape(-1)[at]).tobytes())
  return h.hexdigest()[:32]

"""The forms the CPU kernel reads a model's weights in, made from the numpy parameters
(weights.to_params' layout) of a model that runs on one CPU with kernels_cpu built, at load and
by a weight update (engine/weight_update.py, which is why they live below both):
4-bit values packed two a byte, and each stacked layer's arrays in tiles of 64 output columns
(kernels_cpu.reference), so a task of the kernel streams its columns as one run. Measured on the
default model's shapes alone (`python -m scripts.bench quant --kernel 1 --rounds 3`, a 2-core
EPYC, idle), the tiles took a one-row pass over the 30 layers and the head from 8.9 ms to 6.4 ms
(BENCHMARKS.md, "CPU kernels")."""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

import kernels_cpu.reference
from jaxserve.model.quant import IN_AXES, STACKED
from jaxserve.model.quant_linear import reads_in_place


def packed(params: dict) -> dict:
  """`params` (numpy, weights.to_params' layout) with each stacked weight whose values are 4-bit
  without a sign (Q4_1, Q4_K) packed two a byte, which the CPU kernel reads at half the bytes:
  for a model that runs on one CPU with kernels_cpu built (else `params` as they are)."""
  if not reads_in_place():
    return params
  layers = dict(params["layers"])
  for name in STACKED:
    w = layers.get(name)
    if not isinstance(w, Mapping) or w["values"].dtype != np.int8:
      continue
    axis = IN_AXES[name][-1] + 1  # Past the stacked [L] axis.
    v = w["values"]
    group = v.shape[axis] // w["scale"].shape[axis]
    if group % 2 == 0 and v.min(initial=0) >= 0 and v.max(initial=0) < 16:
      layers[name] = {**w, "values": kernels_cpu.reference.packed(v, axis)}
  return {**params, "layers": layers}


def tiled(params: dict) -> tuple[dict, frozenset[str]]:
  """(`params` with each stacked weight whose output columns make whole tiles of 64 stored in
  tiles, which the CPU kernel reads as one run a task; the names of those weights), for a model
  that runs on one CPU with kernels_cpu built (else `params` as they are, no names)."""
  if not reads_in_place():
    return params, frozenset()
  layers, names = dict(params["layers"]), set()
  for name in STACKED:
    w = layers.get(name)
    rows = len(IN_AXES[name]) + 1  # [L, its input axes..., its output axes...]
    if not isinstance(w, Mapping) or math.prod(w["values"].shape[rows:]) % 64:
      continue
    as_tiles = lambda a: kernels_cpu.reference.tiled(
        a.reshape(a.shape[0], math.prod(a.shape[1:rows]), -1)).reshape(a.shape)
    layers[name] = {k: as_tiles(a) for k, a in w.items()}
    names.add(name)
  params = {**params, "layers": layers}
  embed = params.get("embed")
  if "lm_head" not in params and isinstance(embed, Mapping) and embed["values"].shape[0] % 64 == 0:
    # Tied: the head reads [V, D] as [D, V]'s tiles (0.9 ms at one row against 2.4 ms for
    # [V, D]'s rows on a 2-core EPYC), and the lookup reads its rows from those tiles: one copy.
    as_tiles = lambda a: kernels_cpu.reference.tiled(np.ascontiguousarray(a.T)).reshape(a.shape)
    params["embed"] = {k: as_tiles(a) for k, a in embed.items()}
    names.add("embed")
  return params, frozenset(names)

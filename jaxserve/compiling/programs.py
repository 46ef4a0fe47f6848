"""The programs the engine compiles at warm-up, on abstract arguments, compiled for a real chip
on this machine.

The engine is built on abstract weights (`nnx.eval_shape`: shapes only, no memory), so
Llama-3-8B compiles for a v6e from a laptop. `engine_programs` lists what `Engine.warmup`
compiles, from the same assembly (engine/assembly.py: one program per step shape, decode rows x
prefill tokens x table width, and the scoring variants); `compile_programs` compiles them for a
target (`targets.py`), `COMPILE_WORKERS` at a time, and `neediest` picks, by shape, those that
need the most memory. compile_plan.py sizes the KV pool from them.

A vision-language model's image encoder is a program too (`encoder_program`).

With a host tier (`kv_offload_gib`) the page-copy programs (engine/host_kv.py) are programs too:
each holds a batch of pages on the device on its way to or from pinned host memory, beside the
weights and the cache, which it does not take (`resident_bytes` counts them in its need).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Callable, Collection

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxserve.batching.plan import StepKind
from jaxserve.compiling import targets
from jaxserve.config import AttentionBackend, EngineConfig, ModelConfig, Quantization
from jaxserve.engine import adapters, assembly, host_kv, images, placement, weight_update
from jaxserve.engine.resolve import EngineSpec, engine_config_for
from jaxserve.engine.step_shapes import StepShape
from jaxserve.model import quant
from jaxserve.model.families import model_class
from jaxserve.planning import capacity

_KERNELS = {targets.Platform.TPU: AttentionBackend.PALLAS_TPU,
            targets.Platform.CUDA: AttentionBackend.PALLAS_GPU}
# Programs compiling at once: XLA compiles without the GIL, one core a program (a v5e step of
# Qwen2.5-0.5B: ~20 s of one core), so each core takes one.
COMPILE_WORKERS = min(4, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class Program:
  """One warm-up program (assembly.Program, or a host tier's page copy) on abstract arguments,
  as targets.lower takes it."""
  name: str
  shape: StepShape | host_kv.CopyShape
  kind: StepKind | None  # A step's; None: a page copy.
  fn: Callable
  args: tuple  # Pytrees of ShapeDtypeStructs.
  donate: tuple[int, ...] = ()
  shardings: tuple | None = None  # Over a mesh (tp > 1): each argument's, and the results'.
  out_shardings: Any = None
  # Device bytes the engine holds beside the program's arguments while it runs (a copy's: the
  # weights, the decode state and the cache's other groups).
  resident_bytes: int = 0
  keep_unused: bool = False  # The weight update's: its old weights, unread, are donated.

  def lowering(self, device) -> Callable:
    """The program's lowering for `device` (targets.compile_reports runs it)."""
    return functools.partial(targets.lower, self.fn, self.args, device, donate=self.donate,
                             shardings=self.shardings, out_shardings=self.out_shardings,
                             keep_unused=self.keep_unused)


def _i32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.int32)


def abstract_weights(model: ModelConfig, dtype: str,
                     quantization: Quantization = Quantization.NONE):
  """(graphdef, params) of the model with ShapeDtypeStruct leaves: no weight is ever made. The
  weights stored as `quantization` has them (quant.layouts_for)."""
  abstract = nnx.eval_shape(lambda: model_class(model)(
      model, jnp.dtype(dtype), rngs=nnx.Rngs(0), quant_layouts=quant.layouts_for(quantization)))
  return nnx.split(abstract)


def engine_programs(model: ModelConfig, config: EngineConfig, backend: AttentionBackend,
                    num_stop_ids: int = 1, devices=None) -> list[Program]:
  """The programs `Engine.warmup` compiles (assembly.programs(), from the same assembly), on
  abstract arguments. With tp or ep > 1, over a `model` (and `expert`) mesh of `devices`
  (abstract ones), the arrays placed as the engine places them."""
  if config.dp > 1:
    raise ValueError("compiling for a target covers tensor parallelism (--tp) only, not --dp")
  config = engine_config_for(config, backend)
  graphdef, params = abstract_weights(model, config.dtype.value, config.quantization)
  target = params
  mesh = None
  if config.tp * config.ep > 1:
    mesh = placement.make_mesh(config.tp, 1, devices=list(devices), ep=config.ep)
  spec, draft_graphdef = EngineSpec(config, model, backend, draft_model(config)), None
  if spec.draft is not None:  # Both models' weights, as the engine's steps take them.
    draft_graphdef, draft_params = abstract_weights(spec.draft, config.dtype.value,
                                                    config.quantization)
    params = (params, draft_params)
  asm = assembly.assemble(graphdef, params, spec, mesh, draft_graphdef)
  if spec.adapter_slots:  # The adapter slots, as the engine's steps take them (adapters.py).
    params = (params, adapters.abstract_weights(model, spec.adapter_slots))
  stop_ids = _i32(num_stop_ids)  # [E]: the tokenizer's stop ids; E sets no memory.
  abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  steps = [Program(p.name, p.shape, p.kind, asm.step,
                   (params, asm.cache, asm.state, abstract(p.args), stop_ids), assembly.DONATE,
                   asm.arg_shardings(p.args), asm.out_shardings(p.kind))
           for p in asm.programs()]
  steps += update_program(graphdef, target, asm) + encoder_program(graphdef, target, asm)
  if not config.kv_offload_gib:
    return steps
  return steps + copy_programs(asm, steps[0], devices[0] if devices else jax.devices()[0])


UPDATE = "update weights"


def update_program(graphdef, params, asm: assembly.Assembly) -> list[Program]:
  """Engine.update_weights' program (engine/weight_update.py) for a trainer's float32 weights
  placed as the engine's (the target's `graphdef` and `params`), the cache and decode state held
  beside it; none where the engine takes such weights as they are (float32 ones)."""
  s, draft = asm.shardings, asm.spec.draft is not None
  updater = weight_update.WeightUpdate(nnx.merge(graphdef, params), False, False)
  built = updater.abstract_program(params, None if s is None else
                                   s.params[0] if draft else s.params)
  if built is None:
    return []
  fn, args, shardings, out = built
  resident = _device_bytes([asm.cache, asm.state], None if s is None else [s.cache, s.state])
  return [Program(UPDATE, None, None, fn, args, (0,), shardings, out, resident, True)]


ENCODE = "encode image"


def encoder_program(graphdef, params, asm: assembly.Assembly) -> list[Program]:
  """A vision-language model's image encoder (engine/images.py: Gemma 3's one image shape, or
  each of Qwen2.5-VL's patch buckets), the cache and decode state held beside it; none for a
  text-only model."""
  vision = asm.spec.model.vision
  if vision is None:
    return []
  s, draft = asm.shardings, asm.spec.draft is not None
  shapes = images.input_shapes(vision)
  resident = _device_bytes([asm.cache, asm.state], None if s is None else [s.cache, s.state])
  programs = []
  for inputs in shapes:
    shardings = out = None
    if s is not None:
      shardings = (s.params[0] if draft else s.params, *[s.replicated] * len(inputs))
      out = s.replicated
    name = ENCODE if len(shapes) == 1 else f"{ENCODE} ({inputs[0].shape[0]} patches)"
    programs.append(Program(name, None, None, functools.partial(images.encode, graphdef),
                            (params, *inputs), shardings=shardings, out_shardings=out,
                            resident_bytes=resident))
  return programs


def copy_programs(asm: assembly.Assembly, step: Program, device) -> list[Program]:
  """The host tier's page copies (host_kv.abstract_copies: what HostKV.warmup compiles), on
  `device` or over the steps' mesh; each holds what `step` takes but its own step arguments and
  the copy's page group."""
  s = asm.shardings
  shardings = (s.cache if s is not None
               else jax.tree.map(lambda _: SingleDeviceSharding(device), asm.cache))
  held = [0, 1, 2, 4]  # Of (params, cache, state, args, stop ids): all but the step's own.
  resident = _device_bytes([step.args[i] for i in held],
                           None if step.shardings is None else [step.shardings[i] for i in held])
  return [Program(shape.name, shape, None, copy.fn, args, copy.donate, placed,
                  copy.out_shardings, resident_bytes=resident - _device_bytes(args[0], placed[0]))
          for shape, copy, args, placed in host_kv.abstract_copies(
              asm.cache, shardings, asm.spec.config.max_pages_per_seq)]


def _device_bytes(tree, shardings=None) -> int:
  """Bytes of `tree`'s arrays on one device: each one's shard under `shardings` (None: whole)."""
  if shardings is None:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  return sum(jax.tree.leaves(jax.tree.map(
      lambda x, sh: math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize, tree, shardings)))


def draft_model(config: EngineConfig) -> ModelConfig | None:
  """The speculative draft model's config (method "draft": a known name, a config.json or a
  checkpoint directory, as `plan --model` takes), or None."""
  spec = config.speculative
  if spec is None or spec.method != "draft":
    return None
  return capacity.load_model_config(spec.draft_model)


def need_bytes(report: dict[str, Any]) -> int:
  """What a compiled program holds at its peak: its arguments, its temp, and its outputs less
  those written into donated inputs (device memory: host memory's are counted apart), with what
  the engine holds beside it (`resident_bytes`)."""
  r = report
  return (r.get("resident_bytes", 0) + r["argument_bytes"] + r["temp_bytes"] + r["output_bytes"]
          - r["alias_bytes"])


def compile_programs(target: str, model: ModelConfig, config: EngineConfig,
                     only: str | Collection[str] | Callable | None = None,
                     workers: int = COMPILE_WORKERS) -> list[dict[str, Any]]:
  """The reports of every warm-up program (or of the one named `only`, of those named in it, or of
  those it names when called with the programs) compiled for `target`, in warm-up order,
  `workers` compiles at a time."""
  devices, programs = target_programs(target, model, config)
  names = {only} if isinstance(only, str) else only(programs) if callable(only) else only
  chosen = [p for p in programs if names is None or p.name in names]
  reports = targets.compile_reports([(p.name, p.lowering(devices[0])) for p in chosen], workers)
  return [{**r, "resident_bytes": p.resident_bytes} for p, r in zip(chosen, reports)]


def target_programs(target: str, model: ModelConfig, config: EngineConfig):
  """(the target's compile-only devices, the warm-up programs for them: engine_programs with
  the target's kernels unless the config names a backend)."""
  devices = targets.abstract_devices(target)
  if config.tp * config.ep > len(devices):
    raise ValueError(f"--tp {config.tp} x --ep {config.ep}: {target}'s compile-only topology has "
                     f"{len(devices)} chips")
  backend = config.attention_backend or _KERNELS[targets.TARGETS[target].platform]
  return devices, engine_programs(model, config, backend, devices=devices)


def neediest(programs: list[Program]) -> list[str]:
  """The names of the programs that need the most memory, picked by shape, without compiling:
  of each kind (decode-only, prefill-only, mixed, scoring; a group's saves, its loads), the one
  of the most decode rows and prefill tokens (a step's activations grow with its rows, and every
  step holds the same weights and cache), or of the most pages (a copy holds its batch)."""
  largest: dict[tuple, tuple[Any, Program]] = {}
  for p in programs:
    kind, size = _kind_and_size(p)
    if kind not in largest or size >= largest[kind][0]:
      largest[kind] = (size, p)
  return [p.name for _, p in largest.values()]


def _kind_and_size(p: Program) -> tuple[tuple, Any]:
  if p.name in (UPDATE, ENCODE):
    return (p.name,), 0
  if isinstance(p.shape, host_kv.CopyShape):
    return ("copy", p.shape.load, p.shape.group), p.shape.pages
  return (p.kind, p.shape.decode_rows > 0, p.shape.prefill_tokens > 0), p.shape[:2]

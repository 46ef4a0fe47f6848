"""The engine's step programs, assembled once: what `Engine` jits and warms up, and what
`plan --compile` (compiling/programs.py) compiles for a chip this machine does not have.

`assemble` takes the model's graphdef and params (arrays, or ShapeDtypeStructs) and returns an
`Assembly`: the step function (engine/step.py bound to the graphdef and the attention backend),
what its calls donate and where their results live, where each argument lives over a mesh (and
`place`, which puts the engine's arrays there), the Packer, and `programs()`: every program
warm-up compiles, in order. `Engine` runs those programs on padding; compiling/programs.py
lowers the same ones on abstract arguments, so the two cannot drift.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.batching.plan import StepKind
from jaxserve.engine import adapters, kv_spec, placement
from jaxserve.engine.draft import check_draft, create_cache
from jaxserve.engine.resolve import EngineSpec
from jaxserve.engine.step import DecodeState, StepOutput, step
from jaxserve.engine.step_args import Packer, StepArgs
from jaxserve.engine.step_shapes import StepShape
from jaxserve.model.attention import AttentionSpec

# The cache and the decode state: every step updates them in place.
DONATE = (1, 2)


@dataclasses.dataclass(frozen=True)
class Program:
  """One program warm-up compiles: a step kind and shape, and the padding arguments (numpy) it
  runs on."""

  name: str  # "step Bd=.. Tp=.. W=..", then the kind's name (" scoring"...) but for PLAIN.
  shape: StepShape
  kind: StepKind
  args: StepArgs


def program_name(shape: StepShape, kind: StepKind = StepKind.PLAIN) -> str:
  Bd, Tp, W = shape
  return f"step Bd={Bd} Tp={Tp} W={W}" + ("" if kind is StepKind.PLAIN else f" {kind.value}")


@dataclasses.dataclass(frozen=True)
class Assembly:
  """The engine's steps for one EngineSpec (see the module docstring)."""

  spec: EngineSpec
  step: Callable  # (params, cache, state, args, stop_ids) -> (cache, state, out[, prompt])
  packer: Packer
  cache: Any  # The KV cache's ShapeDtypeStructs (a KVCache).
  state: DecodeState  # The decode state's ShapeDtypeStructs.
  shardings: placement.EngineShardings | None  # Over a mesh; None on one device.

  def out_shardings(self, kind: StepKind):
    """Where a `kind` step's results live: (cache, state, StepOutput); None on one device."""
    s = self.shardings
    if s is None:
      return None
    cache, state, sampled = s.step_out
    of = lambda k: s.replicated if kind is k else None
    return cache, state, StepOutput(sampled, of(StepKind.SCORING), of(StepKind.VERIFYING),
                                    of(StepKind.POOLING))

  def jit(self, kind: StepKind):
    """The `kind` step as the engine calls it: donating the cache and the decode state, and
    returning them where they live, so no call copies them or recompiles."""
    out = self.out_shardings(kind)
    placed = {} if out is None else {"out_shardings": out}
    return jax.jit(self.step, donate_argnums=DONATE, **placed)

  def arg_shardings(self, args: StepArgs) -> tuple | None:
    """Each argument's shardings over the mesh (params, cache, state, args, stop ids): the step
    arguments and stop ids replicated. None on one device."""
    s = self.shardings
    if s is None:
      return None
    params, slots = s.params, self.spec.adapter_slots
    if slots is not None:  # The adapter slots beside the weights (engine/adapters.py).
      params = (params, placement.lora_shardings(
          s.mesh, adapters.abstract_weights(self.spec.model, slots)))
    return (params, s.cache, s.state, jax.tree.map(lambda _: s.replicated, args), s.replicated)

  def place(self, params, stop_ids: Sequence[int]) -> tuple:
    """(params, cache, state, stop ids [E]): the engine's arrays where the steps take them, the
    cache and a fresh decode state made here. Over a mesh each goes to its shardings (the cache
    allocated shard by shard: it may fit no one device), which the steps return them in, so
    donation aliases the buffers. On one device the cache and state are committed to it, as
    every step's outputs are: an uncommitted first input would make the first program warm-up
    compiles a different one from the one serving calls."""
    model, config = self.spec.model, self.spec.config
    state = DecodeState.create(config.num_slots, model.vocab_size)
    stop_ids = jnp.asarray(sorted(stop_ids) or [0], jnp.int32)
    s = self.shardings
    if s is not None:
      return (s.place(params, s.params), self.new_cache(), s.place(state, s.state),
              s.place(stop_ids, s.replicated))
    return params, self.new_cache(), jax.device_put(state, jax.local_devices()[0]), stop_ids

  def new_cache(self):
    """A zeroed KV cache where the steps take it (`place`'s, and the engine's on waking)."""
    model, config, s = self.spec.model, self.spec.config, self.shardings
    if s is not None:
      return s.create_cache(model, config)
    return jax.device_put(create_cache(model, config, self.spec.draft), jax.local_devices()[0])

  def programs(self) -> list[Program]:
    """Every program warm-up compiles, in order: a plain one per step shape (Packer.shapes),
    then the scoring kind of the prefill-only ones (Packer.scored_shapes), then the verifying
    kind of those with prefill (Packer.verified_shapes, with speculation), then the pooling
    kind of the prefill-only ones (Packer.pooled_shapes, with EngineConfig.pooling)."""
    p = self.packer
    kinds = ((StepKind.PLAIN, p.shapes()), (StepKind.SCORING, p.scored_shapes()),
             (StepKind.VERIFYING, p.verified_shapes()), (StepKind.POOLING, p.pooled_shapes()))
    return [Program(program_name(shape, kind), shape, kind, p.template(shape, kind))
            for kind, shapes in kinds for shape in shapes]


def assemble(graphdef, params, spec: EngineSpec, mesh: Mesh | None = None,
             draft_graphdef=None) -> Assembly:
  """The engine's steps for `spec` (engine/resolve.py, its config with its num_pages); `mesh`:
  the tensor-parallel mesh, or None on one device. `draft_graphdef`: the speculative draft
  model's (method "draft", spec.draft its config): `params` is then (the target's, the
  draft's)."""
  model, config, backend = spec.model, spec.config, spec.backend
  check_draft(config, model, spec.draft)
  cache = jax.eval_shape(lambda: create_cache(model, config, spec.draft))
  state = jax.eval_shape(lambda: DecodeState.create(config.num_slots, model.vocab_size))
  shardings = None
  if mesh is not None:
    shardings = placement.EngineShardings.create(mesh, model, config, params, state)
  packer = Packer(config, model.vocab_size, kv_spec.slot_page_tables(config), cache.num_groups,
                  image_dim=model.dim if model.vision is not None else 0,
                  merge_size=model.vision.merge_size if model.mrope_section else 0)
  # With LoRA the params a step takes are (the model's, the adapters': engine/adapters.py).
  fn = functools.partial(step, graphdef, attn=AttentionSpec(backend, mesh), draft=draft_graphdef,
                         lora=config.max_loras > 0, logprobs_mode=config.logprobs_mode)
  return Assembly(spec, fn, packer, cache, state, shardings)

"""The device mesh, and where every array of the engine lives on it (the rules: model/axes.py).

Several hosts run the same program: `init_distributed` joins them with `jax.distributed`, and the
mesh then spans every process's devices (`jax.devices()` is global).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import kv_spec
from jaxserve.model import axes, lora
from jaxserve.model.kv_cache import KVCache, KVPool


def make_mesh(tp: int, dp: int = 1, devices=None, ep: int = 1) -> Mesh:
  """A [dp, tp] mesh over dp * tp devices (of all processes), or [dp, ep, tp] with an `expert`
  axis when ep > 1. Auto axes: XLA's partitioner places the collectives, the code keeps its
  unsharded types."""
  devices = jax.devices() if devices is None else devices
  shape, names = (dp, ep, tp), (axes.DATA, axes.EXPERT, axes.MODEL)
  if ep == 1:
    shape, names = (dp, tp), (axes.DATA, axes.MODEL)
  size, axis_types = tp * dp * ep, (AxisType.Auto,) * len(shape)
  if size == len(devices):  # All of them: jax.make_mesh follows a TPU slice's topology.
    return jax.make_mesh(shape, names, axis_types, devices=devices)
  if size > len(devices):
    raise ValueError(f"tp={tp} x dp={dp} x ep={ep} needs {size} devices; "
                     f"{len(devices)} available")
  # Consecutive devices form a `model` group: on a GPU host those share the fastest links.
  return Mesh(np.asarray(devices[:size]).reshape(shape), names, axis_types=axis_types)


def mesh_for(config: EngineConfig) -> Mesh | None:
  """The engine's mesh, or None on one device (the unsharded path, unchanged)."""
  if config.tp * config.dp * config.ep == 1:
    return None
  return make_mesh(config.tp, config.dp, ep=config.ep)


def init_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None,
                     multihost: bool = False) -> None:
  """Joins the processes of a multi-host job; call it before anything touches a device.
  Neither a coordinator nor `multihost` (JAX finds the job by itself): one process, nothing to
  join."""
  if coordinator is None and not multihost:
    return
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id)


def param_shardings(mesh: Mesh, state: nnx.State) -> nnx.State:
  """NamedShardings for a model's parameter state (abstract or concrete), from its axis names."""
  specs = nnx.get_partition_spec(state)
  is_spec = lambda x: isinstance(x, P)
  return jax.tree.map(lambda s, x: NamedSharding(mesh, axes.logical_to_mesh(s, x.shape, mesh)),
                      specs, state, is_leaf=is_spec)


def cache_sharding(mesh: Mesh, cache: KVCache) -> KVCache:
  """By KV head over `model` (and by slot over `data` for a layout with a slot axis), for every
  array of every pool of `cache` (abstract or concrete): values and, when quantized, scales."""
  def pool(p: KVPool) -> KVPool:
    spec = axes.cache_spec(p.axes)
    return jax.tree.map(lambda _: NamedSharding(mesh, spec), p)
  return cache.map_pools(pool)


def slots_sharding(mesh: Mesh, tree):
  """Every leaf of a per-slot pytree (DecodeState: [Bs, ...] leaves) split by slot over `data`."""
  return jax.tree.map(lambda _: NamedSharding(mesh, P(axes.RULES["slots"])), tree)


# LoRA targets whose base weight splits its output over `model` (the adapter's B splits by
# column, A is whole on each device) and those that split their input (A by row, B whole), as
# model/llama.py's projections do; a width that does not divide stays whole.
_ROW_PARALLEL = ("wo", "w_down")


def lora_shardings(mesh: Mesh, shapes: lora.LoraWeights):
  """model.lora.LoraWeights of NamedShardings for the slots `shapes` (engine/adapters.py's
  abstract_weights): A [L, Sl, I, R] and B [L, Sl, R, O] per target."""
  tp = mesh.shape[axes.MODEL]

  def split(x, axis: int | None):
    spec = [None] * x.ndim
    if axis is not None and x.shape[axis] % tp == 0:
      spec[axis] = axes.MODEL
    return NamedSharding(mesh, P(*spec))
  return lora.LoraWeights(
      {t: split(x, 2 if t in _ROW_PARALLEL else None) for t, x in shapes.a.items()},
      {t: split(x, None if t in _ROW_PARALLEL else 3) for t, x in shapes.b.items()})


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def put_numpy(x, sharding: jax.sharding.Sharding, dtype) -> jax.Array:
  """Host array -> global array, each device receiving only its own slice (cast slice by slice,
  so neither a full device copy nor a full cast copy of the weight is ever made)."""
  x = np.asarray(x) if not isinstance(x, np.ndarray) else x
  return jax.make_array_from_callback(x.shape, sharding, lambda index: np.asarray(x[index], dtype))


@dataclasses.dataclass(frozen=True)
class EngineShardings:
  """Where the engine's device state lives, and what its compiled steps return."""

  mesh: Mesh
  params: nnx.State
  cache: KVCache
  state: object  # DecodeState of NamedShardings.
  replicated: NamedSharding

  @classmethod
  def create(cls, mesh: Mesh, cfg: ModelConfig, config: EngineConfig, params: nnx.State,
             decode_state) -> EngineShardings:
    axes.check_divisible(cfg, mesh.shape[axes.MODEL], mesh.shape[axes.DATA], config.num_slots,
                         mesh.shape.get(axes.EXPERT, 1))
    cache = jax.eval_shape(lambda: kv_spec.create(cfg, config))
    return cls(mesh, param_shardings(mesh, params), cache_sharding(mesh, cache),
               slots_sharding(mesh, decode_state), replicated(mesh))

  @property
  def step_out(self):
    """(cache, state, sampled) of prefill and decode: sampled tokens replicated, so every
    process of a multi-host mesh can read them."""
    return (self.cache, self.state, self.replicated)

  @staticmethod
  def place(tree, shardings):
    """Each leaf onto its sharding. A leaf placed elsewhere goes through the host and
    `make_array_from_callback`, which works when the mesh spans several processes."""
    def one(x, s):
      if isinstance(x, jax.Array) and x.sharding == s:
        return x
      return put_numpy(np.asarray(x), s, x.dtype)
    if isinstance(shardings, NamedSharding):
      return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)

  def create_cache(self, model_cfg: ModelConfig, config: EngineConfig) -> KVCache:
    """The cache allocated shard by shard: the whole cache may not fit on any one device."""
    return jax.jit(lambda: kv_spec.create(model_cfg, config), out_shardings=self.cache)()

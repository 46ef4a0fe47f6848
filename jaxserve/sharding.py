"""Tensor and data parallelism: a device mesh, and where every array of the engine lives on it.

The mesh has two axes, `data` (dp) and `model` (tp). Weights are split Megatron-style over
`model`: attention by heads (wq/wk/wv by output head, wo by input head) and the MLP by its hidden
columns (w_gate/w_up by column, w_down by row), so each layer needs one all-reduce after attention
and one after the MLP; the embedding (and tied head) is split by vocabulary. The KV cache is split
by KV head over `model`, so each device holds only the K/V of its own heads. Decode slots are split
over `data`. Everything else is replicated, and XLA's SPMD partitioner inserts the collectives.

Several hosts run the same program: `init_distributed` joins them with `jax.distributed`, and the
mesh then spans every process's devices (`jax.devices()` is global).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.kv_cache import KVCache

DATA, MODEL = "data", "model"

# Logical axis name (model.py, kv_cache.py) -> mesh axis. Absent names are replicated.
RULES = types.MappingProxyType({
    "heads": MODEL, "kv_heads": MODEL, "mlp": MODEL, "vocab": MODEL, "slots": DATA})

# Axes that must divide evenly: splitting heads unevenly would split a GQA group across devices.
# The vocabulary falls back to replicated instead (an odd vocab size is common: 32001, 50257).
_MUST_DIVIDE = ("kv_heads", "heads", "mlp")


def make_mesh(tp: int, dp: int = 1, devices=None) -> Mesh:
  """A [dp, tp] mesh over dp * tp devices (of all processes). Auto axes: XLA's partitioner
  places the collectives, the code keeps its unsharded types."""
  devices = jax.devices() if devices is None else devices
  axis_types = (AxisType.Auto, AxisType.Auto)
  if tp * dp == len(devices):  # All of them: jax.make_mesh follows a TPU slice's topology.
    return jax.make_mesh((dp, tp), (DATA, MODEL), axis_types, devices=devices)
  if tp * dp > len(devices):
    raise ValueError(f"tp={tp} x dp={dp} needs {tp * dp} devices; {len(devices)} available")
  # Consecutive devices form a `model` group: on a GPU host those share the fastest links.
  return Mesh(np.asarray(devices[:tp * dp]).reshape(dp, tp), (DATA, MODEL), axis_types=axis_types)


def mesh_for(config: EngineConfig) -> Mesh | None:
  """The engine's mesh, or None on one device (the unsharded path, unchanged)."""
  return make_mesh(config.tp, config.dp) if config.tp * config.dp > 1 else None


def check_divisible(cfg: ModelConfig, tp: int, dp: int, num_slots: int) -> None:
  """Raises ValueError, naming the flag to change, when the model cannot be split this way."""
  sizes = {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "mlp": cfg.hidden_dim}
  for name in _MUST_DIVIDE:
    if sizes[name] % tp:
      divisors = [d for d in range(1, cfg.num_kv_heads + 1)
                  if not (cfg.num_heads % d or cfg.num_kv_heads % d or cfg.hidden_dim % d)]
      raise ValueError(f"--tp {tp} does not divide {cfg.name}'s {sizes[name]} {name}; "
                       f"tensor parallelism splits whole heads, so tp must be one of {divisors}")
  if num_slots % dp:
    raise ValueError(f"--dp {dp} does not divide the {num_slots} decode slots")


def logical_to_mesh(spec: P, shape, mesh: Mesh) -> P:
  """P('layers', 'embed', 'heads', ...) -> P(None, None, 'model', ...), by RULES."""
  axes = []
  for name, size in zip(spec, shape):
    axis = RULES.get(name)
    if axis is not None and size % mesh.shape[axis]:
      if name in _MUST_DIVIDE:
        raise ValueError(f"axis {name!r} of size {size} does not split over {mesh.shape[axis]} devices")
      axis = None
    axes.append(axis)
  return P(*axes)


def param_shardings(mesh: Mesh, state: nnx.State) -> nnx.State:
  """NamedShardings for a model's parameter state (abstract or concrete), from its axis names."""
  specs = nnx.get_partition_spec(state)
  is_spec = lambda x: isinstance(x, P)
  return jax.tree.map(lambda s, x: NamedSharding(mesh, logical_to_mesh(s, x.shape, mesh)),
                      specs, state, is_leaf=is_spec)


def _cache_axes(cache: KVCache) -> tuple[str, ...]:
  return getattr(cache, "axes", KVCache.AXES)  # The running layout's names, where it has one.


def cache_sharding(mesh: Mesh, cache: KVCache) -> KVCache:
  """By KV head over `model` (and by slot over `data` for a layout with a slot axis), for every
  array of `cache` (abstract or concrete): values and, when quantized, their scales."""
  spec = P(*(RULES.get(name) for name in _cache_axes(cache)))
  return jax.tree.map(lambda _: NamedSharding(mesh, spec), cache)


def slots_sharding(mesh: Mesh, tree):
  """Every leaf of a per-slot pytree (DecodeState: [S, ...] leaves) split by slot over `data`."""
  return jax.tree.map(lambda _: NamedSharding(mesh, P(RULES["slots"])), tree)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def put_numpy(x, sharding: NamedSharding, dtype) -> jax.Array:
  """Host array -> global array, each device receiving only its own slice (cast slice by slice,
  so neither a full device copy nor a full cast copy of the weight is ever made)."""
  x = np.asarray(x) if not isinstance(x, np.ndarray) else x
  return jax.make_array_from_callback(x.shape, sharding, lambda index: np.asarray(x[index], dtype))


def build_sharded_model(cfg: ModelConfig, params: dict, dtype: str, mesh: Mesh):
  """Like checkpoint.build_model, but every weight goes straight to its shards on `mesh`."""
  from jaxserve.checkpoint import model_class  # It imports the models; keep this module light.

  abstract = nnx.eval_shape(lambda: model_class(cfg)(cfg, jnp.dtype(dtype), rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  shardings = nnx.to_pure_dict(param_shardings(mesh, state))
  placed = jax.tree.map(lambda x, s: put_numpy(x, s, jnp.dtype(dtype)), params, shardings)
  nnx.replace_by_pure_dict(state, placed)
  return nnx.merge(graphdef, state)


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
    check_divisible(cfg, mesh.shape[MODEL], mesh.shape[DATA], config.num_slots)
    cache = jax.eval_shape(lambda: KVCache.create(cfg, config))
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

  def in_mesh(self, step):
    """`step` called with the mesh set, so that `attend_per_shard` finds it while tracing."""
    @functools.wraps(step)
    def call(*args):
      with jax.set_mesh(self.mesh):
        return step(*args)
    return call

  def create_cache(self, model_cfg: ModelConfig, config: EngineConfig) -> KVCache:
    """The cache allocated shard by shard: the whole cache may not fit on any one device."""
    return jax.jit(lambda: KVCache.create(model_cfg, config), out_shardings=self.cache)()


def attend_per_shard(attend, q, cache: KVCache, layer, meta):
  """`attend(q, cache, layer, meta)` -> [B, T, N, H], run once per device on its own heads (and
  slots, when B splits over `data`) under shard_map. For the Pallas kernels, which XLA cannot
  partition: left to GSPMD they would be run whole, on gathered copies of the cache.

  The mesh is the one set with `jax.set_mesh` while the step is traced; none set: a plain call.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or MODEL not in mesh.axis_names:
    return attend(q, cache, layer, meta)
  batch = DATA if q.shape[0] % mesh.shape[DATA] == 0 else None  # Prefill's B=1 stays whole.
  heads = P(batch, None, MODEL, None)  # [B, T, N, H]: a device's query heads use its KV heads.
  # Only the KV-head split: block tables name pages of the whole cache, so each device needs
  # every page (of its own heads).
  kv = P(*(MODEL if RULES.get(name) == MODEL else None for name in _cache_axes(cache)))
  in_specs = (heads, jax.tree.map(lambda _: kv, cache), P(),
              jax.tree.map(lambda _: P(batch), meta))  # Every metadata field is [B, ...].
  return jax.shard_map(attend, mesh=mesh, in_specs=in_specs, out_specs=heads,
                       check_vma=False)(q, cache, layer, meta)


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
  """--tp/--dp, and the flags that join several hosts into one mesh."""
  g = parser.add_argument_group("parallelism")
  g.add_argument("--tp", type=int, default=1, help="tensor parallel: devices each model is split over")
  g.add_argument("--dp", type=int, default=1, help="data parallel: groups the decode slots are split over")
  g.add_argument("--multihost", action="store_true",
                 help="join the other hosts of a TPU slice or SLURM job, which JAX finds by itself")
  g.add_argument("--coordinator", default=None,
                 help="host:port of process 0, on several hosts (same command on every host)")
  g.add_argument("--num-processes", type=int, default=None, help="hosts (processes) in the job")
  g.add_argument("--process-id", type=int, default=None, help="this host's index, 0..num-processes-1")


def init_distributed(args: argparse.Namespace) -> None:
  """Joins the processes of a multi-host job; call it before anything touches a device.
  Neither --coordinator nor --multihost: one process, nothing to join."""
  if args.coordinator is None and not args.multihost:
    return
  jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                             process_id=args.process_id)

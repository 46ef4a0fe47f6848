"""The engine's LoRA adapters: the stacked device arrays (model/lora.py LoraWeights), a host
copy of every adapter added, and the one compiled write that puts a host copy into a slot.

Which adapter sits in which slot is the scheduler's choice (batching/lora_slots.py): a plan
names the (slot, adapter) pairs to write before it runs (StepPlan.lora_loads). The write is
dispatched in order with the steps, so a step already queued reads the slot's old adapter and
the next one the new.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.config.lora import target_dims
from jaxserve.engine import placement
from jaxserve.model import lora


def abstract_weights(cfg: ModelConfig, config: EngineConfig) -> lora.LoraWeights:
  """The adapter slots' ShapeDtypeStructs (`plan --compile` compiles the steps on them)."""
  return jax.eval_shape(lambda: lora.LoraWeights.create(
      cfg, config.max_loras + 1, config.max_lora_rank, jnp.dtype(config.dtype.value)))


def check_model(model, config: EngineConfig) -> None:
  """With LoRA on, raises ValueError unless `model` runs adapters: the Llama block with a dense
  MLP, on one process."""
  from jaxserve.model.llama import Transformer

  if not config.max_loras:
    return
  if not isinstance(model, Transformer) or model.cfg.num_experts:
    raise ValueError(f"LoRA adapters run on the dense Llama-family models (Llama, Qwen2, "
                     f"Qwen3, Mistral), not on {model.cfg.family.value}")
  if jax.process_count() > 1:
    raise ValueError("LoRA adapters do not run on more than one process yet")


class DeviceLoras:
  """Slots 0..max_loras of adapters on one device (slot 0: the base model, always zeros)."""

  @classmethod
  def of(cls, cfg: ModelConfig, config: EngineConfig, mesh: Mesh | None) -> DeviceLoras | None:
    """The engine's adapters on its device or over its tensor-parallel `mesh`, or None: LoRA is
    off."""
    return cls(cfg, config, mesh) if config.max_loras else None

  def __init__(self, cfg: ModelConfig, config: EngineConfig, mesh: Mesh | None):
    self.rank = config.max_lora_rank
    self.dtype = jnp.dtype(config.dtype.value)
    self._dims = target_dims(cfg)
    self._num_layers = cfg.num_layers
    # Committed where the steps read them, as every write's output is: one program for both.
    place = (jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if mesh is None else
             placement.lora_shardings(mesh, abstract_weights(cfg, config)))
    create = lambda: lora.LoraWeights.create(cfg, config.max_loras + 1, self.rank, self.dtype)
    self.weights = jax.jit(create, out_shardings=place)()
    self._write = jax.jit(lora.write, donate_argnums=0, out_shardings=place)
    self._host: dict[int, tuple[dict, dict]] = {}

  def add(self, lora_id: int, adapter) -> None:
    """adapter: loading.lora.LoraAdapter; padded to the slots' rank, in the engine's dtype."""
    if adapter.rank > self.rank:
      raise ValueError(f"a LoRA adapter of rank {adapter.rank}: max_lora_rank is {self.rank}")
    a, b = self._zeros()
    for target, (a_LIr, b_LrO) in adapter.weights.items():
      r = a_LIr.shape[-1]
      a[target][..., :r] = a_LIr
      b[target][:, :r] = b_LrO
    self._host[lora_id] = (a, b)

  def remove(self, lora_id: int) -> None:
    self._host.pop(lora_id, None)

  def load(self, slot: int, lora_id: int) -> None:
    """Writes adapter `lora_id`'s host copy into `slot` (after every step dispatched so far)."""
    if lora_id not in self._host:
      raise ValueError(f"LoRA adapter id {lora_id} was not added to the engine")
    self.weights = self._write(self.weights, np.int32(slot), *self._host[lora_id])

  def warmup(self) -> None:
    """Compiles the write (zeros into slot 0, which holds zeros)."""
    self.weights = self._write(self.weights, np.int32(0), *self._zeros())

  def _zeros(self) -> tuple[dict, dict]:
    L, R = self._num_layers, self.rank
    return ({t: np.zeros((L, I, R), self.dtype) for t, (I, O) in self._dims.items()},
            {t: np.zeros((L, R, O), self.dtype) for t, (I, O) in self._dims.items()})

"""The engine's LoRA adapters: the stacked device arrays (model/lora.py LoraWeights), a host
copy of every adapter added, and the one compiled write that puts a host copy into a slot.

Which adapter sits in which slot is the scheduler's choice (batching/lora_slots.py): a plan
names the (slot, adapter) pairs to write before it runs (StepPlan.lora_loads). The write is
dispatched in order with the steps, so a step already queued reads the slot's old adapter and
the next one the new.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import ModelConfig
from jaxserve.config.lora import target_dims
from jaxserve.engine import placement
from jaxserve.model import lora


class AdapterSlots(NamedTuple):
  """What sets the adapter slots' arrays (EngineSpec.adapter_slots): how many slots (slot 0 is
  the base model's zeros, then max_loras adapters), their rank, their dtype."""
  num_slots: int
  rank: int
  dtype: str


def abstract_weights(cfg: ModelConfig, slots: AdapterSlots) -> lora.LoraWeights:
  """The adapter slots' ShapeDtypeStructs (`plan --compile` compiles the steps on them)."""
  return jax.eval_shape(lambda: lora.LoraWeights.create(cfg, slots.num_slots, slots.rank,
                                                        jnp.dtype(slots.dtype)))


def check_model(model) -> None:
  """Raises ValueError unless `model` runs adapters: the Llama block with a dense MLP, on one
  process."""
  from jaxserve.model.llama import Transformer

  if not isinstance(model, Transformer) or model.cfg.num_experts:
    raise ValueError(f"LoRA adapters run on the dense Llama-family models (Llama, Qwen2, "
                     f"Qwen3, Mistral), not on {model.cfg.family.value}")
  if jax.process_count() > 1:
    raise ValueError("LoRA adapters do not run on more than one process yet")


class DeviceLoras:
  """Slots 0..max_loras of adapters on one device (slot 0: the base model, always zeros)."""

  @classmethod
  def of(cls, cfg: ModelConfig, slots: AdapterSlots | None,
         mesh: Mesh | None) -> DeviceLoras | None:
    """The engine's adapters on its device or over its tensor-parallel `mesh`, or None (`slots`
    None): LoRA is off."""
    return None if slots is None else cls(cfg, slots, mesh)

  def __init__(self, cfg: ModelConfig, slots: AdapterSlots, mesh: Mesh | None):
    self.rank = slots.rank
    self.dtype = jnp.dtype(slots.dtype)
    self._dims = target_dims(cfg)
    self._num_layers = cfg.num_layers
    # Committed where the steps read them, as every write's output is: one program for both.
    place = (jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if mesh is None else
             placement.lora_shardings(mesh, abstract_weights(cfg, slots)))
    create = lambda: lora.LoraWeights.create(cfg, slots.num_slots, self.rank, self.dtype)
    self.weights = jax.jit(create, out_shardings=place)()
    self._write = jax.jit(lora.write, donate_argnums=0, out_shardings=place)
    # Host copies at each adapter's own rank, one per content (the same files under two names
    # are one copy): adapter id -> its content's key -> (its targets' (A, B), its users).
    self._key_of: dict[int, str] = {}
    self._copies: dict[str, tuple[dict, set[int]]] = {}

  def add(self, lora_id: int, adapter) -> None:
    """adapter: loading.lora.LoraAdapter, kept at its rank in the engine's dtype."""
    if adapter.rank > self.rank:
      raise ValueError(f"a LoRA adapter of rank {adapter.rank}: max_lora_rank is {self.rank}")
    key = adapter.digest or f"id {lora_id}"
    if key not in self._copies:
      self._copies[key] = ({t: (a.astype(self.dtype), b.astype(self.dtype))
                            for t, (a, b) in adapter.weights.items()}, set())
    self._copies[key][1].add(lora_id)
    self._key_of[lora_id] = key

  def remove(self, lora_id: int, slot: int | None = None) -> None:
    """Forgets adapter `lora_id`'s host copy (the last user's drops it) and zeros `slot`, the
    device slot it was in (None: in none), so nothing of it stays on the device."""
    key = self._key_of.pop(lora_id, None)
    if key is not None:
      users = self._copies[key][1]
      users.discard(lora_id)
      if not users:
        del self._copies[key]
    if slot is not None:
      self.weights = self._write(self.weights, np.int32(slot), *self._zeros())

  def replace(self, lora_id: int, adapter, slot: int | None) -> None:
    """Adapter `lora_id`'s host copy replaced by `adapter`'s, and written into `slot`, the
    device slot it sits in (None: none)."""
    if lora_id not in self._key_of:
      raise ValueError(f"LoRA adapter id {lora_id} was not added to the engine")
    if adapter.rank > self.rank:
      raise ValueError(f"a LoRA adapter of rank {adapter.rank}: max_lora_rank is {self.rank}")
    self.remove(lora_id)
    self.add(lora_id, adapter)
    if slot is not None:
      self.load(slot, lora_id)

  @property
  def num_host_copies(self) -> int:
    return len(self._copies)

  def load(self, slot: int, lora_id: int) -> None:
    """Writes adapter `lora_id`'s host copy into `slot` (after every step dispatched so far),
    zero-padded to the slots' rank."""
    if lora_id not in self._key_of:
      raise ValueError(f"LoRA adapter id {lora_id} was not added to the engine")
    a, b = self._zeros()
    for target, (a_LIr, b_LrO) in self._copies[self._key_of[lora_id]][0].items():
      r = a_LIr.shape[-1]
      a[target][..., :r] = a_LIr
      b[target][:, :r] = b_LrO
    self.weights = self._write(self.weights, np.int32(slot), a, b)

  def warmup(self) -> None:
    """Compiles the write (zeros into slot 0, which holds zeros)."""
    self.weights = self._write(self.weights, np.int32(0), *self._zeros())

  def _zeros(self) -> tuple[dict, dict]:
    L, Rk = self._num_layers, self.rank
    return ({t: np.zeros((L, I, Rk), self.dtype) for t, (I, O) in self._dims.items()},
            {t: np.zeros((L, Rk, O), self.dtype) for t, (I, O) in self._dims.items()})

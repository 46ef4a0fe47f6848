"""LoRA adapters on the device: every target's A and B stacked over adapter slots, and the
delta each token's own adapter adds to a projection of the Llama block (model/llama.py).

Shape letters: the key in jaxserve/model/__init__.py (Sl, Rk, I, O are this module's).

Slot 0 is the base model (zeros: its delta is exactly 0); slots 1..max_loras hold adapters,
each zero-padded to the engine's max_lora_rank, so any mix of adapters runs one program. An
adapter is written into a slot by `write`, the slot a traced index: loading, swapping or
evicting one compiles nothing.

The delta of a step's T tokens: x [T, I] times every slot's A ([T, Sl, Rk]: T * Sl * I * Rk
multiply-adds, small while slots are few), each token's own slot selected by a one-hot mask, then
one dot over (Sl, Rk) against the stacked B, so no [T, I, Rk] copy of anyone's A is gathered. That
dot multiplies every slot's B (by zero where a token's slot is another), so no slot may hold a
non-finite value: the loader refuses them, `write` zeros an adapter that has one, and an unloaded
adapter's slot is zeroed (engine/adapters.py). A grouped
matmul (jax.lax.ragged_dot over the tokens sorted by slot, as moe.py runs the experts) costs
less past a few slots; not measured yet.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.config.lora import target_dims


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeights:
  """Per target (our weight name, config/lora.py TARGETS): A [L, Sl, I, Rk] and B [L, Sl, Rk, O];
  a layer's slice (under the layers' scan) drops the [L]."""

  a: dict[str, jax.Array]
  b: dict[str, jax.Array]

  @classmethod
  def create(cls, cfg: ModelConfig, num_slots: int, rank: int, dtype) -> LoraWeights:
    """Zeros for `num_slots` slots (max_loras + 1: slot 0 is the base model)."""
    L, dims = cfg.num_layers, target_dims(cfg)
    return cls({t: jnp.zeros((L, num_slots, I, rank), dtype) for t, (I, O) in dims.items()},
               {t: jnp.zeros((L, num_slots, rank, O), dtype) for t, (I, O) in dims.items()})


def write(weights: LoraWeights, slot, a: dict, b: dict) -> LoraWeights:
  """`weights` with slot `slot` (an int32 scalar, traced) holding a [L, I, Rk] and b [L, Rk, O]
  per target (every target: zeros where the adapter has none). An adapter with any NaN or Inf
  (which the loader refuses) is written as zeros: the slot's B meets every token's row in the
  delta's contraction, where 0 * NaN would be NaN."""
  finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in [*a.values(), *b.values()]]))
  put = lambda x, new: jax.lax.dynamic_update_slice_in_dim(
      x, jnp.where(finite, new, 0)[:, None].astype(x.dtype), slot, axis=1)
  return LoraWeights({t: put(x, a[t]) for t, x in weights.a.items()},
                     {t: put(x, b[t]) for t, x in weights.b.items()})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraRows:
  """One forward's adapters: the weights (one layer's, [Sl, ...], inside the layers' scan; all
  of them, [L, Sl, ...], outside) and each token's slot as a one-hot mask [T, Sl]."""

  weights: LoraWeights
  onehot: jax.Array  # [T, Sl]

  @classmethod
  def of(cls, weights: LoraWeights, slots_T) -> LoraRows:
    num_slots = next(iter(weights.a.values())).shape[1]
    dtype = next(iter(weights.a.values())).dtype
    return cls(weights, jax.nn.one_hot(slots_T, num_slots, dtype=dtype))

  def at_layer(self, weights: LoraWeights) -> LoraRows:
    return LoraRows(weights, self.onehot)

  def delta(self, target: str, x):
    """x [..., I] (the projection's input, its leading axes the step's T tokens) -> [T, O]:
    each token's adapter's x @ A @ B."""
    a_SIR, b_SRO = self.weights.a[target], self.weights.b[target]
    x_TI = x.reshape(-1, a_SIR.shape[1]).astype(a_SIR.dtype)
    # Selected, not multiplied, by the mask: another slot's NaN or Inf in x @ A stays out of
    # this token's row (0 * NaN is NaN).
    xa_TSR = jnp.where(self.onehot[:, :, None] > 0, jnp.einsum("ti,sir->tsr", x_TI, a_SIR), 0)
    return jnp.einsum("tsr,sro->to", xa_TSR, b_SRO)

  def add(self, target: str, x, y):
    """y, the base projection of x, plus x's delta, in y's shape and dtype."""
    return (y + self.delta(target, x).reshape(y.shape)).astype(y.dtype)

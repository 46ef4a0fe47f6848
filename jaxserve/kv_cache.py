"""The paged KV cache on the device: fixed-shape pages that sequences index through block tables.

Which pages a sequence owns is host state (`kv_blocks.py`); this module holds only the arrays.
Page 0 is a scratch page: padding tokens write their K/V there, and no block table points at it
for a real position.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig, KVLayout, ModelConfig

SCRATCH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: jax.Array  # [L, P, Z, K, H]
  v: jax.Array  # [L, P, Z, K, H]

  # Logical axis names, for sharding the cache by KV head over a mesh.
  AXES = ("layers", "pages", "page_tokens", "kv_heads", "head_dim")

  @classmethod
  def create(cls, model: ModelConfig, engine: EngineConfig) -> KVCache:
    if engine.kv_layout is not KVLayout.PAGED_TOKEN_MAJOR:
      raise ValueError(f"unsupported KV layout {engine.kv_layout}")
    shape = (model.num_layers, engine.num_blocks, engine.block_size, model.num_kv_heads, model.head_dim)
    return cls(k=jnp.zeros(shape, engine.dtype), v=jnp.zeros(shape, engine.dtype))

  @property
  def page_size(self) -> int:
    return self.k.shape[2]

  @property
  def num_bytes(self) -> int:
    return self.k.nbytes + self.v.nbytes

  def write(self, layer, slot_mapping, k, v) -> KVCache:
    """Writes k, v [B, T, K, H] of one layer at flat slots [B, T] (page * Z + offset)."""
    page, offset = slot_mapping // self.page_size, slot_mapping % self.page_size  # [B, T]
    return KVCache(k=self.k.at[layer, page, offset].set(k.astype(self.k.dtype)),
                   v=self.v.at[layer, page, offset].set(v.astype(self.v.dtype)))

  def gather(self, layer, block_tables):
    """The pages of each sequence, flattened: [B, W * Z, K, H] for k and for v."""
    B, W = block_tables.shape
    k = self.k[layer, block_tables]  # [B, W, Z, K, H]
    v = self.v[layer, block_tables]
    return k.reshape(B, W * self.page_size, *k.shape[3:]), v.reshape(B, W * self.page_size, *v.shape[3:])

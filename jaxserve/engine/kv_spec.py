"""The engine's choices for its KV cache, out of its EngineConfig: the storage type, the window
pool's size, the narrow `CacheSpec` that model/kv_cache.py builds the cache from, and the
contiguous layout's own page tables. model/ knows nothing of the EngineConfig.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import Dtype, EngineConfig, KVDtype, KVLayout, ModelConfig
from jaxserve.config.engine import RAGGED_KV_DTYPES, window_pages_per_seq
from jaxserve.model.kv_cache import CacheSpec, KVCache, KVPool


def kv_dtype_of(engine: EngineConfig) -> KVDtype:
  """The engine's KV storage type: its `kv_dtype`, or else its compute dtype."""
  if engine.kv_dtype is not None:
    return engine.kv_dtype
  return KVDtype.BFLOAT16 if engine.dtype is Dtype.BFLOAT16 else KVDtype.FLOAT32


def num_window_pages(model: ModelConfig, engine: EngineConfig) -> int:
  """Pages of the window pool, scratch page 0 included, when the local layers keep only their
  window's pages (engine.window_pages; not the contiguous layout, whose slots own their
  regions); 0 when every layer keeps every page. Each slot holds at most
  `window_pages_per_seq` of them, so the pool never runs out."""
  windowed = engine.window_pages and any(model.local_layers)
  if not windowed or engine.kv_layout is KVLayout.CONTIGUOUS:
    return 0
  per_seq = window_pages_per_seq(model.sliding_window, engine.page_size, engine.prefill_buckets[-1])
  if per_seq >= engine.max_pages_per_seq:  # The window holds the whole context: nothing to free.
    return 0
  return 1 + engine.num_slots * per_seq


def spec_of(model: ModelConfig, engine: EngineConfig) -> CacheSpec:
  """The shapes `engine` gives `model`'s cache. The layout is the engine's once it has picked
  one (resolve.engine_config_for); before that, the token-major one."""
  layout, kv_dtype = engine.kv_layout or KVLayout.PAGED_TOKEN_MAJOR, kv_dtype_of(engine)
  if layout is KVLayout.RAGGED and kv_dtype not in RAGGED_KV_DTYPES:
    raise ValueError(f"the ragged KV layout stores "
                     f"{', '.join(d.label for d in RAGGED_KV_DTYPES)}, not {kv_dtype.label}")
  return CacheSpec(layout, kv_dtype, engine.num_pages, engine.page_size, engine.num_slots,
                   engine.max_pages_per_seq, engine.tp, num_window_pages(model, engine))


def create(model: ModelConfig, engine: EngineConfig) -> KVCache:
  """The engine's cache: one pool, or two when the local layers keep only their window."""
  return KVCache.create(model, spec_of(model, engine))


def create_pool(model: ModelConfig, engine: EngineConfig) -> KVPool:
  """One pool of every layer of `model`, window pages or not (a test's, to write and gather)."""
  return KVPool.create(model, spec_of(model, engine))


def create_one_group(model: ModelConfig, engine: EngineConfig) -> KVCache:
  """A cache of one group, that pool (a draft model's, a full forward's)."""
  return KVCache((create_pool(model, engine),))


def lane_groups(engine: EngineConfig) -> int:
  """The capacity planner's `lane_groups` for this engine's cache: tp for the RAGGED layout
  (its rows are padded per device group), 0 for the token-major ones."""
  layout = engine.kv_layout
  if layout is None:
    raise ValueError("the KV layout is picked with the backend (resolve.engine_config_for)")
  return engine.tp if layout is KVLayout.RAGGED else 0


def slot_page_tables(engine: EngineConfig) -> np.ndarray | None:
  """[Bs, W] host page tables of the contiguous layout (slot s owns pages 1 + s * W + i);
  None for the paged layouts, whose tables come from the page allocator."""
  if engine.kv_layout is not KVLayout.CONTIGUOUS:
    return None
  W = engine.max_pages_per_seq
  return (1 + np.arange(engine.num_slots)[:, None] * W + np.arange(W)[None, :]).astype(np.int32)

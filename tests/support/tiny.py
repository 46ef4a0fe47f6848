"""The tiny random model's configs, a compile counter, and the dense no-reuse forward that paged
runs are checked against. conftest.py builds its fixtures from these."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve import compat
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.model.llama import Transformer

TINY = ModelConfig(vocab_size=128, dim=64, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                   hidden_dim=96, max_seq_len=256, rope_theta=10000.0, name="tiny")
TINY_ENGINE = EngineConfig(num_slots=4, page_size=8, num_pages=48, max_model_len=128,
                           prefill_buckets=(16, 32), compilation_cache_dir=None)


@contextlib.contextmanager
def count_compiles():
  """Counts jit traces and backend compilations while the block runs: {'trace': n, 'compile': m}."""
  counts = {"trace": 0, "compile": 0}
  names = {compat.JAXPR_TRACE_EVENT: "trace", compat.BACKEND_COMPILE_EVENT: "compile"}

  def listener(event, duration, **_):
    if event in names:
      counts[names[event]] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def host_tier_gib(model_cfg: ModelConfig, config: EngineConfig, pages: int) -> float:
  """EngineConfig.kv_offload_gib for a host tier of `pages` pages (config after
  resolve.engine_config_for, which picks the KV layout)."""
  from jaxserve.engine import host_kv, kv_spec

  cache = jax.eval_shape(lambda: kv_spec.create(model_cfg, config))
  return pages * host_kv.page_bytes(cache) / 2**30


def dense_logits(model: Transformer, ids, page_size: int = 16):
  """[len(ids), V] logits of one full forward over `ids` on a fresh cache: the no-reuse reference.

  The ids are padded to a multiple of 64, so calls of different lengths share one compilation;
  causal attention keeps the padding from touching the real positions."""
  n = len(ids)
  padded = -(-n // 64) * 64
  return _dense(model, jnp.asarray(list(ids) + [0] * (padded - n), jnp.int32), page_size)[:n]


def dense_forward(model: Transformer, ids, page_size: int):
  """ids [T] (T a multiple of page_size) -> logits [T, V], on a fresh cache."""
  from jaxserve.engine.kv_spec import create_one_group
  from jaxserve.model.attention import AttentionMetadata

  n = ids.shape[0]
  pages = n // page_size
  engine = EngineConfig(num_slots=1, page_size=page_size, num_pages=pages + 1,
                        max_model_len=pages * page_size, prefill_buckets=(page_size,),
                        dtype=_dtype(model))
  meta = AttentionMetadata.one_sequence(n, page_size)
  logits, _ = model(ids[None], create_one_group(model.cfg, engine), meta, last_only=False)
  return logits[0]


_dense = nnx.jit(dense_forward, static_argnums=(2,))


def _dtype(model: Transformer) -> str:
  return jnp.dtype(model.final_norm[...].dtype).name

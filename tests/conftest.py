"""Shared fixtures: tiny random models for fast tests, the real default model for a few."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
# libtpu (the test extra, for compiling to TPU here) takes a lock per process; tests and their
# subprocesses each load it, and none drives a chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax._src import dispatch

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.model.llama import Transformer

TINY = ModelConfig(vocab_size=128, dim=64, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16,
                   hidden_dim=96, max_seq_len=256, rope_theta=10000.0, name="tiny")
TINY_ENGINE = EngineConfig(num_slots=4, page_size=8, num_pages=48, max_model_len=128,
                           prefill_buckets=(16, 32), compilation_cache_dir=None)


@pytest.fixture(scope="session")
def tiny_model() -> Transformer:
  return Transformer(TINY, rngs=nnx.Rngs(0))


@contextlib.contextmanager
def count_compiles():
  """Counts jit traces and backend compilations while the block runs: {'trace': n, 'compile': m}."""
  counts = {"trace": 0, "compile": 0}
  names = {dispatch.JAXPR_TRACE_EVENT: "trace", dispatch.BACKEND_COMPILE_EVENT: "compile"}

  def listener(event, duration, **_):
    if event in names:
      counts[names[event]] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture(scope="session")
def default_model():
  """The real default model (SmolLM2-135M-Instruct), pulled and converted on first use."""
  from jaxserve.loading import checkpoint
  return checkpoint.load_model(None)


def dense_logits(model: Transformer, ids, page_size: int = 16):
  """[len(ids), V] logits of one full forward over `ids` on a fresh cache: the no-reuse reference.

  The ids are padded to a multiple of 64, so calls of different lengths share one compilation;
  causal attention keeps the padding from touching the real positions."""
  n = len(ids)
  padded = -(-n // 64) * 64
  return _dense(model, jnp.asarray(list(ids) + [0] * (padded - n), jnp.int32), page_size)[:n]


def dense_forward(model: Transformer, ids, page_size: int):
  """ids [T] (T a multiple of page_size) -> logits [T, V], on a fresh cache."""
  from jaxserve.model.attention import AttentionMetadata
  from jaxserve.model.kv_cache import KVCache

  n = ids.shape[0]
  pages = n // page_size
  engine = EngineConfig(num_slots=1, page_size=page_size, num_pages=pages + 1,
                        max_model_len=pages * page_size, prefill_buckets=(page_size,), dtype=_dtype(model))
  meta = AttentionMetadata.one_sequence(n, page_size)
  logits, _ = model(ids[None], KVCache.create(model.cfg, engine), meta, last_only=False)
  return logits[0]


_dense = nnx.jit(dense_forward, static_argnums=(2,))


def _dtype(model: Transformer) -> str:
  return jnp.dtype(model.embed[...].dtype).name


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, default_model):
  """A jaxserve checkpoint of a tiny random model with the default model's tokenizer (49,152
  tokens): real text in and out, compiled in seconds. Load it with `LLM(str(path))`."""
  import dataclasses

  from jaxserve.loading import checkpoint

  cfg = dataclasses.replace(TINY, vocab_size=default_model[1].vocab_size, max_seq_len=512,
                            name="tiny-smollm2-vocab")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  path = tmp_path_factory.mktemp("ckpt") / "tiny"
  checkpoint.save(path, cfg, jax.tree.map(lambda x: x, nnx.to_pure_dict(nnx.state(model))), default_model[1])
  return path

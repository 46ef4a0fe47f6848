"""The model's whole decode and prefill steps, with the Pallas backend, lower for TPU and for CUDA
on this CPU-only machine: the steps hold the kernels as Mosaic / Triton custom calls."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxserve.config import AttentionBackend, EngineConfig, ModelConfig
from jaxserve.engine.decode import DecodeState, decode_step
from jaxserve.engine.prefill import prefill_step
from jaxserve.model.attention import AttentionSpec
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.llama import Transformer

TRITON = "__gpu$xla.gpu.triton"
TARGETS = {AttentionBackend.PALLAS_TPU: ("tpu", "tpu_custom_call"),
           AttentionBackend.PALLAS_GPU: ("cuda", TRITON)}
# SmolLM2's attention shape (GQA 9:3, head_dim 64), two layers.
MODEL = ModelConfig(vocab_size=256, dim=128, num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                    hidden_dim=256, max_seq_len=256)
ENGINE = EngineConfig(num_slots=4, page_size=16, num_pages=32, max_model_len=256, prefill_buckets=(32,))


def export(step, backend, *args):
  platform, _ = TARGETS[backend]
  graphdef, params = nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))
  fn = jax.jit(functools.partial(step, graphdef, attn=AttentionSpec(backend)))
  exported = jax.export.export(fn, platforms=[platform],
                               disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(params, *args)
  return set(re.findall(r"stablehlo\.custom_call @([^\(\s]+)\(", exported.mlir_module()))


@pytest.mark.parametrize("backend", list(TARGETS), ids=lambda b: b.value)
def test_decode_step_lowers_with_the_kernel(backend):
  calls = export(decode_step, backend, KVCache.create(MODEL, ENGINE), DecodeState.create(4, 256),
                 jnp.arange(4, dtype=jnp.int32), jnp.zeros((4, 8), jnp.int32),
                 jnp.full((4, 8), -1, jnp.int32), jnp.array([0]))
  assert TARGETS[backend][1] in calls


@pytest.mark.parametrize("backend", list(TARGETS), ids=lambda b: b.value)
def test_prefill_step_lowers_with_the_kernel(backend):
  i32 = lambda x: jnp.int32(x)
  calls = export(prefill_step, backend, KVCache.create(MODEL, ENGINE), DecodeState.create(4, 256),
                 jnp.zeros(32, jnp.int32), i32(0), i32(20), jnp.zeros(16, jnp.int32), i32(0),
                 jnp.bool_(True), jnp.full((1, 8), -1, jnp.int32), jnp.array([0]))
  assert TARGETS[backend][1] in calls


def test_reference_backend_has_no_kernel():
  """The check can fail: the plain-jnp backend lowers to no kernel custom call."""
  graphdef, params = nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))
  fn = jax.jit(functools.partial(decode_step, graphdef, attn=AttentionSpec(AttentionBackend.REFERENCE)))
  text = jax.export.export(fn, platforms=["tpu"])(
      params, KVCache.create(MODEL, ENGINE), DecodeState.create(4, 256), jnp.arange(4, dtype=jnp.int32),
      jnp.zeros((4, 8), jnp.int32), jnp.full((4, 8), -1, jnp.int32), jnp.array([0])).mlir_module()
  assert "tpu_custom_call" not in text

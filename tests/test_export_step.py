"""The engine's whole step (decode rows, prefill chunks, or both in one call), with the Pallas
backend, lowers for TPU and for CUDA on this CPU-only machine: the step holds the ragged kernel
as a Mosaic / Triton custom call, over the ragged KV layout."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxserve.config import AttentionBackend, EngineConfig, KVLayout, ModelConfig
from jaxserve.engine.kv_spec import create_one_group
from jaxserve.engine.step import DecodeState, step
from jaxserve.engine.step_args import Packer, StepShape
from jaxserve.model.attention import AttentionSpec
from jaxserve.model.llama import Transformer

TRITON = "__gpu$xla.gpu.triton"
TARGETS = {AttentionBackend.PALLAS_TPU: ("tpu", "tpu_custom_call"),
           AttentionBackend.PALLAS_GPU: ("cuda", TRITON)}
# SmolLM2's attention shape (GQA 9:3, head_dim 64), two layers.
MODEL = ModelConfig(vocab_size=256, dim=128, num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                    hidden_dim=256, max_seq_len=256)
ENGINE = EngineConfig(num_slots=4, page_size=16, num_pages=32, max_model_len=256,
                      prefill_buckets=(32,), kv_layout=KVLayout.RAGGED)
SHAPES = {"decode": StepShape(4, 0, 8), "prefill": StepShape(0, 32, 16),
          "mixed": StepShape(1, 32, 8)}


def export(backend, shape: StepShape) -> str:
  platform, _ = TARGETS.get(backend, ("tpu", None))
  graphdef, params = nnx.split(Transformer(MODEL, rngs=nnx.Rngs(0)))
  fn = jax.jit(functools.partial(step, graphdef, attn=AttentionSpec(backend),
                                 logprobs_mode=ENGINE.logprobs_mode))
  args = Packer(ENGINE, MODEL.vocab_size, None).template(shape)
  exported = jax.export.export(fn, platforms=[platform],
                               disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(
      params, create_one_group(MODEL, ENGINE), DecodeState.create(4, 256), args, jnp.array([0]))
  return exported.mlir_module()


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("backend", list(TARGETS), ids=lambda b: b.value)
def test_step_lowers_with_the_ragged_kernel(backend, kind):
  calls = set(re.findall(r"stablehlo\.custom_call @([^\(\s]+)\(", export(backend, SHAPES[kind])))
  assert TARGETS[backend][1] in calls


def test_reference_backend_has_no_kernel():
  """The check can fail: the plain-jnp backend lowers to no kernel custom call."""
  assert "tpu_custom_call" not in export(AttentionBackend.REFERENCE, SHAPES["mixed"])

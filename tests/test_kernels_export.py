"""Portability without hardware: each TPU kernel lowers for platform 'tpu' and each GPU kernel for
'cuda' on this CPU-only machine, through the Mosaic / Triton kernel compilers' front ends.

The lowered module must hold the kernel as the backend's custom call (`tpu_custom_call`, or
`__gpu$xla.gpu.triton`); a kernel that only ran in interpret mode would lower to plain HLO
loops instead and fail here. Whether Mosaic's and Triton's back ends then accept the kernel is
only checked on real hardware.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas

TRITON_CALL = "__gpu$xla.gpu.triton"
TARGETS = {"tpu": ("tpu", "tpu_custom_call"), "gpu": ("cuda", TRITON_CALL)}

# (num_heads, num_kv_heads, head_dim, page_size, dtype): SmolLM2's serving shape, and a
# Llama-3-8B-like one in bf16.
SHAPES = [(9, 3, 64, 16, jnp.float32), (32, 8, 128, 32, jnp.bfloat16)]


def _export(fn, platform, *args):
  """Exports jit(fn) for `platform`; returns the lowered StableHLO text."""
  target, _ = TARGETS[platform]
  # Triton kernels are a custom call without jax.export's compatibility guarantee: a serialized
  # Triton kernel is only meant to run with the jaxlib that lowered it.
  disabled = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
  exported = jax.export.export(jax.jit(fn), platforms=[target], disabled_checks=disabled)(*args)
  assert exported.platforms == (target,)
  return exported.mlir_module()


def _custom_calls(module_text):
  return set(re.findall(r"stablehlo\.custom_call @([^\(\s]+)\(", module_text))


def _cache(num_heads, num_kv_heads, head_dim, page_size, dtype, num_pages=64):
  pages = jax.ShapeDtypeStruct((num_pages, page_size, num_kv_heads, head_dim), dtype)
  return pages, pages


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"n{s[0]}k{s[1]}h{s[2]}")
def test_decode_lowers_to_the_kernel_custom_call(platform, shape):
  num_heads, _, head_dim, _, dtype = shape
  k, v = _cache(*shape)
  q = jax.ShapeDtypeStruct((8, num_heads, head_dim), dtype)
  tables = jax.ShapeDtypeStruct((8, 16), jnp.int32)
  lengths = jax.ShapeDtypeStruct((8,), jnp.int32)
  fn = functools.partial(kernels_pallas.paged_decode_attention, platform=platform)
  text = _export(fn, platform, q, k, v, tables, lengths)
  assert TARGETS[platform][1] in _custom_calls(text)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"n{s[0]}k{s[1]}h{s[2]}")
def test_prefill_lowers_to_the_kernel_custom_call(platform, shape):
  num_heads, _, head_dim, _, dtype = shape
  k, v = _cache(*shape)
  q = jax.ShapeDtypeStruct((128, num_heads, head_dim), dtype)
  tables = jax.ShapeDtypeStruct((4, 16), jnp.int32)
  cu_q_lens = jax.ShapeDtypeStruct((5,), jnp.int32)
  kv_lens = jax.ShapeDtypeStruct((4,), jnp.int32)
  fn = functools.partial(kernels_pallas.ragged_prefill_attention, platform=platform)
  text = _export(fn, platform, q, k, v, tables, cu_q_lens, kv_lens)
  assert TARGETS[platform][1] in _custom_calls(text)


def test_interpret_mode_lowers_to_no_kernel_call():
  """The check above can fail: the interpreted kernel is plain HLO, with no custom call."""
  k, v = _cache(*SHAPES[0])
  q = jax.ShapeDtypeStruct((8, 9, 64), jnp.float32)
  fn = functools.partial(kernels_pallas.paged_decode_attention, platform="tpu", interpret=True)
  text = _export(fn, "tpu", q, k, v, jax.ShapeDtypeStruct((8, 16), jnp.int32),
                 jax.ShapeDtypeStruct((8,), jnp.int32))
  assert "tpu_custom_call" not in _custom_calls(text)

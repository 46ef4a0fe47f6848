"""The ragged kernel through the real compilers on this CPU-only machine.

TPU: with libtpu installed (`pip install 'jax[tpu]==<jax's version>'`), abstract v5e / v6e devices
from jax.experimental.topologies run the whole XLA:TPU + Mosaic compiler; the memory analysis
must show the cache aliased in place (alias >= cache bytes) and a temp far below the cache, that
is, no second copy of it. GPU: the Triton kernel must lower for "cuda" (jax.export), its cache
operand aliased to its output; a real GPU compile is another test's job.
"""

import functools
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import pytest

import kernels_pallas

# name, (N, K, H, Z, P, L, T, B, W), dtype, sliding_window, topology
SMOLLM2 = (9, 3, 64, 16, 512, 30, 128, 16, 16)  # 180 MiB bf16 cache
LLAMA3_8B = (32, 8, 128, 16, 4096, 32, 256, 64, 64)  # 8 GiB bf16 cache
# 8-bit pages: TPU tiles of 32 rows, so pages of 32 tokens (half as many pages, same tokens).
SMOLLM2_8BIT = (9, 3, 64, 32, 256, 30, 128, 16, 8)
LLAMA3_8B_8BIT = (32, 8, 128, 32, 2048, 32, 256, 64, 32)
TPU_CASES = [
    ("smollm2-v5e", SMOLLM2, jnp.bfloat16, None, "v5e:2x2"),
    ("llama3-8b-v6e", LLAMA3_8B, jnp.bfloat16, None, "v6e:2x2"),
    ("smollm2-f32-window-v5e", SMOLLM2, jnp.float32, 64, "v5e:2x2"),
    ("llama3-8b-int8-v5e", LLAMA3_8B_8BIT, jnp.int8, None, "v5e:2x2"),
    ("smollm2-int8-window-v6e", SMOLLM2_8BIT, jnp.int8, 64, "v6e:2x2"),
    ("llama3-8b-e5m2-v6e", LLAMA3_8B_8BIT, jnp.float8_e5m2, None, "v6e:2x2"),
    ("llama3-8b-e4m3-v5e", LLAMA3_8B_8BIT, jnp.float8_e4m3fn, None, "v5e:2x2"),
    ("llama3-8b-e4m3-v6e", LLAMA3_8B_8BIT, jnp.float8_e4m3fn, None, "v6e:2x2"),
]


def _abstract_args(sizes, dtype, sharding=None):
  n, k, h, z, p, l, t, b, w = sizes
  layout = kernels_pallas.ragged_layout_for(k, h, dtype)
  sds = lambda shape, d: jax.ShapeDtypeStruct(shape, d, sharding=sharding)
  q_dtype = jnp.bfloat16 if jnp.dtype(dtype).itemsize == 1 else dtype  # 8-bit KV: bf16 queries.
  args = (sds((t, n, h), q_dtype), sds((t, k, h), q_dtype), sds((t, k, h), q_dtype),
          sds(layout.page_shape(l, p, z), dtype), sds((b, w), jnp.int32),
          sds((b + 1,), jnp.int32), sds((b,), jnp.int32), sds((), jnp.int32), sds((), jnp.int32))
  return args, layout.num_bytes(l, p, z)


def _step(platform, sliding_window, q, k, v, pages, tables, cu, lens, num_seqs, layer,
          attend_until=None):
  return kernels_pallas.ragged_paged_attention(q, k, v, pages, tables, cu, lens, num_seqs,
                                               layer=layer, sliding_window=sliding_window,
                                               attend_until=attend_until, platform=platform)


def _tpu_device(topology: str):
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed: pip install 'jax[tpu]==<jax's version>' to compile "
                "for TPU on this host")
  # Several processes on one host may load libtpu for compile-only use; without this, the
  # second one fails on libtpu's lockfile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies

  return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]


@pytest.mark.parametrize("name,sizes,dtype,window,topology", TPU_CASES,
                         ids=[c[0] for c in TPU_CASES])
def test_tpu_compiles_with_the_cache_in_place(name, sizes, dtype, window, topology):
  device = _tpu_device(topology)
  args, cache_bytes = _abstract_args(sizes, dtype, jax.sharding.SingleDeviceSharding(device))
  step = jax.jit(functools.partial(_step, "tpu", window), donate_argnums=(3,))
  memory = step.lower(*args).compile().memory_analysis()
  assert memory.alias_size_in_bytes >= cache_bytes
  assert memory.temp_size_in_bytes <= 0.05 * cache_bytes + (4 << 20), memory


TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("sizes,dtype", [
    (SMOLLM2, jnp.float32), (LLAMA3_8B, jnp.bfloat16), (SMOLLM2, jnp.int8),
    (LLAMA3_8B, jnp.float8_e4m3fn), (LLAMA3_8B, jnp.float8_e5m2)],
    ids=["smollm2-f32", "llama3-8b-bf16", "smollm2-int8", "llama3-8b-e4m3", "llama3-8b-e5m2"])
def test_gpu_lowers_to_the_triton_kernel_with_the_cache_aliased(sizes, dtype):
  args, _ = _abstract_args(sizes, dtype)
  disabled = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
  exported = jax.export.export(jax.jit(functools.partial(_step, "gpu", None)),
                               platforms=["cuda"], disabled_checks=disabled)(*args)
  text = exported.mlir_module()
  calls = re.findall(r"stablehlo\.custom_call @([^\(\s]+)\(.*", text)
  assert TRITON_CALL in calls
  kernel_call = next(line for line in text.splitlines() if TRITON_CALL in line)
  assert "output_operand_aliases" in kernel_call


def test_each_rows_reach_compiles_for_tpu_and_lowers_for_gpu():
  """attend_until (Gemma 3's images) through Mosaic for v5e, in place, and Triton for cuda."""
  device = _tpu_device("v5e:2x2")
  args, cache_bytes = _abstract_args(SMOLLM2, jnp.bfloat16,
                                     jax.sharding.SingleDeviceSharding(device))
  until = lambda sharding=None: jax.ShapeDtypeStruct((SMOLLM2[6],), jnp.int32, sharding=sharding)
  step = jax.jit(functools.partial(_step, "tpu", 64), donate_argnums=(3,))
  memory = step.lower(*args, until(args[0].sharding)).compile().memory_analysis()
  assert memory.alias_size_in_bytes >= cache_bytes
  args, _ = _abstract_args(SMOLLM2, jnp.bfloat16)
  disabled = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
  exported = jax.export.export(jax.jit(functools.partial(_step, "gpu", 64)), platforms=["cuda"],
                               disabled_checks=disabled)(*args, until())
  assert TRITON_CALL in exported.mlir_module()

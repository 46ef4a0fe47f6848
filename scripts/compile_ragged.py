"""Compiles one ragged_paged_attention layer-call for a TPU on this host (libtpu, no chip) and
prints the memory analysis: the cache must be aliased in place and the temp far below it.

  pip install 'jax[tpu]==<jax's version>'
  python scripts/compile_ragged.py --topology v5e:2x2 --kv-heads 3 --head-dim 64 --heads 9 \
      --layers 30 --pages 512                                               # SmolLM2
  python scripts/compile_ragged.py --topology v6e:2x2 --kv-heads 8 --head-dim 128 --heads 32 \
      --layers 32 --pages 4096 --tokens 256 --seqs 64 --width 64            # Llama-3-8B
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp

import kernels_pallas


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for flag, default in [("heads", 9), ("kv-heads", 3), ("head-dim", 64), ("page-size", 16),
                        ("pages", 512), ("layers", 30), ("tokens", 128), ("seqs", 16),
                        ("width", 16)]:
    parser.add_argument(f"--{flag}", type=int, default=default)
  parser.add_argument("--topology", default="v5e:2x2")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--sliding-window", type=int, default=None)
  a = parser.parse_args()
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # Compile-only: share libtpu.
  from jax.experimental import topologies

  device = topologies.get_topology_desc(platform="tpu", topology_name=a.topology).devices[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  dtype = jnp.dtype(a.dtype)
  layout = kernels_pallas.ragged_layout_for(a.kv_heads, a.head_dim, dtype)
  sds = lambda shape, d: jax.ShapeDtypeStruct(shape, d, sharding=sharding)
  t, b = a.tokens, a.seqs
  args = (sds((t, a.heads, a.head_dim), dtype), sds((t, a.kv_heads, a.head_dim), dtype),
          sds((t, a.kv_heads, a.head_dim), dtype),
          sds(layout.page_shape(a.layers, a.pages, a.page_size), dtype),
          sds((b, a.width), jnp.int32), sds((b + 1,), jnp.int32), sds((b,), jnp.int32),
          sds((), jnp.int32), sds((), jnp.int32))

  def step(q, k, v, pages, tables, cu, lens, num_seqs, layer):
    return kernels_pallas.ragged_paged_attention(q, k, v, pages, tables, cu, lens, num_seqs,
                                                 layer=layer, sliding_window=a.sliding_window,
                                                 platform="tpu")

  memory = jax.jit(step, donate_argnums=(3,)).lower(*args).compile().memory_analysis()
  print(json.dumps({
      "topology": a.topology, "lanes": layout.lanes, "padding_lanes": layout.padding_lanes,
      "cache_bytes": layout.num_bytes(a.layers, a.pages, a.page_size),
      "wasted_bytes": layout.wasted_bytes(a.layers, a.pages, a.page_size),
      "argument_bytes": memory.argument_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes,
      "output_bytes": memory.output_size_in_bytes, "alias_bytes": memory.alias_size_in_bytes}))


if __name__ == "__main__":
  main()

"""The checked wrapper of ragged.cc: ragged paged attention on CPU, the contract of
kernels_pallas.ragged_paged_attention (and of its jnp reference, ragged_reference.py), reading
each sequence's K/V page rows where they lie instead of gathering them into a copy.

The step's new K/V are quantized to the pages' dtype here, by the reference's own function
(ragged_reference.new_rows), so the rows the kernel writes are the reference's bit for bit; the
kernel copies them into their pages in the cache, which the call aliases (no copy of the
cache when the caller donates it), then attends. q is read as float32 and the output cast back
to q's dtype, as the reference computes. Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu import library
from kernels_pallas import ragged_checks, ragged_reference


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "k_scale", "v_scale",
                                             "isa"))
def ragged_paged_attention(q, k_new, v_new, kv_pages, page_tables, cu_q_lens, kv_lens, num_seqs,
                           *, layer=None, sm_scale=None, sliding_window=None, k_scale=None,
                           v_scale=None, attend_until=None, isa: str = "auto"):
  """See kernels_pallas.ragged_paged_attention; returns (out [T, N, H] in q.dtype, kv_pages).
  Raises ValueError naming a bad argument, or when the library is not built (check
  `kernels_cpu.available()` first)."""
  dims = ragged_checks.check_args(q, k_new, v_new, kv_pages, page_tables, cu_q_lens, kv_lens,
                                  num_seqs, layer, sliding_window, attend_until)
  k_scale, v_scale = ragged_checks.kv_scales(kv_pages.dtype, k_scale, v_scale)
  isa_code = library.isa_code(isa)
  rows = ragged_reference.new_rows(k_new, v_new, dims.layout, k_scale, v_scale)  # [T, Cr]
  pages = kv_pages if layer is not None else kv_pages[None]  # [L, P, Z, Cr]
  reach = jnp.zeros(q.shape[0], jnp.int32) if attend_until is None else (
      ragged_reference.token_reach(attend_until, cu_q_lens, kv_lens, num_seqs, q.shape[0]))
  call = jax.ffi.ffi_call(
      "jaxserve_ragged_attention",
      (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(pages.shape, pages.dtype)),
      input_output_aliases={2: 1})
  out, pages = call(
      q.astype(jnp.float32), rows, pages, page_tables, cu_q_lens, kv_lens,
      jnp.asarray(num_seqs, jnp.int32), jnp.asarray(0 if layer is None else layer, jnp.int32),
      reach,
      num_kv_heads=np.int64(dims.num_kv_heads),
      sm_scale=np.float32(ragged_checks.scale(sm_scale, dims.head_dim)),
      k_scale=np.float32(k_scale), v_scale=np.float32(v_scale),
      sliding_window=np.int64(sliding_window or 0), isa=np.int64(isa_code))
  return out.astype(q.dtype), (pages if layer is not None else pages[0])

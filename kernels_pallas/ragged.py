"""ragged_paged_attention: one call per layer for a whole engine step, K/V written in place.

The checked entry point: it validates the arguments (ValueError naming the bad one), then runs
the TPU variant (ragged_tpu.py, Mosaic), the GPU variant (ragged_gpu.py, Triton) or, on CPU, the
TPU variant in Pallas interpret mode. ragged_reference.py is the jnp reference of the same
contract. Shape letters: the key in jaxserve/model/__init__.py.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas import ragged_checks, ragged_gpu, ragged_reference, ragged_tpu
from kernels_pallas.platform import Platform, resolve


def ragged_paged_attention(q, k_new, v_new, kv_pages, page_tables, cu_q_lens, kv_lens, num_seqs,
                           *, layer=None, sm_scale=None, sliding_window=None, k_scale=None,
                           v_scale=None, attend_until=None, platform=None, interpret=None):
  """Causal attention of every sequence's new tokens, packed on one axis, over its pages.

  q [T, N, H]; k_new, v_new [T, K, H]: the step's new tokens, sequence b's at packed rows
      [cu_q_lens[b], cu_q_lens[b + 1]), then padding rows.
  kv_pages [L, P, Z, Cr] with layer (an int32 scalar), or [P, Z, Cr] with layer None: pages in the
      ragged layout (ragged_layout.layout_for(K, H, dtype)): float32, bfloat16, int8 (with
      its scale exponents in the row) or float8_e4m3fn / float8_e5m2 (kv_quant.py). k_new and
      v_new are quantized to it here, before the kernel writes them.
  page_tables [B, W] int32; cu_q_lens [B + 1] int32 from 0; kv_lens [B] int32: sequence b's KV
      length once this step's tokens are written, so its new tokens sit at positions
      kv_lens[b] - q_len .. kv_lens[b] - 1 and attend to every position <= their own.
  num_seqs: int32 scalar; sequences >= num_seqs and tokens >= cu_q_lens[num_seqs] are ignored:
      nothing of them is written, and their output rows are 0. q_len 0 is allowed.
  sliding_window: None, or a static int w: a token at position p sees keys p - w + 1 .. p only,
      and pages wholly before that are never read (Gemma 3's local layers).
  attend_until: None, or [T] int32: the last position each token sees (a Gemma 3 image's tokens
      see their whole image): keys up to it, kept within its sequence's, not before its own
      position; sliding_window still counts back from its own position.
  k_scale, v_scale: float8 pages only, static per-tensor scales (None: 1.0); K is stored as
      k / k_scale and read back times k_scale.
  sm_scale defaults to 1 / sqrt(H). Returns (out [T, N, H] in q.dtype, kv_pages with the new
  K/V written into sequence b's pages at those positions; the input buffer, aliased).
  """

  dims = ragged_checks.check_args(q, k_new, v_new, kv_pages, page_tables, cu_q_lens, kv_lens,
                                  num_seqs, layer, sliding_window, attend_until)
  k_scale, v_scale = ragged_checks.kv_scales(kv_pages.dtype, k_scale, v_scale)
  platform, interpret = resolve(platform, interpret)
  layer = jnp.int32(0) if layer is None else jnp.asarray(layer, jnp.int32)
  num_seqs = jnp.asarray(num_seqs, jnp.int32)
  reach = None if attend_until is None else ragged_reference.token_reach(
      attend_until, cu_q_lens, kv_lens, num_seqs, q.shape[0])
  variant = ragged_gpu if platform is Platform.GPU else ragged_tpu
  return variant.ragged_paged_attention(
      q, k_new, v_new, kv_pages, page_tables, cu_q_lens, kv_lens, num_seqs, layer, dims=dims,
      sm_scale=ragged_checks.scale(sm_scale, dims.head_dim), sliding_window=sliding_window,
      kv_scales=(k_scale, v_scale), reach=reach, interpret=interpret)

"""Pallas ragged paged attention: one kernel call per layer for a whole engine step.

Every sequence's new tokens (decode rows, prefill chunks, or both) are packed on one token axis;
the kernel writes their K/V into the pages in place (the cache aliased) and attends causally over
each sequence's pages, with an optional sliding window. Four pieces:
  kernel           ragged_tpu.py (Mosaic) and ragged_gpu.py (Triton); on CPU the TPU variant runs
                   in Pallas interpret mode. They share common.py (block sizes, online softmax),
                   and the TPU one tpu_pages.py (page DMAs) and ragged_windows.py (lane windows).
  checked wrapper  ragged.py: ragged_paged_attention validates its arguments (ragged_checks.py,
                   ValueError naming the bad one) and picks the variant for the platform
                   (platform.py).
  jnp reference    ragged_reference.py: the same contract in plain jnp, written for clarity.
  sweep test       tests/test_kernels_ragged.py runs both variants in interpret mode against the
                   reference over ragged steps (inputs from tests/support/ragged_testing.py).
The KV pages are the lane-dense layout of ragged_layout.py: kv_pages [L, P, Z, Cr], one row per
token holding its K heads then its V heads: float32, bfloat16, int8 (each row's scale exponents
after its V heads) or float8 e4m3fn / e5m2 (per-tensor scales); kv_quant.py encodes them. Page 0
is the engine's scratch page and never in the valid part of a page table. Page tables are int32.
"""

from __future__ import annotations

from kernels_pallas.platform import Platform, resolve
from kernels_pallas.ragged import ragged_paged_attention
from kernels_pallas.ragged_layout import RaggedLayout
from kernels_pallas.ragged_layout import layout_for as ragged_layout_for

__all__ = ["Platform", "RaggedLayout", "ragged_layout_for", "ragged_paged_attention", "resolve"]

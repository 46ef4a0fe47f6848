"""Ragged paged attention (one call per layer, K/V written in place): the layout function, the
reference against hand-worked numbers and against a token-major prefill reference, then both kernel
variants (TPU and GPU, Pallas interpret mode) against the reference over a sweep of ragged steps,
outputs and written pages both. JAXSERVE_RAGGED_COMPILED=1 (scripts/device_check.sh, on a
machine with an NVIDIA GPU) runs the sweep on the GPU variant compiled by Triton instead."""

import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas import ragged_checks, ragged_gpu, ragged_layout, ragged_reference, ragged_tpu
from support import ragged_testing


@pytest.mark.parametrize("heads,dim,dtype,lanes,padding", [
    (3, 64, jnp.bfloat16, 384, 0),  # SmolLM2: 2 * 3 * 64 lanes, already lane-dense
    (8, 128, jnp.bfloat16, 2048, 0),  # Llama-3-8B
    (3, 80, jnp.float32, 512, 32),  # 480 lanes: pad 32 at the row's end (not head_dim -> 768)
    (1, 32, jnp.float32, 128, 64),
])
def test_layout_is_lane_dense_and_pads_only_the_row_end(heads, dim, dtype, lanes, padding):
  layout = ragged_layout.layout_for(heads, dim, dtype)
  assert (layout.lanes, layout.padding_lanes) == (lanes, padding)
  assert layout.page_size_multiple == (16 if dtype == jnp.bfloat16 else 8)
  itemsize = jnp.dtype(dtype).itemsize
  assert layout.wasted_bytes(2, 10, 16) == 2 * 10 * 16 * padding * itemsize
  assert layout.v_lanes(heads - 1)[1] == layout.used_lanes


def test_layout_counts_padded_page_rows_as_waste():
  layout = ragged_layout.layout_for(3, 64, jnp.bfloat16)  # bf16 tiles have 16 rows
  assert layout.num_bytes(1, 1, 8) == 16 * 384 * 2
  assert layout.wasted_bytes(1, 1, 8) == 8 * 384 * 2


def _hand_case(sliding_window, attend_until=None):
  # Page size 2, one head, head_dim 2 (lanes: K 0-1, V 2-3, padding 4-127). Sequence 0's page
  # table is [3, 1]: position 0 cached in page 3; its 2 new tokens go to positions 1 and 2
  # (page 3 row 1, page 1 row 0). Sequence 1 is empty; sequence 2 is past num_seqs (ignored);
  # the last packed row is padding.
  pages = np.full((4, 2, 128), 100.0, np.float32)
  pages[3, 0, :4] = [0, 0, 6, 0]
  k_new = jnp.asarray([[[math.log(2), 0]], [[math.log(3), 0]], [[7, 7]]], jnp.float32)
  v_new = jnp.asarray([[[0, 6]], [[2, 2]], [[7, 7]]], jnp.float32)
  q = jnp.asarray([[[1, 0]], [[1, 0]], [[5, 5]]], jnp.float32)  # [T=3, N=1, H=2]
  args = (q, k_new, v_new, jnp.asarray(pages), jnp.asarray([[3, 1], [0, 0], [2, 2]], jnp.int32),
          jnp.asarray([0, 2, 2, 3], jnp.int32), jnp.asarray([3, 0, 4], jnp.int32), jnp.int32(2))
  return ragged_reference.ragged_paged_attention_reference(
      *args, sm_scale=1.0, sliding_window=sliding_window, attend_until=attend_until)


def test_reference_matches_hand_worked_numbers():
  out, pages = _hand_case(None)
  # Row 0 (position 1): logits 0, ln 2 -> weights 1/3, 2/3 -> [6/3, 6 * 2/3].
  # Row 1 (position 2): logits 0, ln 2, ln 3 -> 1/6, 2/6, 3/6 -> [6/6 + 2 * 3/6, 6 * 2/6 + 1].
  np.testing.assert_allclose(out[:, 0], [[2, 4], [2, 3], [0, 0]], atol=1e-6)
  pages = np.asarray(pages)
  np.testing.assert_allclose(pages[3, 1, :4], [math.log(2), 0, 0, 6], atol=1e-7)
  np.testing.assert_allclose(pages[1, 0, :4], [math.log(3), 0, 2, 2], atol=1e-7)
  assert np.all(pages[1, 1] == 100) and np.all(pages[2] == 100)  # Unwritten, and ignored seq 2.
  assert np.all(pages[3, 1, 4:] == 0)  # The row's padding lanes are written as zeros.


def test_reference_sliding_window_hand_worked():
  out, _ = _hand_case(2)
  # Row 1 (position 2) sees positions 1, 2 only: weights 2/5, 3/5 -> [2 * 3/5, 6 * 2/5 + 2 * 3/5].
  np.testing.assert_allclose(out[:, 0], [[2, 4], [1.2, 3.6], [0, 0]], atol=1e-6)


def test_reference_attend_until_hand_worked():
  """Row 0 (position 1) seeing up to position 2, as an image's token sees its whole image: the
  weights of row 1 (1/6, 2/6, 3/6), so its output too; row 1 unchanged."""
  out, _ = _hand_case(None, attend_until=jnp.asarray([2, 2, 9], jnp.int32))
  np.testing.assert_allclose(out[:, 0], [[2, 3], [2, 3], [0, 0]], atol=1e-6)


def _prefill_reference(q, k_pages, v_pages, page_tables, cu_q_lens, kv_lens):
  """Token-major pages k, v [P, Z, K, H]: packed token i of sequence b sits at position
  kv_lens[b] - q_len[b] + i and attends to positions <= its own over its whole page table;
  padding rows give 0. An independent second reference, gathered per token in jnp."""
  t, n, h = q.shape
  k = k_pages.shape[2]
  tok = jnp.arange(t)
  seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, kv_lens.shape[0] - 1)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  pos = kv_lens[seq] - q_lens[seq] + tok - cu_q_lens[seq]  # [T]
  gather = lambda pages: pages[page_tables[seq]].reshape(t, -1, k, h).astype(jnp.float32)
  keys, values = gather(k_pages), gather(v_pages)  # [T, S, K, H]
  mask = (jnp.arange(keys.shape[1])[None] <= pos[:, None]) & (tok < cu_q_lens[-1])[:, None]
  q_TKGH = q.reshape(t, k, n // k, h).astype(jnp.float32)
  logits = jnp.einsum("tkgh,tskh->tkgs", q_TKGH, keys) / math.sqrt(h)
  logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.where(mask[:, None, None], jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  out = jnp.einsum("tkgs,tskh->tkgh", p, values) / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
  return out.reshape(t, n, h)


def test_reference_attention_equals_the_prefill_reference_on_the_written_pages():
  """Two independent references agree once the ragged one has written the new K/V."""
  shape = ragged_testing.KernelShape(6, 2, 16, 8, 4)
  args, kw = ragged_testing.step_inputs(np.random.default_rng(0), [(3, 5), (1, 8), (9, 0)],
                                        shape, num_tokens=16, num_seqs_max=3)
  out, pages = ragged_reference.ragged_paged_attention_reference(*args, **kw)
  # The prefill reference reads whole page tables (page 0 past a sequence's end): no NaN there.
  rows = jnp.nan_to_num(pages[kw["layer"]])
  k, v = ragged_layout.unpack_rows(rows, 2, 16)  # [P, Z, K, H] each
  expected = _prefill_reference(args[0], k, v, *args[4:7])
  np.testing.assert_allclose(out, expected, atol=2e-6)


def _batches(z: int, width: int):
  """(q_len, context) per live sequence, by kind: empty sequences, ends exactly on a page
  boundary (the next token starts a page; a chunk fills one), the full table."""
  full = z * width
  return {
      "decode": [(1, 0), (1, z - 1), (0, 5), (1, z), (1, 2 * z + 3), (1, full - 1)],
      "prefill": [(z, 0), (3, 0), (0, 0), (2 * z + 5, 0), (z, z), (z - 1, full - 2 * z + 1)],
      "mixed": [(1, 20), (z + 3, 5), (0, 0), (1, z - 1), (2 * z, z), (5, full - 5)],
  }


# (N, K, H, Z, W, dtype, sliding_window, batch, block_q, pages_per_chunk)
SWEEP = [
    (9, 3, 64, 16, 6, jnp.float32, None, "mixed", 8, 2),  # SmolLM2 heads, GQA 3
    (9, 3, 64, 16, 6, jnp.bfloat16, 24, "decode", None, None),
    (8, 8, 128, 32, 4, jnp.float32, None, "prefill", 16, 1),  # GQA 1, head_dim 128
    (32, 4, 128, 32, 4, jnp.bfloat16, None, "mixed", 16, None),  # GQA 8
    (8, 1, 64, 16, 6, jnp.float32, 20, "prefill", 8, 1),  # GQA 8, one KV head, window
    (6, 2, 128, 16, 5, jnp.bfloat16, 40, "mixed", 16, 2),  # GQA 3, window over pages
    # 8-bit pages (TPU tiles of 32 rows): int8 with exponents in the row, float8 per tensor.
    (9, 3, 64, 32, 4, jnp.int8, None, "mixed", 8, 2),
    (32, 4, 128, 32, 4, jnp.int8, 40, "decode", None, None),
    (8, 2, 128, 32, 4, jnp.float8_e4m3fn, 40, "mixed", 16, None),
    (6, 2, 128, 32, 3, jnp.float8_e5m2, None, "prefill", 16, 1),
]
COMPILED = os.environ.get("JAXSERVE_RAGGED_COMPILED") == "1"
VARIANTS = {"gpu": ragged_gpu} if COMPILED else {"tpu": ragged_tpu, "gpu": ragged_gpu}


def _run_variant(variant, args, kw, sliding_window, block_q, per_chunk, kv_scales=(1.0, 1.0),
                 attend_until=None):
  dims = ragged_checks.check_args(*args, kw["layer"], sliding_window)
  reach = None if attend_until is None else ragged_reference.token_reach(
      attend_until, args[5], args[6], args[7], args[0].shape[0])
  return VARIANTS[variant].ragged_paged_attention(
      *args, kw["layer"], dims=dims, sm_scale=ragged_checks.scale(None, dims.head_dim),
      sliding_window=sliding_window, kv_scales=kv_scales, block_q=block_q,
      pages_per_chunk=per_chunk, reach=reach, interpret=not COMPILED)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("config", SWEEP, ids=lambda c: f"n{c[0]}k{c[1]}h{c[2]}z{c[3]}-"
                         f"{jnp.dtype(c[5]).name}-w{c[6]}-{c[7]}")
def test_kernel_matches_reference(variant, config):
  n, k, h, z, width, dtype, window, kind, block_q, per_chunk = config
  batch = _batches(z, width)[kind]
  shape = ragged_testing.KernelShape(n, k, h, z, width, dtype)
  num_tokens = sum(q for q, _ in batch) + 5  # Padding rows past the last sequence.
  args, kw = ragged_testing.step_inputs(np.random.default_rng(h + z), batch, shape,
                                        num_tokens=num_tokens, num_seqs_max=len(batch) + 2)
  before = np.asarray(args[3], np.float32)
  out, pages = _run_variant(variant, args, kw, window, block_q, per_chunk)
  ref_out, ref_pages = ragged_reference.ragged_paged_attention_reference(
      *args, **kw, sliding_window=window)
  assert out.shape == args[0].shape and out.dtype == shape.q_dtype and pages.dtype == dtype
  tol = 2e-5 if shape.q_dtype == jnp.float32 else 3e-2
  real = sum(q for q, _ in batch)
  out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
  np.testing.assert_allclose(out[:real], ref_out[:real], atol=tol, rtol=tol)
  assert not np.any(out[real:])  # Padding rows are zeros.
  # Written pages: bit-equal to the reference's; every page no sequence owns (NaN) untouched,
  # and the other layer untouched.
  np.testing.assert_array_equal(np.asarray(pages, np.float32), np.asarray(ref_pages, np.float32))
  owned = ragged_testing.owned_pages(args[4], args[6], len(batch), z)
  unowned = np.setdiff1d(np.arange(before.shape[1]), owned)
  assert np.all(ragged_testing.is_filler(pages[:, unowned]))
  np.testing.assert_array_equal(np.asarray(pages, np.float32)[0], before[0])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("config", [SWEEP[0], SWEEP[5], SWEEP[6]],
                         ids=lambda c: f"{jnp.dtype(c[5]).name}-w{c[6]}-{c[7]}")
def test_kernel_takes_each_rows_reach(variant, config):
  """attend_until (Gemma 3's image tokens seeing their whole image): spans of each prefill's new
  tokens see up to the span's end, past blocks and chunks; the same as the reference's, which
  (test_reference_attend_until_hand_worked) sees exactly those keys."""
  n, k, h, z, width, dtype, window, kind, block_q, per_chunk = config
  batch = _batches(z, width)[kind]
  shape = ragged_testing.KernelShape(n, k, h, z, width, dtype)
  rng = np.random.default_rng(h + z + 1)
  num_tokens = sum(q for q, _ in batch) + 5
  args, kw = ragged_testing.step_inputs(rng, batch, shape, num_tokens=num_tokens,
                                        num_seqs_max=len(batch) + 2)
  until = ragged_testing.image_reach(rng, batch, num_tokens)
  out, pages = _run_variant(variant, args, kw, window, block_q, per_chunk, attend_until=until)
  ref_out, ref_pages = ragged_reference.ragged_paged_attention_reference(
      *args, **kw, sliding_window=window, attend_until=until)
  causal, _ = ragged_reference.ragged_paged_attention_reference(*args, **kw,
                                                               sliding_window=window)
  real = sum(q for q, _ in batch)
  out, ref_out = np.asarray(out, np.float32)[:real], np.asarray(ref_out, np.float32)[:real]
  tol = 2e-5 if shape.q_dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(out, ref_out, atol=tol, rtol=tol)
  assert np.abs(ref_out - np.asarray(causal, np.float32)[:real]).max() > 10 * tol  # It reached.
  np.testing.assert_array_equal(np.asarray(pages, np.float32), np.asarray(ref_pages, np.float32))


def test_cpu_platform_runs_interpreted_and_matches():
  shape = ragged_testing.KernelShape(9, 3, 64, 16, 4)
  args, kw = ragged_testing.step_inputs(np.random.default_rng(1), [(1, 20), (9, 16), (0, 0)],
                                        shape, num_tokens=16, num_seqs_max=4)
  out, pages = kernels_pallas.ragged_paged_attention(*args, **kw)  # platform None -> cpu here
  ref_out, ref_pages = ragged_reference.ragged_paged_attention_reference(*args, **kw)
  np.testing.assert_allclose(out, ref_out, atol=2e-5)
  np.testing.assert_array_equal(pages, ref_pages)
  assert kernels_pallas.resolve(None, None) == (kernels_pallas.Platform.CPU, True)
  assert kernels_pallas.resolve("tpu", None) == (kernels_pallas.Platform.TPU, False)
  with pytest.raises(ValueError, match="platform"):
    kernels_pallas.ragged_paged_attention(*args, **kw, platform="metal")


@pytest.mark.parametrize("z,h,name", [(12, 64, "page_size"), (16, 24, "head_dim")])
def test_gpu_variant_rejects_sizes_triton_cannot_tile(z, h, name):
  shape = ragged_testing.KernelShape(4, 2, h, z, 2)
  args, kw = ragged_testing.step_inputs(np.random.default_rng(5), [(3, 0)], shape, num_tokens=8,
                                        num_seqs_max=1)
  with pytest.raises(ValueError, match=f"{name} must be a power of two"):
    kernels_pallas.ragged_paged_attention(*args, **kw, platform="gpu", interpret=True)


def test_single_layer_pages_without_layer():
  shape = ragged_testing.KernelShape(4, 2, 64, 8, 4, num_layers=1)
  args, kw = ragged_testing.step_inputs(np.random.default_rng(2), [(2, 7), (1, 0)], shape,
                                        num_tokens=8, num_seqs_max=2, layer=0)
  args[3] = args[3][0]  # [P, Z, C]
  out, pages = kernels_pallas.ragged_paged_attention(*args, platform="gpu", interpret=True)
  ref_out, ref_pages = ragged_reference.ragged_paged_attention_reference(*args)
  assert pages.shape == args[3].shape
  np.testing.assert_allclose(out, ref_out, atol=2e-5)
  np.testing.assert_array_equal(pages, ref_pages)


BAD_ARGS = [
    ("q", 0, lambda a: a[0][0]),
    ("k_new", 1, lambda a: a[1][:, :, :8]),
    ("v_new", 2, lambda a: a[2][:-1]),
    ("kv_pages", 3, lambda a: a[3][..., :128]),  # Not the layout's 256 lanes
    ("page_tables", 4, lambda a: a[4].astype(jnp.float32)),
    ("cu_q_lens", 5, lambda a: a[5][:-1]),
    ("kv_lens", 6, lambda a: a[6][:1]),
    ("num_seqs", 7, lambda a: jnp.asarray([2], jnp.int32)),
]


@pytest.mark.parametrize("name,index,break_arg", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_bad_arguments_raise_value_error_naming_them(name, index, break_arg):
  shape = ragged_testing.KernelShape(4, 2, 64, 8, 2)
  args, kw = ragged_testing.step_inputs(np.random.default_rng(3), [(3, 0), (1, 9)], shape,
                                        num_tokens=8, num_seqs_max=2)
  args[index] = break_arg(args)
  with pytest.raises(ValueError, match=name):
    kernels_pallas.ragged_paged_attention(*args, **kw, platform="tpu")


def test_tpu_rejects_page_sizes_that_tiles_would_pad():
  shape = ragged_testing.KernelShape(4, 2, 64, 8, 2, jnp.bfloat16)  # bf16 tiles are 16 rows
  args, kw = ragged_testing.step_inputs(np.random.default_rng(4), [(3, 0)], shape, num_tokens=8,
                                        num_seqs_max=1)
  with pytest.raises(ValueError, match="page_size must be a multiple of 16"):
    kernels_pallas.ragged_paged_attention(*args, **kw, platform="tpu")
  with pytest.raises(ValueError, match="sliding_window"):
    kernels_pallas.ragged_paged_attention(*args, **kw, sliding_window=0)


@pytest.mark.parametrize("variant", ["tpu", "gpu"])
def test_a_step_of_only_padding_writes_nothing_and_gives_zeros(variant):
  shape = ragged_testing.KernelShape(9, 3, 64, 16, 4)
  args, kw = ragged_testing.step_inputs(np.random.default_rng(1), [(1, 20), (9, 16), (0, 0)],
                                        shape, num_tokens=16, num_seqs_max=4)
  args[7] = jnp.int32(0)  # No live sequence: every table, length and token is to be ignored.
  out, pages = kernels_pallas.ragged_paged_attention(*args, **kw, platform=variant,
                                                     interpret=True)
  assert not np.any(np.asarray(out))
  np.testing.assert_array_equal(pages, args[3])


@pytest.mark.parametrize("variant", VARIANTS)
def test_float8_per_tensor_scales_match_the_reference(variant):
  """k_scale 4, v_scale 0.25: pages hold k / 4 and v * 4 (clipped to e4m3's 448), the outputs
  are scaled back; kernel and reference agree on both."""
  shape = ragged_testing.KernelShape(8, 2, 128, 32, 3, jnp.float8_e4m3fn)
  args, kw = ragged_testing.step_inputs(np.random.default_rng(6), [(5, 40), (1, 7)], shape,
                                        num_tokens=8, num_seqs_max=2)
  out, pages = _run_variant(variant, args, kw, None, None, None, kv_scales=(4.0, 0.25))
  ref_out, ref_pages = ragged_reference.ragged_paged_attention_reference(
      *args, **kw, k_scale=4.0, v_scale=0.25)
  np.testing.assert_allclose(np.asarray(out)[:6], np.asarray(ref_out)[:6], atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(pages, np.float32), np.asarray(ref_pages, np.float32))
  written = np.asarray(ref_pages[1, args[4][1, 0], 7], np.float32)  # Sequence 1's new token.
  k_new = np.asarray(args[1][5], np.float32).reshape(-1)
  np.testing.assert_array_equal(written[:256], np.asarray(
      jnp.asarray(k_new / 4, jnp.float8_e4m3fn), np.float32))


def test_reference_int8_pages_hold_exponents_and_decode_exactly():
  """One KV head of head_dim 2: K [1, -0.5] -> e = ceil(log2(1 / 127)) = -6, ints [64, -32];
  V [3, 0] -> e = -5, ints [96, 0]; the row is K, V, then the exponents -6, -5. Attending to
  that one key returns V exactly (its ints times 2^-5)."""
  pages = jnp.zeros((2, 32, 128), jnp.int8)
  q = jnp.ones((1, 1, 2), jnp.float32)
  k_new, v_new = jnp.asarray([[[1.0, -0.5]]]), jnp.asarray([[[3.0, 0.0]]])
  out, pages = ragged_reference.ragged_paged_attention_reference(
      q, k_new, v_new, pages, jnp.asarray([[1]], jnp.int32), jnp.asarray([0, 1], jnp.int32),
      jnp.asarray([1], jnp.int32), jnp.int32(1))
  np.testing.assert_array_equal(np.asarray(pages[1, 0, :6]), [64, -32, 96, 0, -6, -5])
  assert not np.any(np.asarray(pages[1, 0, 6:])) and not np.any(np.asarray(pages[1, 1:]))
  np.testing.assert_array_equal(np.asarray(out[0, 0]), [3.0, 0.0])


def test_scales_are_for_float8_pages_only():
  shape = ragged_testing.KernelShape(4, 2, 64, 32, 2, jnp.int8)
  args, kw = ragged_testing.step_inputs(np.random.default_rng(7), [(3, 0)], shape, num_tokens=8,
                                        num_seqs_max=1)
  with pytest.raises(ValueError, match="k_scale and v_scale are for float8"):
    kernels_pallas.ragged_paged_attention(*args, **kw, k_scale=2.0, platform="gpu")

"""Ragged paged prefill attention: the reference against hand-worked numbers and against the
decode reference, then both kernel variants (TPU and GPU, in Pallas interpret mode) against the
reference over a sweep of shapes and ragged batches."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas import reference, testing

VARIANTS = ("tpu", "gpu")


def test_reference_matches_hand_worked_numbers():
  # Page size 2, one head, head_dim 2; sequence 0's page table is [3, 1] (positions 0, 1 in
  # page 3, positions 2, 3 in page 1). Position 0 is cached; the chunk's 2 new tokens sit at
  # positions 1 and 2. Sequence 1 is empty; the last packed row is padding.
  k = np.zeros((4, 2, 1, 2), np.float32)
  v = np.zeros((4, 2, 1, 2), np.float32)
  k[3, :, 0] = [[0, 0], [math.log(2), 0]]
  k[1, :, 0] = [[math.log(3), 0], [100, 100]]  # Position 3 is past kv_len: masked.
  v[3, :, 0] = [[6, 0], [0, 6]]
  v[1, :, 0] = [[2, 2], [1000, 1000]]
  q = jnp.asarray([[[1, 0]], [[1, 0]], [[5, 5]]], jnp.float32)  # [T=3, N=1, H=2]
  out = reference.ragged_prefill_reference(
      q, jnp.asarray(k), jnp.asarray(v), jnp.asarray([[3, 1], [0, 0]], jnp.int32),
      jnp.asarray([0, 2, 2], jnp.int32), jnp.asarray([3, 0], jnp.int32), sm_scale=1.0)
  # Row 0 (position 1): logits 0, ln 2 -> weights 1/3, 2/3 -> [6/3, 6*2/3].
  # Row 1 (position 2): logits 0, ln 2, ln 3 -> weights 1/6, 2/6, 3/6 -> [1 + 1, 2 + 1].
  np.testing.assert_allclose(out[:, 0], [[2, 4], [2, 3], [0, 0]], atol=1e-6)


def test_reference_with_one_token_per_sequence_is_decode():
  """Two independent references agree: prefill of 1 new token each == decode."""
  shape = testing.PagedShape(6, 2, 16, 4, 5)
  q, k, v, tables, lengths = testing.decode_inputs(np.random.default_rng(0), [1, 7, 20], shape)
  cu_q_lens = jnp.arange(4, dtype=jnp.int32)
  prefill = reference.ragged_prefill_reference(q, k, v, tables, cu_q_lens, lengths)
  decode = reference.paged_decode_reference(q, k, v, tables, lengths)
  np.testing.assert_allclose(prefill, decode, atol=1e-6)


def _ragged_batch(page_size: int, max_len: int):
  """(q_len, context) per sequence: short with a context, empty, one token after a full page,
  exactly one full page, a chunk ending at the maximum length, the maximum as one chunk."""
  return [(3, 5), (0, 0), (1, page_size), (page_size, 0), (page_size + 3, max_len - page_size - 3),
          (max_len, 0)]


# (num_heads, num_kv_heads, head_dim, page_size, pages_per_seq, dtype, pages_per_chunk, block_q)
SWEEP = [
    (9, 3, 64, 16, 4, jnp.float32, None, None),  # SmolLM2's heads and pages, default blocks
    (2, 2, 128, 8, 8, jnp.bfloat16, 3, 16),  # GQA 1; chunks of 3 pages; small query blocks
    (8, 1, 256, 32, 4, jnp.float32, 1, None),  # GQA 8, head_dim 256; one page per chunk
    (6, 2, 64, 128, 2, jnp.bfloat16, None, None),  # Page size 128
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("config", SWEEP, ids=lambda c: f"n{c[0]}k{c[1]}h{c[2]}z{c[3]}")
def test_kernel_matches_reference(variant, config):
  num_heads, num_kv_heads, head_dim, page_size, width, dtype, per_chunk, block_q = config
  shape = testing.PagedShape(num_heads, num_kv_heads, head_dim, page_size, width, dtype)
  batch = _ragged_batch(page_size, shape.max_len)
  q_lens, contexts = [n for n, _ in batch], [c for _, c in batch]
  num_tokens = sum(q_lens) + 5  # Padding rows past the last sequence.
  args = testing.prefill_inputs(np.random.default_rng(head_dim + page_size), q_lens, contexts,
                                num_tokens, shape)
  variant_fn = {"tpu": kernels_pallas.tpu_prefill, "gpu": kernels_pallas.gpu_prefill}[variant]
  out = variant_fn.ragged_prefill_attention(*args, pages_per_chunk=per_chunk, block_q=block_q,
                                            interpret=True)
  ref = reference.ragged_prefill_reference(*args)
  assert out.shape == args[0].shape and out.dtype == dtype
  tol = 2e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=tol, rtol=tol)
  assert not np.any(np.asarray(out[sum(q_lens):], np.float32))  # Padding rows -> zeros.


SMOLLM2 = testing.PagedShape(9, 3, 64, 16, 4)


def _smollm2_args(seed, num_pages=None):
  """A prefix-cached chunk (16 cached + 9 new), a chunk mid-page, and a whole prompt."""
  return testing.prefill_inputs(np.random.default_rng(seed), [9, 5, 30], [16, 11, 0], 48,
                                SMOLLM2, num_pages)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_never_reads_pages_outside_the_valid_page_table(variant):
  """NaN in page 0 and unowned pages must not reach any output (see the decode test)."""
  q, k, v, tables, cu_q_lens, kv_lens = _smollm2_args(0, num_pages=16)
  expected = reference.ragged_prefill_reference(q, k, v, tables, cu_q_lens, kv_lens)
  owned = [np.asarray(tables[b, :-(-int(n) // 16)]) for b, n in enumerate(kv_lens)]
  unowned = np.setdiff1d(np.arange(16), np.concatenate(owned))
  assert 0 in unowned and len(unowned) > 1
  k, v = k.at[unowned].set(jnp.nan), v.at[unowned].set(jnp.nan)
  out = kernels_pallas.ragged_prefill_attention(q, k, v, tables, cu_q_lens, kv_lens,
                                                platform=variant, interpret=True)
  np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


def test_cpu_platform_runs_interpreted_and_matches():
  args = _smollm2_args(1, num_pages=16)
  out = kernels_pallas.ragged_prefill_attention(*args)  # platform None -> cpu here
  np.testing.assert_allclose(out, reference.ragged_prefill_reference(*args), atol=2e-5)


def test_layer_of_a_whole_cache_reads_that_layers_pages():
  q, k, v, tables, cu_q_lens, kv_lens = _smollm2_args(2, num_pages=16)
  k_all, v_all = jnp.stack([k + 1.0, k - 2.0, k]), jnp.stack([v - 3.0, v + 5.0, v])  # L = 3
  out = kernels_pallas.ragged_prefill_attention(q, k_all, v_all, tables, cu_q_lens, kv_lens,
                                                layer=jnp.int32(2))
  expected = reference.ragged_prefill_reference(q, k, v, tables, cu_q_lens, kv_lens)
  np.testing.assert_allclose(out, expected, atol=2e-5)


BAD_ARGS = [
    ("cu_q_lens", 4, lambda a: a[4][:-1]),
    ("kv_lens", 5, lambda a: a[5].astype(jnp.float32)),
    ("page_tables", 3, lambda a: a[3][:2]),
    ("k_pages", 1, lambda a: a[1].reshape(a[1].shape[0], -1)),
    ("q", 0, lambda a: a[0][0]),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name,index,break_arg", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_bad_shapes_raise_value_error_naming_the_argument(variant, name, index, break_arg):
  shape = testing.PagedShape(4, 2, 16, 8, 2)
  args = list(testing.prefill_inputs(np.random.default_rng(2), [3, 4, 1], [0, 9, 2], 8, shape))
  args[index] = break_arg(args)
  with pytest.raises(ValueError, match=name):
    kernels_pallas.ragged_prefill_attention(*args, platform=variant, interpret=True)

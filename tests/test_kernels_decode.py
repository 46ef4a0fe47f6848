"""Paged decode attention: the reference against hand-worked numbers, then both kernel variants
(TPU and GPU, in Pallas interpret mode) against the reference over a sweep of shapes."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas import reference, testing

VARIANTS = ("tpu", "gpu")


def _hand_pages():
  """Page size 2, one KV head, head_dim 2. The sequence's page table is [3, 1]: positions 0, 1
  live in page 3 and 2, 3 in page 1. Position 3 holds huge values and must be masked."""
  k = np.zeros((4, 2, 1, 2), np.float32)
  v = np.zeros((4, 2, 1, 2), np.float32)
  k[3, :, 0] = [[0, 0], [math.log(2), 0]]  # positions 0, 1
  k[1, :, 0] = [[math.log(3), math.log(2)], [100, 100]]  # positions 2, 3
  v[3, :, 0] = [[6, 0], [0, 6]]
  v[1, :, 0] = [[2, 2], [1000, 1000]]
  return jnp.asarray(k), jnp.asarray(v)


def test_reference_matches_hand_worked_numbers():
  k, v = _hand_pages()
  q = jnp.asarray([[[1, 0], [0, 1]], [[1, 0], [0, 1]]], jnp.float32)  # [B=2, N=2, H=2]
  tables = jnp.asarray([[3, 1], [0, 0]], jnp.int32)
  lengths = jnp.asarray([3, 0], jnp.int32)
  out = reference.paged_decode_reference(q, k, v, tables, lengths, sm_scale=1.0)
  # Head 0: logits 0, ln 2, ln 3 -> weights 1/6, 2/6, 3/6 -> [6/6 + 2*3/6, 6*2/6 + 2*3/6].
  # Head 1: logits 0, 0, ln 2 -> weights 1/4, 1/4, 2/4 -> [6/4 + 2*2/4, 6/4 + 2*2/4].
  # Sequence 1 has no positions: zeros.
  np.testing.assert_allclose(out, [[[2, 3], [2.5, 2.5]], [[0, 0], [0, 0]]], atol=1e-6)


def test_reference_default_scale_is_inverse_sqrt_head_dim():
  k, v = _hand_pages()
  q = jnp.asarray([[[1, 0], [0, 1]]], jnp.float32)
  args = (k, v, jnp.asarray([[3, 1]], jnp.int32), jnp.asarray([3], jnp.int32))
  scaled = reference.paged_decode_reference(q * math.sqrt(2), *args)
  np.testing.assert_allclose(scaled, [[[2, 3], [2.5, 2.5]]], atol=1e-5)


# (num_heads, num_kv_heads, head_dim, page_size, pages_per_seq, dtype, pages_per_chunk):
# GQA ratios 3 (SmolLM2's 9/3), 1 and 8; head_dim 64/128/256; page sizes 8..128; both dtypes;
# chunks of 1 to 16 pages, so sequences span one chunk or several with a ragged last one.
SWEEP = [
    (9, 3, 64, 16, 8, jnp.float32, 3),
    (2, 2, 128, 8, 8, jnp.bfloat16, None),
    (8, 1, 256, 32, 4, jnp.float32, 1),
    (6, 2, 64, 128, 2, jnp.bfloat16, None),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("config", SWEEP, ids=lambda c: f"n{c[0]}k{c[1]}h{c[2]}z{c[3]}")
def test_kernel_matches_reference(variant, config):
  num_heads, num_kv_heads, head_dim, page_size, width, dtype, per_chunk = config
  shape = testing.PagedShape(num_heads, num_kv_heads, head_dim, page_size, width, dtype)
  # Lengths 0, 1, exactly one full page, one past it, the maximum, and one in between.
  lengths = [0, 1, page_size, page_size + 1, shape.max_len, shape.max_len // 2 + 3]
  args = testing.decode_inputs(np.random.default_rng(head_dim + page_size), lengths, shape)
  variant_fn = {"tpu": kernels_pallas.tpu_decode, "gpu": kernels_pallas.gpu_decode}[variant]
  out = variant_fn.paged_decode_attention(*args, pages_per_chunk=per_chunk, interpret=True)
  ref = reference.paged_decode_reference(*args)
  assert out.shape == args[0].shape and out.dtype == dtype
  tol = 2e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=tol, rtol=tol)
  assert not np.any(np.asarray(out[0], np.float32))  # Length 0 -> zeros.


SMOLLM2 = testing.PagedShape(9, 3, 64, 16, 8)  # The default model's heads and page size.
SMOLLM2_LENGTHS = [0, 1, 17, 40]


def _smollm2_args(seed, num_pages=None):
  return testing.decode_inputs(np.random.default_rng(seed), SMOLLM2_LENGTHS, SMOLLM2, num_pages)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_never_reads_pages_outside_the_valid_page_table(variant):
  """NaN in the scratch page 0 (where table entries past each sequence's last page point) and
  in unowned pages must not reach any output: a kernel that loaded them, even masked
  (0 * nan), would return NaN."""
  q, k, v, tables, lengths = _smollm2_args(0, num_pages=16)
  expected = reference.paged_decode_reference(q, k, v, tables, lengths)
  owned = [np.asarray(tables[b, :-(-n // 16)]) for b, n in enumerate(SMOLLM2_LENGTHS)]
  unowned = np.setdiff1d(np.arange(16), np.concatenate(owned))  # Page 0 and the spare ones.
  assert 0 in unowned and len(unowned) > 1
  k, v = k.at[unowned].set(jnp.nan), v.at[unowned].set(jnp.nan)
  out = kernels_pallas.paged_decode_attention(q, k, v, tables, lengths, platform=variant,
                                              interpret=True)
  np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)


def test_cpu_platform_runs_interpreted_and_matches():
  args = _smollm2_args(1, num_pages=16)
  out = kernels_pallas.paged_decode_attention(*args)  # platform None -> jax backend (cpu here)
  np.testing.assert_allclose(out, reference.paged_decode_reference(*args), atol=2e-5)
  assert kernels_pallas.resolve(None, None) == (kernels_pallas.Platform.CPU, True)
  assert kernels_pallas.resolve("tpu", None) == (kernels_pallas.Platform.TPU, False)


def test_layer_of_a_whole_cache_reads_that_layers_pages():
  """layer= with the [L, P, Z, K, H] cache equals passing that layer's [P, Z, K, H] pages."""
  q, k, v, tables, lengths = _smollm2_args(2, num_pages=16)
  k_all = jnp.stack([k + 1.0, k, k - 7.0])  # [L=3, P, Z, K, H]; the other layers differ.
  v_all = jnp.stack([v - 3.0, v, v + 9.0])
  out = kernels_pallas.paged_decode_attention(q, k_all, v_all, tables, lengths,
                                              layer=jnp.int32(1))
  np.testing.assert_allclose(out, reference.paged_decode_reference(q, k, v, tables, lengths),
                             atol=2e-5)
  with pytest.raises(ValueError, match="k_pages"):
    kernels_pallas.paged_decode_attention(q, k, v, tables, lengths, layer=jnp.int32(1))


def _good_args():
  shape = testing.PagedShape(4, 2, 16, 8, 2)
  return list(testing.decode_inputs(np.random.default_rng(2), [3, 9], shape))


BAD_ARGS = [
    ("q", lambda a: a[0][:, :, None]),
    ("k_pages", lambda a: a[1][0]),
    ("v_pages", lambda a: a[2][:, :4]),
    ("num_heads", lambda a: a[0][:, :3]),
    ("head_dim", lambda a: a[0][:, :, :8]),
    ("page_tables", lambda a: a[3].astype(jnp.float32)),
    ("page_tables", lambda a: a[3][:1]),
    ("lengths", lambda a: a[4][:1]),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name,break_arg", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_bad_shapes_raise_value_error_naming_the_argument(variant, name, break_arg):
  args = _good_args()
  index = {"q": 0, "num_heads": 0, "head_dim": 0, "k_pages": 1, "v_pages": 2, "page_tables": 3,
           "lengths": 4}[name]
  args[index] = break_arg(args)
  with pytest.raises(ValueError, match=name):
    kernels_pallas.paged_decode_attention(*args, platform=variant, interpret=True)


def test_gpu_variant_rejects_sizes_triton_cannot_tile():
  shape = testing.PagedShape(4, 2, 16, 12, 2)
  with pytest.raises(ValueError, match="page_size"):
    kernels_pallas.paged_decode_attention(
        *testing.decode_inputs(np.random.default_rng(3), [3, 9], shape), platform="gpu",
        interpret=True)


def test_unknown_platform_raises():
  with pytest.raises(ValueError, match="platform"):
    kernels_pallas.paged_decode_attention(*_good_args(), platform="metal")

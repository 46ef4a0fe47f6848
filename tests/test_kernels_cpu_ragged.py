"""kernels_cpu's ragged paged attention against the Pallas kernels' jnp reference
(kernels_pallas/ragged_reference.py): outputs within 1e-5 and written pages bit-equal, over a
sweep of page sizes, GQA ratios, head dims, KV dtypes, sliding windows and ragged steps (decode
rows, prefill chunks, both; lengths that end mid-page or on a page's last row, a sequence at its
first token, empty sequences, padding tokens, sequences past num_seqs), on a stacked [L, ...]
pool with `layer` and on one layer's pages; every instruction set this CPU runs; the cache
aliased; the wrapper's checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from kernels_cpu import library
from kernels_pallas import ragged_reference
from support import ragged_testing

pytestmark = pytest.mark.skipif(not kernels_cpu.available(), reason="kernels_cpu not built")

TOLERANCE = 1e-5  # float32 outputs: the same sums in another order.


def _batches(z: int, width: int):
  """(q_len, context) per live sequence, by kind."""
  full = z * width
  return {
      # First token; ends on a page's last row; starts a page; mid-page; empty; the full table.
      "decode": [(1, 0), (1, z - 1), (1, z), (1, 2 * z + 3), (0, 5), (1, full - 1)],
      # Whole pages; part of one; pages and a part; a chunk after a context, ending mid-page.
      "prefill": [(z, 0), (3, 0), (2 * z + 5, 0), (z + 1, z + 2)],
      "mixed": [(1, 20), (z + 3, 5), (0, 0), (1, 0), (2 * z, z), (5, full - 5)],
  }


# (N, K, H, Z, W, KV dtype, sliding_window, batch); q, k_new, v_new are float32 (the CPU
# engine's activations) for every KV dtype.
SWEEP = [
    (9, 3, 64, 16, 6, jnp.float32, None, "mixed"),  # SmolLM2-135M, GQA 3
    (9, 3, 64, 8, 10, jnp.bfloat16, None, "decode"),
    (4, 4, 64, 32, 3, jnp.float32, None, "prefill"),  # GQA 1
    (16, 4, 64, 8, 10, jnp.int8, None, "mixed"),  # GQA 4
    (4, 1, 256, 16, 5, jnp.bfloat16, 20, "mixed"),  # Gemma 3 270M: head_dim 256, local window
    (9, 3, 64, 32, 3, jnp.int8, 40, "decode"),  # window over pages
    (6, 2, 128, 16, 6, jnp.float8_e4m3fn, 24, "mixed"),
    (6, 2, 64, 16, 4, jnp.float8_e5m2, None, "prefill"),
    (3, 1, 80, 16, 4, jnp.float32, 10, "prefill"),  # head_dim 80 (lanes padded), window < page
]


def _step(config, seed: int = 0, q_dtype=jnp.float32):
  n, k, h, z, width, dtype, _, kind = config
  batch = _batches(z, width)[kind]
  shape = ragged_testing.KernelShape(n, k, h, z, width, dtype)
  args, kw = ragged_testing.step_inputs(np.random.default_rng(seed + h + z), batch, shape,
                                        num_tokens=sum(q for q, _ in batch) + 5,  # 5 padding
                                        num_seqs_max=len(batch) + 2)  # 2 past num_seqs
  args[:3] = [a.astype(q_dtype) for a in args[:3]]
  return args, kw, batch


def _check(args, kw, batch, window, isa="auto", tol=TOLERANCE, **extra):
  """Runs kernel and reference; asserts outputs within tol, padding rows 0, pages bit-equal,
  every page no sequence owns and the other layer untouched. Returns the largest error."""
  out, pages = kernels_cpu.ragged_paged_attention(*args, **kw, sliding_window=window, isa=isa,
                                                  **extra)
  ref_out, ref_pages = ragged_reference.ragged_paged_attention_reference(
      *args, **kw, sliding_window=window, **extra)  # float8's scales, or attend_until
  assert out.shape == args[0].shape and out.dtype == args[0].dtype
  assert pages.shape == args[3].shape and pages.dtype == args[3].dtype
  real = sum(q for q, _ in batch)
  out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
  np.testing.assert_allclose(out[:real], ref_out[:real], atol=tol, rtol=tol)
  assert not np.any(out[real:])
  np.testing.assert_array_equal(np.asarray(pages, np.float32), np.asarray(ref_pages, np.float32))
  z = args[3].shape[-2]
  owned = ragged_testing.owned_pages(args[4], args[6], len(batch), z)
  unowned = np.setdiff1d(np.arange(args[3].shape[-3]), owned)
  assert np.all(ragged_testing.is_filler(np.asarray(pages)[..., unowned, :, :]))
  if args[3].ndim == 4:
    np.testing.assert_array_equal(np.asarray(pages[0], np.float32),
                                  np.asarray(args[3][0], np.float32))
  return float(np.max(np.abs(out[:real] - ref_out[:real])))


@pytest.mark.parametrize("config", SWEEP, ids=lambda c: f"n{c[0]}k{c[1]}h{c[2]}z{c[3]}-"
                         f"{jnp.dtype(c[5]).name}-w{c[6]}-{c[7]}")
def test_kernel_matches_reference(config):
  args, kw, batch = _step(config)
  _check(args, kw, batch, config[6])


@pytest.mark.parametrize("config", [SWEEP[0], SWEEP[4], SWEEP[7]],
                         ids=lambda c: f"{jnp.dtype(c[5]).name}-w{c[6]}-{c[7]}")
def test_each_rows_reach(config):
  """attend_until: spans of each prefill's new tokens (Gemma 3's images) see up to the span's
  end, through items and chunks, as the reference (whose keys a hand-worked test pins)."""
  args, kw, batch = _step(config)
  until = ragged_testing.image_reach(np.random.default_rng(1), batch, args[0].shape[0])
  _check(args, kw, batch, config[6], attend_until=until)
  causal, _ = ragged_reference.ragged_paged_attention_reference(*args, **kw,
                                                               sliding_window=config[6])
  reached, _ = kernels_cpu.ragged_paged_attention(*args, **kw, sliding_window=config[6],
                                                  attend_until=until)
  assert np.abs(np.asarray(reached) - np.asarray(causal)).max() > 1e-3


@pytest.mark.parametrize("isa", library.supported_isas())
def test_every_instruction_set_matches_reference(isa):
  config = (8, 2, 64, 16, 5, jnp.int8, 30, "mixed")
  args, kw, batch = _step(config, seed=1)
  _check(args, kw, batch, config[6], isa=isa)


def test_bfloat16_queries_match_to_bfloat16_rounding():
  """q in bfloat16: both compute in float32 and round the output to bfloat16 last."""
  config = SWEEP[1]
  args, kw, batch = _step(config, seed=2, q_dtype=jnp.bfloat16)
  _check(args, kw, batch, config[6], tol=1e-2)


def test_float8_per_tensor_scales_match_the_reference():
  args, kw, batch = _step((8, 2, 128, 32, 3, jnp.float8_e4m3fn, None, "decode"), seed=3)
  _check(args, kw, batch, None, k_scale=4.0, v_scale=0.25)


def test_single_layer_pages_without_layer():
  shape = ragged_testing.KernelShape(4, 2, 64, 8, 4, num_layers=1)
  batch = [(2, 7), (1, 0), (4, 3)]
  args, _ = ragged_testing.step_inputs(np.random.default_rng(4), batch, shape, num_tokens=9,
                                       num_seqs_max=3, layer=0)
  args[3] = args[3][0]  # [P, Z, Cr]
  _check(args, {}, batch, None)


def test_a_step_of_only_padding_writes_nothing_and_gives_zeros():
  args, kw, _ = _step(SWEEP[0], seed=5)
  args[7] = jnp.int32(0)  # No live sequence: every table, length and token is ignored.
  out, pages = kernels_cpu.ragged_paged_attention(*args, **kw)
  assert not np.any(np.asarray(out))
  np.testing.assert_array_equal(np.asarray(pages), np.asarray(args[3]))


def test_the_cache_is_aliased_and_the_layer_traced():
  """Under jit with the cache donated, the call writes the pages in place (the custom call
  aliases them), and `layer` is a traced scalar: one program serves every layer."""
  args, kw, batch = _step(SWEEP[0], seed=6)
  step = jax.jit(lambda *a, layer: kernels_cpu.ragged_paged_attention(*a, layer=layer),
                 donate_argnums=3)
  assert "output_operand_aliases" in step.lower(*args, **kw).as_text()
  expected = ragged_reference.ragged_paged_attention_reference(*args, **kw)
  out, pages = step(*args, **kw)
  np.testing.assert_allclose(out, expected[0], atol=TOLERANCE, rtol=TOLERANCE)
  np.testing.assert_array_equal(np.asarray(pages), np.asarray(expected[1]))


def test_the_wrapper_refuses_bad_arguments_naming_them():
  args, kw, _ = _step(SWEEP[0], seed=7)
  with pytest.raises(ValueError, match="kv_pages lanes"):
    kernels_cpu.ragged_paged_attention(*args[:3], args[3][..., :128], *args[4:], **kw)
  with pytest.raises(ValueError, match="isa"):
    kernels_cpu.ragged_paged_attention(*args, **kw, isa="neon")
  with pytest.raises(ValueError, match="k_scale and v_scale are for float8"):
    kernels_cpu.ragged_paged_attention(*args, **kw, k_scale=2.0)

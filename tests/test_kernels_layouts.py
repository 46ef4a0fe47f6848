"""The decode kernels on every paged KV layout and storage type, read in place.

Each case stores random K/V in one layout (head-major, interleaved or token-major) and type
(bfloat16, int8 with per-position-per-head scales, float8 e4m3), then runs a kernel variant (TPU
or GPU, Pallas interpret mode) on the stored arrays. The expected output is the jnp reference on
token-major float32 pages decoded here, independently of the kernels (numpy values times
scales). Pages no sequence owns, scratch page 0 included, hold NaN (int8: a NaN scale), and with
`layer` the other layer is all NaN: a kernel that read any of them would return NaN.
Each layout and type also lowers to the TPU and CUDA kernel calls through jax.export, and an
engine cache reaches the kernel through attention.attend as stored.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas import PageLayout, gpu_decode, reference, testing, tpu_decode

# Token-major float32/bfloat16 pages are tests/test_kernels_decode.py's. float32 reads like
# bfloat16 (a cast), so bfloat16 stands for both.
CASES = [(layout, kind) for layout in PageLayout for kind in ("bfloat16", "int8", "float8")
         if not (layout is PageLayout.TOKEN_MAJOR and kind == "bfloat16")]
# (num_heads, num_kv_heads, head_dim, page_size, pages_per_seq, layer): GQA 3 and 4, page sizes
# 8 and 16, the second reading layer 1 of a two-layer cache.
SHAPES = [(6, 2, 16, 8, 4, None), (8, 2, 32, 16, 3, 1)]
# The reference reads the very values the kernels decode (rounded once, here), so the tolerance
# only covers summation order.
TOL = 2e-5
STORED = {"bfloat16": ml_dtypes.bfloat16, "float8": ml_dtypes.float8_e4m3fn}


def _quantize(x, kind, rng):
  """Token-major x [P, Z, K, H] -> (stored values, scale [P, Z, K, 1] or None, decoded f32)."""
  if kind == "int8":
    amax = np.abs(x).max(-1, keepdims=True)  # [P, Z, K, 1]
    scale = (amax / 127 * rng.uniform(1, 1.5, amax.shape)).astype(np.float32)
    values = np.clip(np.round(x / scale), -127, 127).astype(np.int8)
    return values, scale, values.astype(np.float32) * scale
  values = x.astype(STORED[kind])
  return values, None, values.astype(np.float32)


def _store(layout, k, v):
  """Token-major [P, Z, K, X] K and V -> the layout's (k_pages, v_pages)."""
  if layout is PageLayout.HEAD_MAJOR:
    return np.transpose(k, (2, 0, 1, 3)), np.transpose(v, (2, 0, 1, 3))  # [K, P, Z, X]
  if layout is PageLayout.KV_INTERLEAVED:
    return np.stack([k, v], axis=1), None  # [P, 2, Z, K, X]
  return k, v


def _junk(a):
  """A layer nobody may read: NaN, or for int8 values the largest int (their scales are NaN)."""
  return np.full_like(a, 127) if a.dtype == np.int8 else np.full_like(a, np.nan)


def _case(layout, kind, shape_cfg, seed):
  """(kernel args, kernel kwargs, reference args) of one case."""
  num_heads, num_kv_heads, head_dim, page_size, width, layer = shape_cfg
  shape = testing.PagedShape(num_heads, num_kv_heads, head_dim, page_size, width)
  rng = np.random.default_rng(seed)
  lengths = [1, page_size, page_size + 1, shape.max_len]  # 1, a page boundary, one past, full.
  q, _, _, tables, lens = testing.decode_inputs(rng, lengths, shape)
  num_pages = int(np.asarray(tables).max()) + 3  # Two spare pages, besides scratch page 0.
  size = (num_pages, page_size, num_kv_heads, head_dim)
  (kq, ks, kf), (vq, vs, vf) = (_quantize(2 * rng.standard_normal(size), kind, rng)
                                for _ in range(2))
  owned = np.concatenate([np.asarray(tables[b, :-(-n // page_size)])
                          for b, n in enumerate(lengths)])
  unowned = np.setdiff1d(np.arange(num_pages), owned)
  assert 0 in unowned and len(unowned) == 3
  for x in (ks, vs) if ks is not None else (kq, vq):  # int8 has no NaN: poison its scales.
    x[unowned] = np.nan
  arrays = [*_store(layout, kq, vq), *(_store(layout, ks, vs) if ks is not None else (None,) * 2)]
  if layer is not None:  # Layer 0 is junk; the kernels must read layer 1 only.
    arrays = [None if a is None else np.stack([_junk(a), a]) for a in arrays]
  k_pages, v_pages, k_scale, v_scale = [None if a is None else jnp.asarray(a) for a in arrays]
  kwargs = dict(k_scale=k_scale, v_scale=v_scale, layout=layout,
                layer=None if layer is None else jnp.int32(layer))
  return (q, k_pages, v_pages, tables, lens), kwargs, (q, jnp.asarray(kf), jnp.asarray(vf),
                                                       tables, lens)


VARIANTS = {"tpu": tpu_decode.paged_decode_attention, "gpu": gpu_decode.paged_decode_attention}


# Each case runs on one shape per variant, the two variants on different shapes, so every
# layout, type and variant meets both shapes while each compiles only once.
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{l.name}-{k}" for l, k in CASES])
def test_kernel_reads_the_stored_layout(case, platform):
  layout, kind = CASES[case]
  shape_cfg = SHAPES[(case + (platform == "gpu")) % 2]
  args, kwargs, ref_args = _case(layout, kind, shape_cfg, seed=case)
  # Two pages per chunk: the sequences span one chunk, or several with a ragged last one.
  out = VARIANTS[platform](*args, **kwargs, pages_per_chunk=2, interpret=True)
  expected = reference.paged_decode_reference(*ref_args)
  assert out.shape == args[0].shape and out.dtype == args[0].dtype
  np.testing.assert_allclose(out, expected, atol=TOL, rtol=TOL)


def _bad(args, kwargs, **changes):
  """Calls the public decode with some arguments replaced."""
  q, k, v, tables, lens = args
  named = dict(q=q, k_pages=k, v_pages=v, page_tables=tables, lengths=lens, **kwargs)
  named.update(changes)
  kernels_pallas.paged_decode_attention(**named, platform="tpu", interpret=True)


def test_bad_layout_arguments_raise_value_error_naming_them():
  args, kwargs, _ = _case(PageLayout.HEAD_MAJOR, "int8", SHAPES[0], seed=0)
  k, v, ks = args[1], args[2], kwargs["k_scale"]
  for name, change in [("k_pages", dict(k_pages=k[0])), ("v_pages", dict(v_pages=v[:, :2])),
                       ("k_scale", dict(k_scale=None)), ("k_scale", dict(k_scale=ks[..., 0])),
                       ("v_scale", dict(v_scale=None)), ("k_pages", dict(layer=jnp.int32(0))),
                       ("layout", dict(layout="head_major"))]:
    with pytest.raises(ValueError, match=name):
      _bad(args, kwargs, **change)
  args, kwargs, _ = _case(PageLayout.KV_INTERLEAVED, "bfloat16", SHAPES[0], seed=0)
  with pytest.raises(ValueError, match="v_pages"):
    _bad(args, kwargs, v_pages=args[1])


TRITON_CALL = "__gpu$xla.gpu.triton"
TARGETS = {"tpu": ("tpu", "tpu_custom_call"), "gpu": ("cuda", TRITON_CALL)}


def _abstract(layout, kind, num_pages=64, page_size=16, num_kv_heads=4, head_dim=128, layers=2):
  """ShapeDtypeStructs of a whole [L, ...] cache of `layout`: (k_pages, v_pages, scales)."""
  size = (num_pages, page_size, num_kv_heads, head_dim)
  dtype = {"int8": jnp.int8, "float8": jnp.float8_e4m3fn, "bfloat16": jnp.bfloat16}[kind]
  k, v = _store(layout, np.empty(size, np.int8), np.empty(size, np.int8))
  spec = lambda a, d, last: (None if a is None else
                             jax.ShapeDtypeStruct((layers, *a.shape[:-1], last), d))
  scales = [spec(k, jnp.float32, 1), spec(v, jnp.float32, 1)] if kind == "int8" else [None, None]
  return spec(k, dtype, head_dim), spec(v, dtype, head_dim), *scales


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{l.name}-{k}" for l, k in CASES])
def test_decode_lowers_to_the_kernel_custom_call(case, platform):
  """Mosaic's and Triton's front ends accept every layout and type (8 sequences, bf16 q with
  Llama-like heads, 32 query heads over 4 KV heads, reading layer 1 of a 2-layer cache)."""
  layout, kind = CASES[case]
  k, v, ks, vs = _abstract(layout, kind)
  q = jax.ShapeDtypeStruct((8, 32, 128), jnp.bfloat16)
  tables = jax.ShapeDtypeStruct((8, 16), jnp.int32)
  lengths = jax.ShapeDtypeStruct((8,), jnp.int32)
  fn = lambda q, k, v, t, n, ks, vs, layer: kernels_pallas.paged_decode_attention(
      q, k, v, t, n, k_scale=ks, v_scale=vs, layout=layout, layer=layer, platform=platform)
  target, call = TARGETS[platform]
  disabled = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
  exported = jax.export.export(jax.jit(fn), platforms=[target], disabled_checks=disabled)(
      q, k, v, tables, lengths, ks, vs, jax.ShapeDtypeStruct((), jnp.int32))
  calls = set(re.findall(r"stablehlo\.custom_call @([^\(\s]+)\(", exported.mlir_module()))
  assert call in calls

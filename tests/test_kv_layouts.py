"""Every KV layout and KV dtype against the float32 token-major reference.

Cache level: what is written at a slot is what gather reads back, within the storage type's
rounding, and padding writes to the scratch page never show. Engine level: each layout through
chunked prefill + decode (the jnp step) gives the reference's tokens and logprobs. Quantized
dtypes: teacher-forced logits of a full forward against the float32 cache's. Pallas: the ragged
kernel runs on the RAGGED layout only, and the engine says so for any other.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.batching.plan import PrefillChunk
from jaxserve.config import AttentionBackend, EngineConfig, KVDtype, KVLayout, SamplingParams
from jaxserve.config.engine import RAGGED_KV_DTYPES
from jaxserve.engine.engine import Engine
from jaxserve.engine.kv_spec import create_one_group, create_pool, slot_page_tables
from jaxserve.model.attention import AttentionMetadata
from support.engine_calls import decode, prefill
from support.tiny import TINY, TINY_ENGINE

GREEDY = SamplingParams(temperature=0, logprobs=20)  # The top-20 logprobs are compared below.
SMALL = EngineConfig(num_slots=3, page_size=4, num_pages=12, max_model_len=16,
                     compilation_cache_dir=None)
# Worst-case round-trip error of one value of magnitude <= amax (here amax ~ 4 for N(0, 1) data):
# bf16 keeps 8 bits of mantissa (relative 2^-8), int8 rounds to steps of 2^e < 2 * amax / 127
# (half a step), float8 e4m3 keeps 3 bits (relative 2^-4), e5m2 2 bits (2^-3).
ROUND_TRIP_TOL = {KVDtype.FLOAT32: 0.0, KVDtype.BFLOAT16: 4 * 2**-8, KVDtype.FLOAT16: 4 * 2**-11,
                  KVDtype.INT8: 4.5 / 127, KVDtype.FLOAT8_E4M3: 4.5 * 2**-4,
                  KVDtype.FLOAT8_E5M2: 4.5 * 2**-3}


def _written_cache(layout, kv_dtype, rng):
  """A SMALL cache with random K/V [2, 16, K, H] written for two sequences at layer 1, then a
  scratch-page write of 1e3 that must never be read back. Returns (cache, tables, k, v)."""
  engine = dataclasses.replace(SMALL, kv_layout=layout, kv_dtype=kv_dtype)
  cache = create_pool(TINY, engine)
  if layout is KVLayout.CONTIGUOUS:
    tables = slot_page_tables(engine)[[2, 0]]  # Sequences in slots 2 and 0.
  else:
    tables = np.array([[3, 5, 1, 7], [2, 4, 6, 8]], np.int32)
  pos = np.arange(16)
  slots = tables[:, pos // 4] * 4 + pos % 4  # [2, 16]
  shape = (2, 16, TINY.num_kv_heads, TINY.head_dim)
  k, v = (rng.standard_normal(shape).astype(np.float32),
          rng.standard_normal(shape).astype(np.float32))
  cache = jax.jit(lambda c: c.write(1, jnp.asarray(slots), k, v))(cache)
  junk = jnp.full((2, 3, *shape[2:]), 1e3)
  cache = cache.write(1, jnp.zeros((2, 3), jnp.int32), junk, junk)
  return cache, tables, k, v


# Every pair but the ragged layout's float16, which it refuses (test_ragged_layout_refuses_float16).
PAIRS = [(layout, kv_dtype) for layout in KVLayout for kv_dtype in KVDtype
         if layout is not KVLayout.RAGGED or kv_dtype in RAGGED_KV_DTYPES]


@pytest.mark.parametrize("layout, kv_dtype", PAIRS)
def test_write_then_gather_round_trips(layout, kv_dtype):
  cache, tables, k, v = _written_cache(layout, kv_dtype, np.random.default_rng(0))
  tol = ROUND_TRIP_TOL[kv_dtype] * np.maximum(1, np.abs(k))
  gk, gv = cache.gather(1, jnp.asarray(tables))
  assert np.all(np.abs(np.asarray(gk, np.float32) - k) <= tol)
  assert np.all(np.abs(np.asarray(gv, np.float32) - v)
                <= ROUND_TRIP_TOL[kv_dtype] * np.maximum(1, np.abs(v)))


def _int8_head_values():
  """Head 0: 0, 0.5, .., 7.5: amax 7.5, e = ceil(log2(7.5 / 127)) = -4, so ints 0, 8, .., 120.
  Head 1: all -2.0: e = ceil(log2(2 / 127)) = -5, ints -64. Both exact."""
  k = np.zeros((1, 1, TINY.num_kv_heads, TINY.head_dim), np.float32)
  k[0, 0, 0], k[0, 0, 1] = np.arange(16) * 0.5, -2.0
  return k


def test_int8_scale_is_per_token_and_head():
  cache = create_pool(TINY, dataclasses.replace(SMALL, kv_dtype=KVDtype.INT8))
  k = _int8_head_values()
  cache = cache.write(0, jnp.array([[5]]), k, k)  # Page 1, offset 1.
  np.testing.assert_array_equal(np.asarray(cache.k_scale[0, 1, 1, :, 0]), [-4, -5])
  np.testing.assert_array_equal(np.asarray(cache.k[0, 1, 1, 0]), np.arange(16) * 8)
  np.testing.assert_array_equal(np.asarray(cache.k[0, 1, 1, 1]), np.full(16, -64))
  assert cache.k.dtype == cache.k_scale.dtype == jnp.int8
  gk, _ = cache.gather(0, jnp.array([[1]]))
  np.testing.assert_array_equal(np.asarray(gk[0, 1]), k[0, 0])


def test_ragged_int8_row_holds_values_then_exponents():
  """TINY's ragged row: K heads (lanes 0-31), V heads (32-63), then the exponents of K heads 0,
  1 and V heads 0, 1 (lanes 64-67), zeros to 128."""
  engine = dataclasses.replace(SMALL, kv_dtype=KVDtype.INT8, kv_layout=KVLayout.RAGGED)
  cache = create_pool(TINY, engine)
  k = _int8_head_values()
  cache = cache.write(0, jnp.array([[5]]), k, k / 4)  # V: exponents 2 lower, same ints.
  row = np.asarray(cache.k[0, 1, 1])  # [Cr]
  assert row.shape == (128,) and cache.k_scale is None
  np.testing.assert_array_equal(row[:32], np.r_[np.arange(16) * 8, np.full(16, -64)])
  np.testing.assert_array_equal(row[32:64], row[:32])
  np.testing.assert_array_equal(row[64:], np.r_[[-4, -5, -6, -7], np.zeros(60)])
  gk, gv = cache.gather(0, jnp.array([[1]]))
  np.testing.assert_array_equal(np.asarray(gv[0, 1]), k[0, 0] / 4)


def test_bytes_follow_the_capacity_arithmetic():
  """Bytes per token slot: 2 (K, V) * L * K * (H * value bytes + scale bytes), as capacity.py;
  the ragged layout's rows of 128 lanes (TINY: 64 values + int8's 4 exponents) as its
  lane_groups count says, under tp too."""
  from jaxserve.planning import capacity
  for kv_dtype in KVDtype:
    cache = create_pool(TINY, dataclasses.replace(SMALL, kv_dtype=kv_dtype))
    assert cache.num_bytes == 12 * 4 * capacity.kv_bytes_per_token(TINY, kv_dtype)
  for kv_dtype, tp in [(d, tp) for d in RAGGED_KV_DTYPES for tp in (1, 2)]:
    engine = dataclasses.replace(SMALL, kv_dtype=kv_dtype, kv_layout=KVLayout.RAGGED, tp=tp)
    cache = create_pool(TINY, engine)
    assert cache.num_bytes == 12 * 4 * capacity.kv_bytes_per_token(TINY, kv_dtype, tp)
    assert cache.num_bytes == 12 * 4 * 2 * 128 * tp * kv_dtype.value_bytes
  contiguous = create_pool(TINY, dataclasses.replace(SMALL, kv_layout=KVLayout.CONTIGUOUS))
  assert contiguous.num_bytes == 3 * 16 * capacity.kv_bytes_per_token(TINY, KVDtype.FLOAT32)
  assert contiguous.num_pages == 1 + 3 * 4


def _chunk(slot, ids, start, table, last, prompt=()):
  return PrefillChunk("r", slot, ids, start, table, last, GREEDY, 0, prompt, ())


def _engine_run(model, config):
  """Two sequences, one prefilled in two chunks, then 6 decode steps: (tokens, logprobs)."""
  engine = Engine(model, config)
  rng = np.random.default_rng(0)
  a, b = list(rng.integers(2, 128, 21)), list(rng.integers(2, 128, 9))
  Z = config.page_size
  n_a, n_b = -(-40 // Z), -(-20 // Z)  # Pages for the prompt plus what decode adds.
  tables = np.zeros((4, n_a), np.int32)
  tables[0], tables[2, :n_b] = np.arange(1, n_a + 1)[::-1], n_a + 1 + np.arange(n_b)
  out = [prefill(engine, _chunk(0, a[:13], 0, tables[0], False)),
         prefill(engine, _chunk(0, a[13:], 13, tables[0], True, a)),
         prefill(engine, _chunk(2, b, 0, tables[2], True, b))]
  out += [decode(engine, [0, 2], tables) for _ in range(6)]
  tokens = [o.result() for o in out[1:]]
  logprobs = [o.logprobs()[2] for o in out[1:]]  # Top-20 logprobs of every sampled row.
  return (np.concatenate([t.reshape(-1) for t in tokens]),
          np.concatenate([l.reshape(-1) for l in logprobs]))


# One prefill bucket and one decode width: two compilations per engine.
ENGINE = dataclasses.replace(TINY_ENGINE, max_model_len=64, prefill_buckets=(32,))


@pytest.fixture(scope="module")
def reference_run(tiny_model):
  return _engine_run(tiny_model, ENGINE)


@pytest.mark.parametrize("layout, page_size", [
    (KVLayout.PAGED_TOKEN_MAJOR, 32), (KVLayout.CONTIGUOUS, 8), (KVLayout.RAGGED, 8)])
def test_engine_layouts_match_the_reference(tiny_model, reference_run, layout, page_size):
  """Contiguous: the engine swaps the given tables for the slots' own regions."""
  config = dataclasses.replace(ENGINE, kv_layout=layout, page_size=page_size)
  tokens, logprobs = _engine_run(tiny_model, config)
  np.testing.assert_array_equal(tokens, reference_run[0])
  np.testing.assert_allclose(logprobs, reference_run[1], atol=2e-5)


def forward_logits(model, ids, layout=KVLayout.PAGED_TOKEN_MAJOR, kv_dtype=KVDtype.FLOAT32,
                   page_size: int = 8):
  """Teacher-forced logits [T, V] of one forward over ids (T a multiple of page_size), reading
  back the K/V it writes, in the given layout and storage type."""
  n = ids.shape[0]
  pages = n // page_size
  engine = EngineConfig(num_slots=1, page_size=page_size, num_pages=pages + 1,
                        max_model_len=n, prefill_buckets=(n,), kv_layout=layout, kv_dtype=kv_dtype)
  meta = AttentionMetadata.one_sequence(n, page_size)
  logits, _ = model(ids[None], create_one_group(model.cfg, engine), meta, last_only=False)
  return logits[0]


_forward = nnx.jit(forward_logits, static_argnums=(2, 3, 4))


# Max logit error as a fraction of the largest logit (about 60 on this model, std 9): bf16 and
# int8 keep ~8 bits (int8 per token-head, so a little worse), float8 e4m3 only 4.
@pytest.mark.parametrize("kv_dtype, max_err, min_agree", [
    (KVDtype.BFLOAT16, 0.004, 0.98), (KVDtype.INT8, 0.006, 0.98),
    (KVDtype.FLOAT8_E4M3, 0.04, 0.9)])
def test_quantized_kv_logits_stay_close(tiny_model, kv_dtype, max_err, min_agree):
  ids = jnp.asarray(np.random.default_rng(3).integers(2, 128, 64), jnp.int32)
  ref = np.asarray(_forward(tiny_model, ids, KVLayout.PAGED_TOKEN_MAJOR, KVDtype.FLOAT32, 8))
  got = np.asarray(_forward(tiny_model, ids, KVLayout.PAGED_TOKEN_MAJOR, kv_dtype, 8))
  err = np.abs(got - ref).max() / np.abs(ref).max()
  agree = np.mean(got.argmax(-1) == ref.argmax(-1))
  assert 0 < err < max_err, err  # Not 0: the storage type really rounds.
  assert agree >= min_agree


# The Pallas backend is the ragged kernel, which reads and writes the RAGGED layout in place
# (tests/test_backend_pallas.py); the other layouts run on the jnp path only.
@pytest.mark.parametrize("layout", [KVLayout.PAGED_TOKEN_MAJOR, KVLayout.CONTIGUOUS])
def test_pallas_backend_refuses_other_layouts(tiny_model, layout):
  engine = Engine(tiny_model, dataclasses.replace(ENGINE, kv_layout=layout,
                                                  attention_backend=AttentionBackend.PALLAS))
  with pytest.raises(ValueError, match="ragged KV layout"):
    prefill(engine, _chunk(0, [3, 4, 5], 0, [1], True, [3, 4, 5]))


def test_ragged_layout_refuses_float16():
  with pytest.raises(ValueError, match="not float16"):
    create_pool(TINY, dataclasses.replace(SMALL, kv_layout=KVLayout.RAGGED,
                                             kv_dtype=KVDtype.FLOAT16))

"""The Pallas attention backend (interpret mode on CPU), and kernels_cpu's C++ ragged kernel
(`--attention cpu`), against the reference backend, in the engine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kernels_cpu
from jaxserve.batching.plan import PrefillChunk
from jaxserve.config import AttentionBackend, EngineConfig, KVDtype, KVLayout, SamplingParams
from jaxserve.config.engine import RAGGED_KV_DTYPES
from jaxserve.engine.engine import Engine
from jaxserve.engine.resolve import default_backend, engine_config_for
from support.engine_calls import decode, prefill
from support.tiny import TINY_ENGINE

GREEDY = SamplingParams(temperature=0, logprobs=1)  # Logprobs are computed only when asked.


def run(model, backend):
  """Prefill a 20-token prompt (3 pages, over a page boundary), a second prompt reusing its first
  page as a cached prefix, then decode both; returns every sampled token and logprob."""
  engine = Engine(model, dataclasses.replace(TINY_ENGINE, attention_backend=backend))
  rng = np.random.default_rng(3)
  a = list(rng.integers(2, 128, 20))
  b = a[:8] + list(rng.integers(2, 128, 5))
  out = [prefill(engine, PrefillChunk("a", 0, a, 0, [1, 2, 3], True, GREEDY, 0, a, ())),
         prefill(engine, PrefillChunk("b", 1, b[8:], 8, [1, 4], True, GREEDY, 0, b, ()))]
  tables = np.zeros((4, 4), np.int32)
  tables[0, :3], tables[1, :2] = [1, 2, 3], [1, 4]
  out += [decode(engine, [0, 1], tables) for _ in range(4)]
  return [f.result()[:2] for f in out], [f.logprobs()[0][:2] for f in out]


KERNELS = [AttentionBackend.PALLAS,
           pytest.param(AttentionBackend.CPU, marks=pytest.mark.skipif(
               not kernels_cpu.available(), reason="kernels_cpu not built"))]


@pytest.mark.parametrize("backend", KERNELS, ids=lambda b: b.value)
def test_pallas_backend_matches_reference(tiny_model, backend):
  ref_tokens, ref_lps = run(tiny_model, AttentionBackend.REFERENCE)
  tokens, lps = run(tiny_model, backend)
  for r, t in zip(ref_tokens, tokens):
    np.testing.assert_array_equal(r, t)
  np.testing.assert_allclose(np.concatenate(lps), np.concatenate(ref_lps), atol=1e-4)


def test_backend_is_picked_from_the_platform():
  assert default_backend(EngineConfig()) is AttentionBackend.REFERENCE  # A CPU-only machine.


def run_8bit_kv(model, backend, kv_dtype):
  """Two prompts in pages of 32 (TPU tiles 8-bit rows by 32), then 4 decode steps, over 8-bit KV
  in the ragged layout: every sampled token and logprob."""
  config = dataclasses.replace(TINY_ENGINE, page_size=32, kv_dtype=kv_dtype,
                               kv_layout=KVLayout.RAGGED, attention_backend=backend)
  engine, rng = Engine(model, config), np.random.default_rng(4)
  a, b = list(rng.integers(2, 128, 20)), list(rng.integers(2, 128, 13))
  out = [prefill(engine, PrefillChunk("a", 0, a, 0, [1], True, GREEDY, 0, a, ())),
         prefill(engine, PrefillChunk("b", 1, b, 0, [2], True, GREEDY, 0, b, ()))]
  tables = np.zeros((4, 4), np.int32)
  tables[0, 0], tables[1, 0] = 1, 2
  out += [decode(engine, [0, 1], tables) for _ in range(4)]
  return [f.result()[:2] for f in out], [f.logprobs()[0][:2] for f in out]


@pytest.mark.parametrize("kv_dtype", [KVDtype.INT8, KVDtype.FLOAT8_E5M2], ids=lambda d: d.label)
@pytest.mark.parametrize("backend", KERNELS, ids=lambda b: b.value)
def test_pallas_backend_matches_reference_on_8bit_kv(tiny_model, kv_dtype, backend):
  """The kernel (TPU variant, interpreted; or the C++ one) and the jnp path store the same 8-bit
  pages and read them back alike: the same tokens and logprobs as the jnp path over the same
  layout."""
  ref_tokens, ref_lps = run_8bit_kv(tiny_model, AttentionBackend.REFERENCE, kv_dtype)
  tokens, lps = run_8bit_kv(tiny_model, backend, kv_dtype)
  for r, t in zip(ref_tokens, tokens):
    np.testing.assert_array_equal(r, t)
  np.testing.assert_allclose(np.concatenate(lps), np.concatenate(ref_lps), atol=1e-4)


PALLAS = [AttentionBackend.PALLAS, AttentionBackend.PALLAS_TPU, AttentionBackend.PALLAS_GPU]
QUANTIZED = [KVDtype.FLOAT16]  # The only KVDtype the ragged layout does not store.


@pytest.mark.parametrize("backend", PALLAS, ids=lambda b: b.value)
@pytest.mark.parametrize("kv_dtype", QUANTIZED, ids=lambda d: d.label)
def test_pallas_backend_refuses_kv_dtypes_the_ragged_layout_cannot_store(tiny_model, backend,
                                                                          kv_dtype):
  """At configuration time, naming the dtype and the way out, not inside the first step."""
  named = (f"stores float32, bfloat16, int8, float8_e4m3, float8_e5m2, not {kv_dtype.label}; "
           "use --attention reference")
  with pytest.raises(ValueError, match=named):
    dataclasses.replace(TINY_ENGINE, kv_dtype=kv_dtype, attention_backend=backend)
  config = dataclasses.replace(TINY_ENGINE, kv_dtype=kv_dtype)  # Backend left to the platform.
  with pytest.raises(ValueError, match=named):
    engine_config_for(config, backend)
  # The reference backend stores every dtype: the same config builds an engine there.
  engine = Engine(tiny_model,
                  dataclasses.replace(config, attention_backend=AttentionBackend.REFERENCE))
  assert engine.config.kv_layout is KVLayout.PAGED_TOKEN_MAJOR


@pytest.mark.parametrize("kv_dtype", RAGGED_KV_DTYPES, ids=lambda d: d.label)
def test_pallas_backend_takes_float_and_8bit_kv(kv_dtype):
  config = dataclasses.replace(TINY_ENGINE, kv_dtype=kv_dtype,
                               attention_backend=AttentionBackend.PALLAS)
  assert engine_config_for(config, AttentionBackend.PALLAS).kv_layout is KVLayout.RAGGED

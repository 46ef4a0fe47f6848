"""The Pallas attention backend (interpret mode on CPU) against the reference backend, in the engine."""

from __future__ import annotations

import dataclasses

import numpy as np
from conftest import TINY_ENGINE

from jaxserve.batching.plan import PrefillChunk
from jaxserve.config import AttentionBackend, SamplingParams
from jaxserve.engine.engine import Engine, default_backend

GREEDY = SamplingParams(temperature=0, logprobs=1)  # Logprobs are computed only when asked.


def run(model, backend):
  """Prefill a 20-token prompt (3 pages, over a page boundary), a second prompt reusing its first
  page as a cached prefix, then decode both; returns every sampled token and logprob."""
  engine = Engine(model, dataclasses.replace(TINY_ENGINE, attention_backend=backend))
  rng = np.random.default_rng(3)
  a = list(rng.integers(2, 128, 20))
  b = a[:8] + list(rng.integers(2, 128, 5))
  out = [engine.prefill(PrefillChunk("a", 0, a, 0, [1, 2, 3], True, GREEDY, 0, a, ())),
         engine.prefill(PrefillChunk("b", 1, b[8:], 8, [1, 4], True, GREEDY, 0, b, ()))]
  tables = np.zeros((4, 4), np.int32)
  tables[0, :3], tables[1, :2] = [1, 2, 3], [1, 4]
  out += [engine.decode([0, 1], tables) for _ in range(4)]
  return [f.result()[:2] for f in out], [f.logprobs()[0][:2] for f in out]


def test_pallas_backend_matches_reference(tiny_model):
  ref_tokens, ref_lps = run(tiny_model, AttentionBackend.REFERENCE)
  tokens, lps = run(tiny_model, AttentionBackend.PALLAS)
  for r, t in zip(ref_tokens, tokens):
    np.testing.assert_array_equal(r, t)
  np.testing.assert_allclose(np.concatenate(lps), np.concatenate(ref_lps), atol=1e-4)


def test_backend_is_picked_from_the_platform():
  assert default_backend() is AttentionBackend.REFERENCE  # This machine is CPU-only.

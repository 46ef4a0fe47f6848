"""Quantized KV against float32 KV on the default model: `scripts/quality.py kv` at a size CI
affords (4 windows x 64 scored tokens of the committed peers_64 workload's prompts; the full
32 x 64 run over README windows is in BENCHMARKS.md). The windows are fixed token ids, not
README.md's text: scoring the README's first lines made this test fail on an edit of its test
command (int8's top-1 agreement 0.949 -> 0.9375).

Issue 24's bounds are top-1 agreement >= 98% and mean KL(float32 || quantized) <= 0.02. Measured
here (2026-12-02): int8 97.3% / 0.0022, float8_e4m3 93.4% / 0.0067, float8_e5m2 84.8% / 0.021.
So this test holds int8 and e4m3 to the KL bound, which they meet, and every dtype to floors a
little under what it measures on this harsher raw-text measure, so a regression shows. On the
issue's own measure (the float model's greedy continuations) int8 meets both bounds, asserted by
tests/test_real_model.py; float8 misses top-1 there too, with calibrated scales as well
(BENCHMARKS.md, "Quantized KV")."""

from __future__ import annotations

from jaxserve.config import KVDtype
from support import script_loader

quality = script_loader.load("quality")
# dtype: (lowest top-1 agreement, highest mean KL) at 4 windows.
FLOORS = {KVDtype.INT8: (0.96, 0.02), KVDtype.FLOAT8_E4M3: (0.92, 0.02),
          KVDtype.FLOAT8_E5M2: (0.83, 0.07)}


def test_8bit_kv_keeps_most_float32_kv_predictions(default_model):
  model, _ = default_model
  result = quality.compare_kv(model, quality.workload_windows(4), quality.QUANTIZED)
  for kv_dtype, (top1, kl) in FLOORS.items():
    r = result[kv_dtype.label]
    assert r["positions"] == 4 * 64
    assert r["top1_agreement"] >= top1, (kv_dtype, r)
    assert 0 < r["mean_kl"] <= kl, (kv_dtype, r)  # Not 0: the storage really rounds.
  # The encodings' precision orders them: int8 (7 bits a head), e4m3 (3 bits), e5m2 (2 bits).
  kl = [result[d.label]["mean_kl"] for d in quality.QUANTIZED]
  assert kl == sorted(kl)

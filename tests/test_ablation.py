"""The KV-layout ablation script: its --quick run on a tiny checkpoint, and its capacity count."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.config import KVDtype, KVLayout
from support import script_loader
from support.tiny import TINY

ablate = script_loader.load("ablate_cache_layout")

SETTINGS = ablate.Settings(num_requests=4, num_slots=2, max_model_len=64, prefill_bucket=32,
                           budget_bytes=0, timed_steps=1)


def test_sequences_that_fit_counts_blocks_by_hand():
  """TINY: 2 * 2 layers * 2 KV heads * 16 * 4 B = 512 B per token in float32, 128 B in int8 +
  2 * 2 * 2 * 1 B of scale exponents = 136 B. Budget 8 pages of 8 tokens (f32) = 32 KiB."""
  s = dataclasses.replace(SETTINGS, budget_bytes=8 * 8 * 512)
  work = [([1] * 20, 4)] * 5  # 24 tokens = 3 pages each, the prompt's 2 full pages shared:
  paged = ablate.Variant(KVLayout.PAGED_TOKEN_MAJOR, 8, KVDtype.FLOAT32)
  # the first takes 3 pages, each next one reuses the 2 cached pages and adds 1.
  assert ablate.sequences_that_fit(TINY, paged, work, s) == 5  # 3 + 1 + 1 + 1 + 1 = 7 <= 8.
  distinct = [([i] * 20, 4) for i in range(5)]
  assert ablate.sequences_that_fit(TINY, paged, distinct, s) == 2  # 3 + 3 <= 8 < 9.
  contiguous = ablate.Variant(KVLayout.CONTIGUOUS, 8, KVDtype.FLOAT32)
  assert ablate.sequences_that_fit(TINY, contiguous, work, s) == 1  # A slot is 64 tokens = 32 KiB.
  s2 = dataclasses.replace(s, budget_bytes=2 * 64 * 512)
  assert ablate.sequences_that_fit(TINY, contiguous, work, s2) == 2
  int8 = ablate.Variant(KVLayout.PAGED_TOKEN_MAJOR, 8, KVDtype.INT8)
  s3 = dataclasses.replace(s, budget_bytes=6 * 8 * 136)  # 6 int8 pages: two distinct sequences.
  assert ablate.sequences_that_fit(TINY, int8, distinct, s3) == 2


def test_workload_mixes_lengths_and_shared_prefixes():
  work = ablate.make_workload(np.random.default_rng(0), 50, 1000, 256)
  prompts = [p for p, _ in work]
  assert len({len(p) for p in prompts}) > 10 and len({n for _, n in work}) > 10
  assert all(len(p) + n <= 256 for p, n in work)
  firsts = [tuple(p[:32]) for p in prompts]
  assert max(firsts.count(f) for f in firsts) >= 5  # Some prompts share a system prefix.


def test_quick_ablation_writes_table_and_plots(tiny_checkpoint, tmp_path):
  out = tmp_path / "ablation"
  rows, tier_rows = ablate.run(ablate.argparse.Namespace(quick=True, model=str(tiny_checkpoint),
                                                         out=str(out)))
  table = (out / "results.md").read_text()
  assert (out / "fragmentation.png").stat().st_size > 1000
  assert (out / "summary.png").stat().st_size > 1000
  by_name = {r["variant"].name: r for r in rows}
  assert len(by_name) == len(ablate.QUICK) and all(name in table for name in by_name)
  for r in rows:
    float_layout = r["variant"].kv_dtype is KVDtype.FLOAT32
    # Every float32 layout computes the same attention: the reference's greedy tokens exactly.
    assert r["agree"] == 1.0 if float_layout else r["agree"] > 0.8
    assert r["err"] < (1e-3 if float_layout else 0.5)
    assert 0 <= np.mean(r["frag"]) < 1 and r["step_ms"] > 0
  contiguous = by_name["contiguous/16 float32"]
  paged = by_name["token-major/16 float32"]
  assert contiguous["hit"] == 0 and paged["hit"] > 0  # The workload shares prefixes.
  assert np.mean(contiguous["frag"]) > np.mean(paged["frag"])  # A slot holds max_len positions.
  assert contiguous["fit"] < paged["fit"] < by_name["token-major/16 int8"]["fit"]
  # The host tier on the chat whose prefixes the device pool cannot hold: hits from host memory
  # that the run without it recomputes, and the same greedy answers.
  assert "## Host tier" in table
  none, host = tier_rows
  assert (none["tier"], host["tier"]) == ("none", "host") and none["pool_ratio"] >= 4
  assert none["host_hit_rate"] == 0 == none["saved_tokens"] and host["host_hit_rate"] > 0
  assert host["prefill_tokens"] == none["prefill_tokens"] - host["saved_tokens"]
  assert host["same"] and host["ttft_mean_s"] > 0

"""Batch invariance on the tiny model through the real engine (scripts/check_determinism.py): every
greedy and seeded request gets exactly its tokens from a run alone, when it shares the batch with
other requests, reads a cached prefix, is prefilled in chunks, or is preempted and recomputed."""

from jaxserve.config import EngineConfig
from support import script_loader
from support import server_harness as h

cd = script_loader.load("check_determinism")


def test_outputs_do_not_depend_on_the_batch(tiny_checkpoint):
  model, tokenizer = h.load(str(tiny_checkpoint))
  # One prefill bucket and two decode widths (96 / 8 = 12 pages): few compilations.
  config = EngineConfig(num_slots=4, page_size=8, num_pages=256, max_model_len=96,
                        prefill_buckets=(64,), compilation_cache_dir=None)
  report = cd.check(model, tokenizer, config, num_prompts=8, max_tokens=12, chunk=8, small_pool=20)
  conditions = report["conditions"]
  assert set(conditions) == set(cd.CONDITIONS)
  for name, c in conditions.items():
    assert c["identical"] == c["requests"] == 8, (name, c)
  # Each condition really happened.
  assert conditions["prefix"]["cached_prompt_tokens"] >= 8 * 16
  assert conditions["preempted"]["preemptions"] > 0
  assert "| preempted | 8/8 | 100.00% |" in cd.format_report(report)

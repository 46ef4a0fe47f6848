"""Batch invariance on the tiny model through the real engine (scripts/check_determinism.py): every
greedy and seeded request gets exactly its tokens from a run alone, when it shares the batch with
other requests, reads a cached prefix, is prefilled in chunks, or is preempted and recomputed."""

from support import script_loader
from support import server_harness as h

cd = script_loader.load("check_determinism")


def test_outputs_do_not_depend_on_the_batch(tiny_checkpoint):
  model, tokenizer = h.load(str(tiny_checkpoint))
  # The session engine's shapes (one prefill bucket, decode batches of 1 and 4), and for the
  # preempted condition those with the small pool test_structured_output's tiny engine has: in
  # the suite their programs are loaded from the persistent compilation cache, not compiled.
  config = h.ENGINE
  report = cd.check(model, tokenizer, config, num_prompts=8, max_tokens=12, chunk=8,
                    small_pool=h.SMALL_POOL.num_pages)
  conditions = report["conditions"]
  assert set(conditions) == set(cd.CONDITIONS)
  for name, c in conditions.items():
    assert c["identical"] == c["requests"] == 8, (name, c)
  # Each condition really happened.
  assert conditions["prefix"]["cached_prompt_tokens"] >= 8 * 16
  assert conditions["preempted"]["preemptions"] > 0
  assert "| preempted | 8/8 | 100.00% |" in cd.format_report(report)

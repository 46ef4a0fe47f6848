"""One engine call per plan: the packing of a mixed plan, and a mixed step (decodes of some
slots, chunks of others' prompts) giving exactly the tokens of the same work run as separate
prefill-only and decode-only steps."""


import dataclasses

import numpy as np
import pytest
from flax import nnx

from jaxserve.batching.plan import PrefillChunk, StepPlan
from jaxserve.config import SamplingParams
from jaxserve.engine.engine import Engine
from jaxserve.model.llama import Transformer
from support.tiny import TINY, TINY_ENGINE, count_compiles

GREEDY = SamplingParams(temperature=0, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.3, logprobs=2)


def chunk(slot, ids, start, table, last, prompt=(), sampling=GREEDY):
  return PrefillChunk(f"r{slot}", slot, tuple(ids), start, tuple(table), last, sampling, 7 + slot,
                      tuple(prompt), ())


def test_a_mixed_plan_packs_decode_rows_then_chunks():
  e = Engine(Transformer(TINY, rngs=nnx.Rngs(0)), TINY_ENGINE)  # Buckets 16, 32; query block 16.
  tables = np.zeros((4, 3), np.int32)
  tables[1] = [5, 6, 7]
  plan = StepPlan(prefills=(chunk(0, range(2, 14), 0, [1, 2], True, range(2, 14)),
                            chunk(3, [9, 9, 9], 0, [3], True, [9, 9, 9])),
                  decode_slots=(1,), page_tables=tables)
  args, rows = e.step_args(plan)
  # A step with prefill runs every decode row (D = 4 slots, 3 of them padding); every step the
  # table; 15 prefill tokens in bucket 16; one sequence per chunk.
  assert args.decode_slots.tolist() == [1, 4, 4, 4] and args.prefill_tokens.shape == (16,)
  assert args.decode_tables.shape == (4, e.packer.width)
  assert args.prefill_slots.tolist() == [0, 3, 4, 4] and args.prefill_lens.tolist() == [12, 3, 0, 0]
  assert (args.prefill_starts.tolist()[:2] == [0, 0]
          and args.prefill_samples.tolist()[:2] == [True, True])
  assert rows == [0, 4, 5]  # The decode row, then the two sequences that sample.
  # Each sequence starts its own query block; rows are on the whole token axis (4 + 16).
  assert (args.block_rows[0, :12].tolist() == list(range(4, 16))
          and (args.block_rows[0, 12:] == 20).all())
  assert args.block_rows[1, :3].tolist() == [16, 17, 18] and args.block_seq[:2].tolist() == [4, 5]


def test_a_decode_only_plan_takes_the_smallest_bucket():
  e = Engine(Transformer(TINY, rngs=nnx.Rngs(0)), TINY_ENGINE)
  tables = np.zeros((4, 3), np.int32)
  args, rows = e.step_args(StepPlan(decode_slots=(2,), page_tables=tables))
  assert args.decode_slots.tolist() == [2] and rows == [0]
  assert args.decode_tables.shape == (1, e.packer.width) and args.prefill_tokens.shape == (0,)


def test_a_plan_past_the_step_limits_is_refused_not_cut():
  """The scheduler's plan is final: a plan that does not fit one call (more prompts than
  max_prefill_seqs, more tokens than the largest bucket, two chunks of one slot, a scoring chunk
  beside decodes) is an error naming the limit, never split."""
  e = Engine(Transformer(TINY, rngs=nnx.Rngs(0)),
             dataclasses.replace(TINY_ENGINE, max_prefill_seqs=2))  # Largest bucket 32.
  tables = np.zeros((4, 3), np.int32)
  p = [chunk(s, [5] * n, 0, [s + 1], True) for s, n in ((0, 3), (1, 20), (2, 4))]
  scored = dataclasses.replace(chunk(3, [7, 8], 0, [9], False), prompt_logprob_targets=(8, 9))
  cases = [(StepPlan(tuple(p)), "3 prompts: at most 2"),
           (StepPlan((p[1], chunk(0, [5] * 13, 0, [1, 2], True))), "at most 32 in all"),
           (StepPlan((p[0], chunk(0, [6], 3, [1], True))), "two prefill chunks of one slot"),
           (StepPlan((scored,), (1,), tables), "scores prompt positions")]
  for plan, message in cases:
    with pytest.raises(ValueError, match=message):
      e.step(plan)


def _run(model, mixed: bool):
  """Slots 0 and 1 prefill, then decode; during their first two decode steps slot 2's prompt is
  prefilled in two chunks, in the same steps (mixed) or in steps of their own; then all three
  decode. Returns every sampled token and the logprobs of slot 2's first token."""
  e = Engine(model, TINY_ENGINE)
  rng = np.random.default_rng(0)
  a, b, c = (list(rng.integers(2, 128, n)) for n in (11, 20, 25))
  tables = np.zeros((4, 8), np.int32)
  tables[0, :3], tables[1, :4], tables[2, :5] = [1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]
  first = e.step(StepPlan(prefills=(chunk(0, a, 0, tables[0], True, a),
                                    chunk(1, b, 0, tables[1], True, b, SEEDED))))
  tokens = [first.result().tolist()]
  for piece in (chunk(2, c[:16], 0, tables[2], False), chunk(2, c[16:], 16, tables[2], True, c)):
    if mixed:
      out = e.step(StepPlan((piece,), (0, 1), tables))
      tokens.append(out.result().tolist())
    else:
      prefill = e.step(StepPlan((piece,)))
      out = e.step(StepPlan((), (0, 1), tables))
      tokens.append(out.result().tolist() + prefill.result().tolist())
  c_first = (out if mixed else prefill).logprobs()
  for _ in range(2):
    tokens.append(e.step(StepPlan((), (0, 1, 2), tables)).result().tolist())
  return tokens, [x[-1] for x in c_first]


def test_a_mixed_step_equals_separate_prefill_and_decode_steps(tiny_model):
  together, lp_together = _run(tiny_model, mixed=True)
  apart, lp_apart = _run(tiny_model, mixed=False)
  assert together == apart
  for x, y in zip(lp_together, lp_apart):
    np.testing.assert_array_equal(x, y)


def test_no_plan_compiles_after_warmup(tiny_model):
  e = Engine(tiny_model, TINY_ENGINE)
  e.warmup()
  tables = np.zeros((4, 16), np.int32)
  tables[0, :16] = np.arange(1, 17)
  tables[1, :8] = np.arange(17, 25)
  with count_compiles() as counts:
    # The first shape.
    e.step(StepPlan(prefills=(chunk(2, [7, 8], 0, [30], True, [7, 8]),))).result()
    e.step(StepPlan(prefills=(chunk(0, range(2, 32), 0, tables[0], False),))).result()
    e.step(StepPlan(prefills=(chunk(0, [5] * 30, 30, tables[0], True, [5] * 60),
                              chunk(1, [3], 0, tables[1], True, [3])))).result()
    e.step(StepPlan((), (0, 1), tables[:, :8])).result()
    e.step(StepPlan((chunk(1, [4], 2, tables[1], True, [3, 4]),), (0,), tables)).result()
  assert counts["compile"] == 0, counts

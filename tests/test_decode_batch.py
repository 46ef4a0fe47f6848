"""Decode runs only the decoding slots, padded to a batch bucket: the buckets, the rows and tables
the engine builds for a step, and one slot decoded alone giving the tokens it gets among others."""

import dataclasses

import numpy as np
from flax import nnx

from jaxserve.batching.plan import StepPlan
from jaxserve.config import EngineConfig, KVLayout
from jaxserve.engine.engine import Engine
from jaxserve.model.kv_cache import SCRATCH_PAGE
from jaxserve.model.llama import Transformer
from support.engine_calls import decode, prefill
from support.tiny import TINY, TINY_ENGINE


def test_batch_buckets_are_powers_of_four_up_to_the_slots():
  assert EngineConfig(num_slots=1).decode_batch_buckets == (1,)
  assert EngineConfig(num_slots=8).decode_batch_buckets == (1, 4, 8)
  assert EngineConfig(num_slots=16).decode_batch_buckets == (1, 4, 16)
  assert EngineConfig(num_slots=64).decode_batch_buckets == (1, 4, 16, 64)
  assert EngineConfig(num_slots=8, dp=2).decode_batch_buckets == (8,)  # Slots stay in place.


def engine(**changes) -> Engine:
  return Engine(Transformer(TINY, rngs=nnx.Rngs(0)), dataclasses.replace(TINY_ENGINE, **changes))


def test_rows_name_the_decoding_slots_then_padding():
  e = engine()  # 4 slots: buckets 1 and 4; tables of 128 / 8 = 16 pages.
  tables = np.arange(4 * 3, dtype=np.int32).reshape(4, 3) + 1  # Row s: slot s's pages.
  one, rows = e.step_args(StepPlan(decode_slots=(2,), page_tables=tables))
  np.testing.assert_array_equal(one.decode_slots, [2])
  np.testing.assert_array_equal(one.decode_tables, [[7, 8, 9] + [SCRATCH_PAGE] * 13])
  assert rows == [0] and one.prefill_tokens.shape == (0,)  # Decode only: no prefill part.
  two, rows = e.step_args(StepPlan(decode_slots=(3, 0), page_tables=tables))
  np.testing.assert_array_equal(two.decode_slots, [3, 0, 4, 4])  # 4 = num_slots: padding.
  np.testing.assert_array_equal(two.decode_tables[:, :3],
                                [[10, 11, 12], [1, 2, 3], [0] * 3, [0] * 3])
  assert (two.decode_tables[2:] == SCRATCH_PAGE).all() and rows == [0, 1]


def test_contiguous_rows_read_their_own_regions():
  e = engine(kv_layout=KVLayout.CONTIGUOUS)
  args, _ = e.step_args(StepPlan(decode_slots=(1,), page_tables=np.zeros((4, 1), np.int32)))
  np.testing.assert_array_equal(args.decode_tables[0], 1 + 16 + np.arange(16))  # Slot 1's pages.


def test_a_slot_decodes_the_same_alone_and_among_others():
  """Three slots decode 6 steps together (batch bucket 4), then the same prompts in a fresh
  engine decode with slot 1 alone (bucket 1): slot 1's tokens and logprobs must agree."""
  from jaxserve.batching.plan import PrefillChunk
  from jaxserve.config import SamplingParams

  def run(slots):
    e = engine()
    pages = {s: list(range(1 + 8 * s, 9 + 8 * s)) for s in range(3)}
    for s in slots:
      prompt = [5 + s, 9, 2, 7 * s + 1]
      prefill(e, PrefillChunk(f"r{s}", s, prompt, 0, pages[s], True,
                             SamplingParams(temperature=0.0, logprobs=1), 0,
                             prompt_token_ids=prompt))
    tables = np.zeros((4, 8), np.int32)
    for s in range(3):
      tables[s] = pages[s]
    out = []
    for _ in range(6):
      f = decode(e, slots, tables)
      out.append((int(f.result()[1]), float(f.logprobs()[0][1])))
    return out

  together, alone = run([0, 1, 2]), run([1])
  assert [t for t, _ in together] == [t for t, _ in alone]
  np.testing.assert_allclose([p for _, p in together], [p for _, p in alone], atol=1e-5)

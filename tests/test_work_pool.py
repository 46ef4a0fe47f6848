"""The work pool (serving/work_pool.py): bounded, refusing at once when full, never refusing
owed work; and its JSON helpers, which must give what json gives."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from jaxserve.config import SamplingParams
from jaxserve.serving import work_pool
from jaxserve.serving.gateway import ApiError, Status
from jaxserve.serving.work_pool import WorkPool


def test_a_full_pool_refuses_at_once_but_never_owed_work():
  async def main():
    pool, release = WorkPool(num_threads=1, max_queued=1), threading.Event()
    running = [asyncio.ensure_future(pool.run(release.wait, 10)) for _ in range(2)]
    await asyncio.sleep(0.05)
    assert pool.num_pending == 2
    with pytest.raises(ApiError) as e:
      await pool.run(sum, [1, 2])
    assert e.value.status is Status.RESOURCE_EXHAUSTED and "busy" in e.value.message
    owed = asyncio.ensure_future(pool.run(sum, [1, 2], owed=True))
    release.set()
    assert await asyncio.gather(*running) == [True, True] and await owed == 3
    assert pool.num_pending == 0
    pool.close()
  asyncio.run(main())


def test_errors_reach_the_caller_and_a_cancelled_task_never_runs():
  async def main():
    pool, release, ran = WorkPool(num_threads=1, max_queued=4), threading.Event(), []
    with pytest.raises(ZeroDivisionError):
      await pool.run(lambda: 1 / 0)
    blocker = asyncio.ensure_future(pool.run(release.wait, 10))
    queued = asyncio.ensure_future(pool.run(ran.append, "ran"))
    await asyncio.sleep(0.05)
    queued.cancel()  # Its client went away while it waited.
    release.set()
    await blocker
    await pool.run(lambda: None)  # After the cancelled one, in order.
    assert ran == [] and pool.num_pending == 0
    pool.close()
  asyncio.run(main())


@pytest.mark.parametrize("obj", [
    {}, [], {"a": [1, 2.5, None, True, "x\u00e9\n"], "b": {}}, {7: "int key"},
    {"choices": [{"logprobs": {"tokens": ["a"] * 1000, "top": [{"a": -1.5, "b": -2.0}] * 300}}
                 for _ in range(3)]},
    [[[[[[["deep"]]]]]]], {"x": float("-inf")}, list(range(1000)),
])
def test_dumps_gives_what_json_gives(obj):
  assert json.loads(work_pool.dumps(obj)) == json.loads(json.dumps(obj))


def test_loads_takes_large_texts_with_the_python_scanner():
  small = json.dumps({"prompt": [1, 2, 3], "x": "NaN", "n": 1.5})
  assert work_pool.loads(small) == json.loads(small)
  big = json.dumps({"ids": list(range(300_000)), "s": "\u00e9" * 1000, "v": [{"a": None}] * 9})
  assert len(big) > work_pool.C_PARSE_BYTES and work_pool.loads(big) == json.loads(big)
  assert work_pool.loads("[NaN, Infinity]" + " " * work_pool.C_PARSE_BYTES)[1] == float("inf")
  with pytest.raises(ValueError):
    work_pool.loads("{" + " " * work_pool.C_PARSE_BYTES)


def test_a_run_checks_only_its_seed_and_max_tokens():
  base = SamplingParams(max_tokens=10, seed=3, allowed_token_ids=[5, 6])
  run = base.for_run(4, 7)
  assert (run.seed, run.max_tokens, run.allowed_token_ids) == (4, 7, (5, 6))
  assert (base.seed, base.max_tokens) == (3, 10)
  for seed, max_tokens in ((2**63, 5), (1, 0), (1, 11), (1, True)):
    with pytest.raises(ValueError):
      base.for_run(seed, max_tokens)

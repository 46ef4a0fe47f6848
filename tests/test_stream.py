"""The asyncio streaming API over a runner stepping on a background thread."""

import asyncio
import random
import time

import pytest

from jaxserve.batching.request import FinishReason, RequestRejected, RequestStatus
from jaxserve.batching.runner import Runner
from jaxserve.batching.stream import AsyncRunner
from jaxserve.config import SamplingParams, SchedulerConfig
from support.mock_engine import (
  MockEngine,
  MockTokenizer,
  assert_all_free,
  reference_generate,
  weighted_sum,
)


def greedy(n, **kwargs):
  return SamplingParams(temperature=0, max_tokens=n, **kwargs)


def serve(test, engine=None, **config):
  """Runs `test(async_runner)` on a fresh event loop with the engine thread started."""
  runner = Runner(engine or MockEngine(num_slots=2, next_token=weighted_sum), MockTokenizer(),
                  SchedulerConfig(**config))
  arunner = AsyncRunner(runner)

  async def main():
    arunner.start()
    try:
      result = await asyncio.wait_for(test(arunner), timeout=20)
      while runner.has_unfinished:  # Let the loop report aborts before stopping it.
        await asyncio.sleep(0.001)
      return result
    finally:
      arunner.stop()

  result = asyncio.run(main())
  assert_all_free(runner.scheduler)
  return result


async def collect(stream):
  return [out async for out in stream]


def test_concurrent_streams_get_their_own_tokens():
  prompts = [[1, 2, 3], [9], [4, 4, 4, 4, 4], [7, 8]]

  async def test(ar):
    streams = [ar.submit(p, greedy(6 + i)) for i, p in enumerate(prompts)]
    return await asyncio.gather(*(collect(s) for s in streams))

  for i, (p, outs) in enumerate(zip(prompts, serve(test))):
    expected = reference_generate(p, 6 + i, weighted_sum)
    assert [t for o in outs for t in o.token_ids] == expected
    assert "".join(o.text for o in outs) == "".join(f" t{t}" for t in expected)
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert all(o.finish_reason is None for o in outs[:-1])


def test_a_request_that_can_never_run_fails_in_the_caller():
  async def test(ar):
    with pytest.raises(RequestRejected):
      ar.submit(list(range(200)), greedy(4))  # Longer than max_model_len (128).
    x = ar.submit([1], greedy(1), request_id="x")
    with pytest.raises(ValueError, match="already in use"):
      ar.submit([1], greedy(1), request_id="x")
    return (await collect(x))[-1].finish_reason is FinishReason.LENGTH

  assert serve(test)


def test_leaving_the_stream_early_aborts_the_request():
  async def test(ar):
    seen = []
    agen = ar.generate([1, 2, 3], greedy(100))
    async for out in agen:
      seen.append(out)
      if len(seen) == 2:
        break
    await agen.aclose()
    other = await collect(ar.submit([5], greedy(3)))  # The engine keeps serving others.
    return seen, other

  seen, other = serve(test)
  assert len(seen) == 2 and other[-1].finish_reason is FinishReason.LENGTH


def test_abort_reaches_a_waiting_request():
  async def test(ar):
    # The running request must still be running when aborted: give it far more tokens than the
    # few steps the aborts take, and a context window to hold them.
    running = ar.submit([1], greedy(100_000))
    queued = ar.submit([2], greedy(50))  # One slot: waits.
    first = await running.__anext__()
    queued.abort()
    outs = await collect(queued)
    running.abort()
    rest = await collect(running)
    return first, outs, rest, queued.request

  # Token 2 forever (never the end-of-turn id): the running request cannot finish on its own
  # within the aborts, however many steps the engine thread runs before they arrive.
  engine = MockEngine(num_slots=1, num_pages=26_000, max_model_len=102_400,
                      next_token=lambda seq: 2)
  first, outs, rest, queued = serve(test, engine=engine)
  assert first.token_ids == (2,)
  assert [o.finish_reason for o in outs] == [FinishReason.ABORT]
  assert queued.status is RequestStatus.ABORTED and queued.num_output_tokens == 0
  assert rest[-1].finish_reason is FinishReason.ABORT


class _BrokenEngine(MockEngine):

  def decode(self, slots, page_tables):
    raise RuntimeError("device on fire")


def test_an_engine_error_reaches_every_open_stream():
  async def test(ar):
    streams = [ar.submit([1], greedy(5)), ar.submit([2], greedy(5))]
    errors = []
    for s in streams:
      with pytest.raises(RuntimeError, match="device on fire") as e:
        await collect(s)
      errors.append(e)
    with pytest.raises(RuntimeError, match="failed"):
      ar.submit([3], greedy(1))
    return len(errors)

  runner = Runner(_BrokenEngine(), MockTokenizer())
  arunner = AsyncRunner(runner)

  async def main():
    arunner.start()
    try:
      return await asyncio.wait_for(test(arunner), timeout=20)
    finally:
      arunner.stop()

  assert asyncio.run(main()) == 2


def test_engine_calls_whose_callers_are_cancelled_never_reach_the_loop():
  """200 on_engine calls, each cancelled 0-2 ms (a quarter: 50 ms) after it was made, while two
  streams run: a call cancelled before the engine thread takes it never runs, one it took runs
  once to its end, and the engine loop serves on (each stream's tokens are the reference's)."""
  ran, returned = [], []

  def call(i):
    ran.append(i)
    time.sleep(0.0002)  # Long enough for some cancels to land while it runs.
    if i % 7 == 0:
      raise ValueError("the caller's own error")
    return i

  async def one(ar, i, delay_s):
    task = asyncio.ensure_future(ar.on_engine(lambda: call(i)))
    await asyncio.sleep(delay_s)
    task.cancel()
    try:
      returned.append(await task)
    except (asyncio.CancelledError, ValueError):
      pass

  async def test(ar):
    streams = [ar.submit([1, 2, 3], greedy(60)), ar.submit([5], greedy(60))]
    rng = random.Random(0)
    delays = [rng.uniform(0, 0.002) if i % 4 else 0.05 for i in range(200)]  # Some run.
    await asyncio.gather(*(one(ar, i, delay) for i, delay in enumerate(delays)))
    after = ar.submit([9], greedy(5))
    return await asyncio.gather(*(collect(s) for s in [*streams, after]))

  outs = serve(test, engine=MockEngine(num_slots=2, num_pages=64, next_token=weighted_sum))
  for prompt, n, got in zip(([1, 2, 3], [5], [9]), (60, 60, 5), outs):
    assert [t for o in got for t in o.token_ids] == reference_generate(prompt, n, weighted_sum)
  assert len(ran) == len(set(ran)) and set(returned) <= set(ran)
  assert 0 < len(ran) < 200  # Some ran, some were cancelled before the engine thread took them.

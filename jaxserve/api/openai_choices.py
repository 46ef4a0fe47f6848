"""The choices of one OpenAI request: each (prompt, run) pair is a service.generate stream.

A completions request may carry several prompts, and ask for n completions of each (best_of runs,
of which the n with the highest cumulative logprob are returned). The whole request is prepared
once, on a worker (`prepare`: its body parsed, each prompt tokenized, templated and checked once
for all its runs, its constraint compiled, the request priced under its key's limits), however
many runs it has. The runs of one prompt are submitted together, so they share its KV pages
through the prefix cache: the scheduler caches the first run's full pages as soon as their
prefill is dispatched, and the runs admitted after it (the same step or later) prefill only the
rest. Each run has its own seed stream: seed + run when the client gave a seed, else one drawn
per run. Choice i*n + j is prompt i's j-th.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from jaxserve.api import openai_request
from jaxserve.api.openai_request import Request
from jaxserve.serving import work_pool
from jaxserve.serving.gateway import ApiError, Lease
from jaxserve.serving.metrics import RequestRecord
from jaxserve.serving.requests import Accepted, Chunk, Run
from jaxserve.serving.service import Service


def prepare(service: Service, lease: Lease, body: bytes,
            parse: Callable[[Mapping[str, Any]], Request]) -> tuple[Request, list[Run]]:
  """A request's whole preparation, on a worker thread: its body, then every prompt's runs.
  Raises the first ApiError."""
  req = parse(openai_request.parse_body(body))
  return req, service.prepare_runs(lease, req.every_input, req.num_runs)


class Choices:
  """Opens every run's stream; closing it (async with) aborts those still running."""

  def __init__(self, service: Service, acc: Accepted, req: Request, runs: Sequence[Run]):
    """The streams start at start()."""
    self._req = req
    self._acc = acc
    self._streams = [service.generate(acc, run) for run in runs]
    self._firsts: list[Chunk] = []

  def __len__(self) -> int:
    return len(self._streams)

  async def __aenter__(self) -> Choices:
    return self

  async def __aexit__(self, *_) -> None:
    for stream in self._streams:
      await stream.aclose()

  async def start(self) -> None:
    """Every run's first chunk. Any run's error (raised before its first token) is raised once
    all have answered, so that none is left running an `anext` when the streams close."""
    firsts = await asyncio.gather(*(anext(s) for s in self._streams), return_exceptions=True)
    for first in firsts:
      if isinstance(first, BaseException):
        raise first
    self._firsts = firsts
    self._acc.answered = True

  async def whole(self, fmt) -> bytes:
    """The whole response's JSON: every run to its end, the n best of each prompt's returned,
    built on a worker (with echo and logprobs, n choices of a long prompt make many MiB)."""
    runs = await asyncio.gather(*(_rest(f, s) for f, s in zip(self._firsts, self._streams)))
    return await self._acc.work(self._whole, fmt, runs, owed=True)

  def _whole(self, fmt, runs: Sequence[list[Chunk]]) -> bytes:
    return work_pool.dumps(fmt.whole(self._best(runs), [run[-1].record for run in runs]))

  async def events(self) -> AsyncIterator[tuple[int, Chunk]]:
    """(choice index, chunk) as the runs produce them (streaming has best_of = n: every run is a
    choice). An engine failure in any run ends the stream with its ApiError."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, first: Chunk, stream) -> None:
      try:
        await queue.put((index, first))
        if first.record is None:
          async for chunk in stream:
            await queue.put((index, chunk))
      except ApiError as e:
        await queue.put((index, e))

    tasks = [asyncio.create_task(pump(i, f, s))
             for i, (f, s) in enumerate(zip(self._firsts, self._streams))]
    try:
      num_open = len(tasks)
      while num_open:
        index, item = await queue.get()
        if isinstance(item, ApiError):
          raise item
        num_open -= item.record is not None
        yield index, self._visible(item)
    finally:
      for task in tasks:
        task.cancel()
      await asyncio.gather(*tasks, return_exceptions=True)

  def _best(self, runs: Sequence[list[Chunk]]) -> list[tuple[int, list[Chunk]]]:
    req, out = self._req, []
    for p in range(len(runs) // req.num_runs):
      mine = runs[p * req.num_runs:(p + 1) * req.num_runs]
      if len(mine) > req.n:
        mine = sorted(mine, key=_cumulative_logprob, reverse=True)[:req.n]
      out += [(p * req.n + j, [self._visible(c) for c in run]) for j, run in enumerate(mine)]
    return out

  def _visible(self, chunk: Chunk) -> Chunk:
    """Logprobs read only to rank best_of runs are not the client's."""
    if self._req.want_logprobs or chunk.logprobs is None:
      return chunk
    return dataclasses.replace(chunk, logprobs=None)


async def _rest(first: Chunk, stream) -> list[Chunk]:
  return [first] + [c async for c in stream] if first.record is None else [first]


def _cumulative_logprob(run: Sequence[Chunk]) -> float:
  return sum(lp.logprob for c in run for lp in c.logprobs or ())


def records_in_order(records: dict[int, RequestRecord]) -> list[RequestRecord]:
  return [records[i] for i in sorted(records)]

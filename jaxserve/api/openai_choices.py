"""The choices of one OpenAI request: each (prompt, run) pair is a service.generate stream.

A completions request may carry several prompts, and ask for n completions of each (best_of runs,
of which the n with the highest cumulative logprob are returned). A prompt is tokenized (and
templated, and its fields checked) once, for all its runs. The runs of one prompt are
submitted together, so they share its KV pages through the prefix cache: the scheduler caches
the first run's full pages as soon as their prefill is dispatched, and the runs admitted after it
(the same step or later) prefill only the rest. Each run has its own seed stream: seed + run when
the client gave a seed, else one drawn per run. Choice i*n + j is prompt i's j-th.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Sequence

from jaxserve.api.openai_request import Request
from jaxserve.config import SamplingParams
from jaxserve.serving.gateway import ApiError, ApiKey
from jaxserve.serving.metrics import RequestRecord
from jaxserve.serving.service import Chunk, GenerateInput, Prepared, Service

_SEEDS = 2**63  # SamplingParams' seed range: seed + run wraps inside it.


def runs(service: Service, req: Request) -> list[tuple[GenerateInput, Prepared]]:
  """Every run's input and checked request, prompt by prompt. Raises a prompt's ApiError."""
  out = []
  for prompt in req.prompts or (req.input.prompt,):
    inp = dataclasses.replace(req.input, prompt=prompt)
    prepared = service.prepare(inp)  # Once per prompt: its runs share the ids.
    out += [(inp, prepared._replace(sampling=_seeded(prepared.sampling, run)))
            for run in range(req.num_runs)]
  return out


def _seeded(sampling: SamplingParams, run: int) -> SamplingParams:
  if not run or sampling.seed is None:
    return sampling
  return dataclasses.replace(sampling, seed=(sampling.seed + run) % _SEEDS)


class Choices:
  """Opens every run's stream; closing it (async with) aborts those still running."""

  def __init__(self, service: Service, key: ApiKey, req: Request):
    """Checks and tokenizes every prompt (raising the first one's ApiError); the streams start
    at start()."""
    self._req = req
    self._streams = [service.generate(key, inp, prepared) for inp, prepared in runs(service, req)]
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

  async def whole(self, fmt) -> dict:
    """The whole response: every run to its end, the n best of each prompt's returned."""
    runs = await asyncio.gather(*(_rest(f, s) for f, s in zip(self._firsts, self._streams)))
    return fmt.whole(self._best(runs), [run[-1].record for run in runs])

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

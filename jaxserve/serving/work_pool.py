"""The threads that do each request's CPU work, so that the event loop only routes.

What a request costs the CPU before and after the engine runs it (its body's JSON, the chat
template, tokenizing, checking long id lists, compiling its constraint, building a large response)
runs here, once per request, never on the event loop that answers every client's HTTP, gRPC and
health calls. The pool is bounded: a request that finds `num_threads + max_queued` tasks in it is
refused at once (RESOURCE_EXHAUSTED, HTTP 429), so a flood queues no unbounded work; the work an
accepted request still needs to finish (its response) is never refused. The threads are daemons:
a task still running when the server exits (a long compile) cannot hold the process past its
drain timeout, as the loop's default executor would (asyncio.run joins its threads).

A task's Python holds the GIL, but the interpreter hands it to the loop's thread every 5 ms
(sys.getswitchinterval), so the loop keeps answering. C code that holds the GIL for long does
not: such work is cut into pieces here (`dumps`, `loads`) or goes through calls that release it
(the tokenizer's encode_batch).
"""

from __future__ import annotations

import asyncio
import json
import json.scanner
import queue
import threading
from typing import Any, Callable

from jaxserve.serving.gateway import ApiError, Status

# JSON bodies up to this size are parsed by C's json in one go (at most ~20 ms holding the GIL,
# for a body of small numbers); larger ones by the stdlib's Python scanner, which yields it.
C_PARSE_BYTES = 2**20
_SLICE = 128  # List items encoded in one C json.dumps call (of a response: ~1 ms each).
_COMPACT = (",", ":")


class WorkPool:

  def __init__(self, num_threads: int = 4, max_queued: int = 1024):
    if num_threads < 1 or max_queued < 0:
      raise ValueError(f"WorkPool needs num_threads >= 1 and max_queued >= 0, got {num_threads} "
                       f"and {max_queued}")
    self.num_threads = num_threads
    self.max_queued = max_queued
    self.num_pending = 0  # Tasks queued or running; read and written on the loop's thread only.
    self._tasks: queue.SimpleQueue = queue.SimpleQueue()
    self._threads = [threading.Thread(target=self._work, name=f"jaxserve-work-{n}", daemon=True)
                     for n in range(num_threads)]
    for thread in self._threads:
      thread.start()

  async def run(self, fn: Callable[..., Any], *args: Any, owed: bool = False) -> Any:
    """fn(*args) on a worker thread. Raises RESOURCE_EXHAUSTED at once when the pool is full,
    unless the work is `owed` (what an accepted request needs to finish). Cancelling the await
    drops the result; a task not yet started is skipped."""
    if not owed and self.num_pending >= self.num_threads + self.max_queued:
      raise ApiError(Status.RESOURCE_EXHAUSTED,
                     f"the server is busy: {self.num_pending} requests are being prepared "
                     f"({self.num_threads} at a time, {self.max_queued} waiting at most); retry "
                     "shortly")
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    self.num_pending += 1
    self._tasks.put((fn, args, future, loop))
    return await future

  def close(self) -> None:
    """Ends each thread after its current task (without waiting for it)."""
    for _ in self._threads:
      self._tasks.put(None)

  def _work(self) -> None:
    while (task := self._tasks.get()) is not None:
      fn, args, future, loop = task
      result, error = None, None
      if not future.cancelled():
        try:
          result = fn(*args)
        except BaseException as e:  # pylint: disable=broad-except  (it is the caller's)
          error = e
      try:
        loop.call_soon_threadsafe(self._settle, future, result, error)
      except RuntimeError:  # The loop has closed: the server is gone.
        return

  def _settle(self, future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    self.num_pending -= 1
    settle(future, result, error)


def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
  """A worker thread's outcome into `future`, on its loop; nothing if it was cancelled (its
  caller went away)."""
  if future.done():
    return
  if error is None:
    future.set_result(result)
  else:
    future.set_exception(error)


def dumps(obj: Any) -> bytes:
  """json.dumps(obj), UTF-8, made of many small C calls: a worker building a response of many
  megabytes hands the GIL to the event loop between them (one call would hold it throughout)."""
  out: list[str] = []
  _encode(obj, out, depth=0)
  return "".join(out).encode()


def _encode(obj: Any, out: list[str], depth: int) -> None:
  # A response's bulk is its choices' logprobs: lists a few levels down, of small dicts.
  if depth > 4 or not isinstance(obj, (dict, list)):
    out.append(json.dumps(obj, separators=_COMPACT))
  elif isinstance(obj, dict):
    out.append("{")
    for n, (key, value) in enumerate(obj.items()):
      out.append(("," if n else "") + json.dumps(str(key)) + ":")
      _encode(value, out, depth + 1)
    out.append("}")
  elif len(obj) <= _SLICE and depth < 4:  # choices, or one short list: item by item.
    out.append("[")
    for n, item in enumerate(obj):
      if n:
        out.append(",")
      _encode(item, out, depth + 1)
    out.append("]")
  else:
    out.append("[" + ",".join(json.dumps(obj[i:i + _SLICE], separators=_COMPACT)[1:-1]
                              for i in range(0, len(obj), _SLICE)) + "]")


def loads(text: str) -> Any:
  """json.loads(text); a text over C_PARSE_BYTES is parsed by the Python scanner (about 20x
  slower on a body of small numbers), which, unlike C's, lets the event loop run meanwhile."""
  if len(text) <= C_PARSE_BYTES:
    return json.loads(text)
  decoder = json.JSONDecoder()
  decoder.scan_once = json.scanner.py_make_scanner(decoder)
  return decoder.decode(text)

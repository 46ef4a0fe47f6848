"""Constraint compiles in the serving core: bounded per API key and in time, off the event loop.

A JSON schema, regex, choice list or grammar the cache has not seen is compiled by llguidance in a
thread of this gate's pool (text/constraint.py; its size is bounded before that, by
config.constraint.MAX_CONSTRAINT_CHARS). The bounds keep one client's constraints from stalling
the others:

  per key   at most `per_key` compiles at once; one more is RESOURCE_EXHAUSTED (429) at once
  time      the caller waits at most `timeout_s`; a longer compile is INVALID_ARGUMENT naming the
            budget. llguidance cannot be interrupted, so the compile runs on in its thread and
            holds its key's slot until it ends: a key cannot pile up abandoned compiles
  threads   `num_threads` compile at once in all; a compile that has not started within the
            timeout is RESOURCE_EXHAUSTED (the compilers are busy), not a fault of its constraint

Nothing here holds a lock while a compile runs (the one lock guards the counts), and a cache hit
takes no slot and no thread: the event loop may call `compile_async` and never waits on a compile.

The compile threads have 256 MiB stacks (address space: only the pages a compile touches are
used). llguidance recurses over a grammar's nesting: a Lark chain of 3,000 rules, 70 KB, overflowed
an 8 MiB thread stack and killed the process (SIGSEGV); 22,000, more than the size cap allows,
compile in 256 MiB.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import queue
import threading
import weakref

from jaxserve.batching.constrained import Constraints
from jaxserve.config import SamplingParams
from jaxserve.serving.gateway import ApiError, Status, invalid
from jaxserve.text.constraint import Grammar

COMPILE_STACK_BYTES = 256 * 2**20


class ConstraintGate:

  def __init__(self, constraints: Constraints, per_key: int = 2, timeout_s: float = 5.0,
               num_threads: int = 4):
    self.per_key, self.timeout_s = per_key, timeout_s
    self._constraints = constraints
    self._pool = _DeepStackPool(num_threads)
    self._lock = threading.Lock()
    self._running: collections.Counter[str] = collections.Counter()  # Compiles per key name.

  def num_running(self, key: str) -> int:
    with self._lock:
      return self._running[key]

  def compile(self, key: str, sampling: SamplingParams) -> Grammar | None:
    """The grammar of `sampling.constraint` (None without one), compiled for the API key named
    `key`; raises ApiError. Blocks up to `timeout_s`: call it from a worker thread."""
    grammar, future = self._start(key, sampling)
    if future is None:
      return grammar
    try:
      return future.result(self.timeout_s)
    except concurrent.futures.TimeoutError:
      raise self._late(future, sampling) from None
    except ValueError as e:
      raise invalid(str(e)) from e

  async def compile_async(self, key: str, sampling: SamplingParams) -> Grammar | None:
    """`compile` for the event loop: awaits the compile thread, never blocks on it."""
    grammar, future = self._start(key, sampling)
    if future is None:
      return grammar
    try:
      return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
    except asyncio.TimeoutError:
      raise self._late(future, sampling) from None
    except ValueError as e:
      raise invalid(str(e)) from e

  def _start(self, key: str, sampling: SamplingParams
             ) -> tuple[Grammar | None, concurrent.futures.Future | None]:
    """(a cached grammar, None), or (None, the compile's future) with the key's slot taken."""
    constraint = sampling.constraint
    if constraint is None:
      return None, None
    grammar = self._constraints.cached(constraint)
    if grammar is not None:
      if sampling.allowed_token_ids is not None:
        try:
          grammar.check_allowed(sampling.allowed_token_ids)
        except ValueError as e:
          raise invalid(str(e)) from e
      return grammar, None
    with self._lock:
      if self._running[key] >= self.per_key:
        raise ApiError(Status.RESOURCE_EXHAUSTED,
                       f"{self._running[key]} constraint compiles of this API key are running "
                       f"(at most {self.per_key} at once); retry when one has finished")
      self._running[key] += 1
    try:
      future = self._pool.submit(self._constraints.grammar, constraint,
                                 sampling.allowed_token_ids)
    except BaseException:
      self._release(key)
      raise
    future.add_done_callback(lambda _: self._release(key))
    return None, future

  def _release(self, key: str) -> None:
    with self._lock:
      self._running[key] -= 1
      if not self._running[key]:
        del self._running[key]

  def _late(self, future: concurrent.futures.Future, sampling: SamplingParams) -> ApiError:
    if future.cancel():  # Still queued behind other compiles: nothing of this one has run.
      return ApiError(Status.RESOURCE_EXHAUSTED,
                      f"the constraint compilers were busy for {self.timeout_s:g} s; retry later")
    return invalid(f"the {sampling.constraint.kind.value} constraint did not compile within "
                   f"{self.timeout_s:g} s (the compile budget); make it smaller or simpler")


class _DeepStackPool:
  """Up to `num_threads` daemon threads with COMPILE_STACK_BYTES stacks, running submitted calls
  in order (concurrent.futures' pool cannot set its threads' stack size). A thread starts with
  the call that finds every started one busy, so a gate that compiles nothing holds none; the
  threads hold the queue, not the pool, and end when the pool is collected."""

  def __init__(self, num_threads: int):
    self._calls: queue.SimpleQueue = queue.SimpleQueue()
    self._num_threads, self._started, self._busy = num_threads, 0, 0
    self._lock = threading.Lock()
    weakref.finalize(self, _stop, self._calls, num_threads)

  def submit(self, fn, *args) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self._lock:
      self._busy += 1
      if self._busy > self._started < self._num_threads:
        self._start_thread()
    future.add_done_callback(self._done)
    self._calls.put((future, fn, args))
    return future

  def _done(self, _) -> None:
    with self._lock:
      self._busy -= 1

  def _start_thread(self) -> None:
    previous = threading.stack_size(COMPILE_STACK_BYTES)  # Read by the thread as it starts.
    try:
      threading.Thread(target=_work, args=(self._calls,), daemon=True,
                       name=f"constraint-compile-{self._started}").start()
    finally:
      threading.stack_size(previous)
    self._started += 1


def _work(calls: queue.SimpleQueue) -> None:
  while (call := calls.get()) is not None:
    _run(*call)
    del call  # Nothing of a call outlives it (its future's callback holds the pool).


def _run(future: concurrent.futures.Future, fn, args) -> None:
  if not future.set_running_or_notify_cancel():  # Cancelled while it waited.
    return
  try:
    future.set_result(fn(*args))
  except BaseException as e:  # pylint: disable=broad-except  (the caller gets it)
    future.set_exception(e)


def _stop(calls: queue.SimpleQueue, num_threads: int) -> None:
  for _ in range(num_threads):  # One for each thread that may have started.
    calls.put(None)

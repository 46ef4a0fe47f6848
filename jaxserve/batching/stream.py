"""Streaming for the server: the runner steps on a background thread, each request's outputs
arrive on its own asyncio queue.

The event loop never touches the runner's state: `submit` and `abort` post commands to an inbox
that the engine thread drains before each step, and each step's outputs come back to the loop in
one `call_soon_threadsafe`. Building the request (and rejecting one that could never run) happens
on the caller's side, so a bad request fails at once, in the handler that sent it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from jaxserve.batching import kv_handoff
from jaxserve.batching.constrained import Constraints
from jaxserve.batching.images import ImageSpan
from jaxserve.batching.plan import EngineInfo, PageStore
from jaxserve.batching.request import Request, RequestOutput
from jaxserve.batching.runner import Runner
from jaxserve.batching.stream_controls import Controls
from jaxserve.config import LoRARequest, SamplingParams
from jaxserve.text.constraint import Grammar


class EngineDead(RuntimeError):
  """The engine loop raised: every open stream gets this, and the runner takes no more requests."""


class RequestStream:
  """One request's outputs, as an async iterator that ends after the output with a finish
  reason. If the engine fails, iterating raises its error."""

  def __init__(self, request: Request, owner: AsyncRunner):
    self.request = request
    self.finished = False
    self._owner = owner
    self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

  @property
  def request_id(self) -> str:
    return self.request.request_id

  def __aiter__(self) -> RequestStream:
    return self

  async def __anext__(self) -> RequestOutput:
    if self.finished:
      raise StopAsyncIteration
    item = await self._queue.get()
    if isinstance(item, BaseException):
      self.finished = True
      raise item
    self.finished = item.finished
    return item

  def abort(self) -> None:
    if not self.finished:
      self._owner.abort(self.request_id)


class AsyncRunner(Controls):
  """The engine loop on its thread, and the one door into it (`on_engine`); a training loop's
  controls (pause, resume, sleep, wake_up) are Controls'."""

  def __init__(self, runner: Runner,
               on_failure: Callable[[BaseException], Awaitable[None]] | None = None):
    """`on_failure` is awaited once, on the event loop, if the engine loop raises: before the
    open streams get their error, so that whoever sees the error also sees its consequences."""
    self._runner = runner  # Touched on the engine thread only, but for new_request's reads.
    self._on_failure = on_failure
    self._inbox: queue.SimpleQueue[tuple[Callable, object] | None] = queue.SimpleQueue()
    self._streams: dict[str, RequestStream] = {}  # Touched on the event loop's thread only.
    self._loop: asyncio.AbstractEventLoop | None = None
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self._calls: set[concurrent.futures.Future] = set()  # on_engine's, not yet run.

  @property
  def engine_info(self) -> EngineInfo:
    return self._runner.engine_info

  @property
  def constraints(self) -> Constraints:
    """The grammar compiler (thread-safe: the serving core compiles on its workers)."""
    return self._runner.constraints

  def new_request(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                  request_id: str | None = None, priority: int = 0,
                  cache_salt: str | None = None, grammar: Grammar | None = None,
                  lora: LoRARequest | None = None,
                  images: Sequence[ImageSpan] = ()) -> Request:
    """A request for `submit_request`, on any thread (it reads only fixed limits); raises
    RequestRejected for one that could never run. `images`: images.place_images' (a worker
    thread's: it preprocesses)."""
    return self._runner.new_request(prompt_ids, sampling, request_id, priority, cache_salt,
                                    grammar, lora, images)

  @property
  def page_store(self) -> PageStore | None:
    """The engine's page bytes (P/D handoffs); None: it keeps no host tier."""
    return self._runner.engine.page_store

  async def num_cached(self, token_ids: Sequence[int], cache_salt: str | None,
                       lora: str | None) -> int:
    """How many of the prompt's full pages an admission would reuse now (either tier)."""
    return await self.on_engine(lambda: kv_handoff.num_cached(
        self._runner.scheduler, token_ids, cache_salt, lora))

  async def export_prefix(self, token_ids: Sequence[int], cache_salt: str | None,
                          lora: str | None, skip: int) -> Callable[[], list[kv_handoff.Page]]:
    """The prompt's cached pages but the first `skip`: their copies dispatched between two
    steps; the callable (any thread) gives them."""
    return await self.on_engine(lambda: kv_handoff.export_prefix(
        self._runner.scheduler, self.page_store, token_ids, cache_salt, lora, skip))

  def importer(self, token_ids: Sequence[int], cache_salt: str | None,
               lora: str | None) -> kv_handoff.Importer:
    """Puts the prompt's pages in the host tier: its `add` runs through `on_engine`."""
    return kv_handoff.Importer(self._runner.scheduler, self.page_store, token_ids, cache_salt,
                               lora)

  async def add_lora(self, lora: LoRARequest, adapter: Any) -> None:
    """Makes adapter `lora` available to requests (between two steps); ValueError naming why
    not."""
    await self.on_engine(lambda: self._runner.add_lora(lora, adapter))

  async def remove_lora(self, lora_id: int) -> None:
    """Forgets an adapter (between two steps); ValueError while a request uses it."""
    await self.on_engine(lambda: self._runner.remove_lora(lora_id))

  async def update_weights(self, params: Any, in_flight: str = "finish") -> None:
    """Runner.update_weights between two steps: the requests in flight finish on the old
    weights first or are aborted (`in_flight`); ValueError naming a weight that does not fit."""
    await self.on_engine(lambda: self._runner.update_weights(params, in_flight))

  async def reset_prefix_cache(self) -> bool:
    """Runner.reset_prefix_cache, between two steps."""
    return await self.on_engine(self._runner.reset_prefix_cache)

  def start(self) -> None:
    """Starts the engine thread; call from the event loop that will consume the streams."""
    self._loop = asyncio.get_running_loop()
    self._thread = threading.Thread(target=self._run, name="jaxserve-runner", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    """Stops the engine thread after its current step; open streams get an error."""
    if self._thread is not None:
      self._inbox.put(None)
      self._thread.join()
      self._thread = None
    self._fail_all(RuntimeError("the engine loop stopped"))

  def submit(self, prompt_ids: Sequence[int], sampling: SamplingParams,
             request_id: str | None = None, priority: int = 0,
             cache_salt: str | None = None, grammar: Grammar | None = None) -> RequestStream:
    """Queues a request; raises at once (RequestRejected, ValueError) if it cannot be taken.
    `grammar`: sampling.constraint compiled already, which the event loop must not do."""
    self._check_id(request_id)
    return self._queue(self.new_request(prompt_ids, sampling, request_id, priority, cache_salt,
                                        grammar))

  def submit_request(self, req: Request) -> RequestStream:
    """Queues a request `new_request` built (on any thread: the serving core builds them on its
    workers); raises EngineDead, or ValueError for a request id in use."""
    self._check_id(req.request_id)
    return self._queue(req)

  def _queue(self, req: Request) -> RequestStream:
    stream = self._streams[req.request_id] = RequestStream(req, self)
    self._inbox.put((self._add, req))
    return stream

  def _check_id(self, request_id: str | None) -> None:
    if self._error is not None:
      raise EngineDead("the engine loop failed") from self._error
    if request_id is not None and request_id in self._streams:
      raise ValueError(f"request id {request_id!r} is already in use")

  def abort(self, request_id: str) -> None:
    self._inbox.put((self._runner.abort, request_id))

  async def on_engine(self, fn: Callable[[], Any]) -> Any:
    """fn() on the engine thread, between two steps (what changes the runner's state, such as
    adding an adapter): its result, or its exception raised here.

    Nothing a caller does reaches the engine loop: a caller cancelled before the engine thread
    takes the call leaves it undone (fn never runs); once fn has started it runs to its end
    (whoever must see its effect, serving/adapters.py, shields its await), and neither its
    exception nor a caller gone by then touches the loop."""
    if self._error is not None:
      raise EngineDead("the engine loop failed") from self._error
    done: concurrent.futures.Future = concurrent.futures.Future()
    self._calls.add(done)

    def run(_):
      if not done.set_running_or_notify_cancel():
        return  # The caller left first: undone.
      try:
        result = fn()
      except Exception as e:  # pylint: disable=broad-except  (the caller's to handle)
        done.set_exception(e)
      else:
        done.set_result(result)  # A running future cannot be cancelled: this cannot raise.
    self._inbox.put((run, None))
    try:
      return await asyncio.wrap_future(done)
    finally:
      self._calls.discard(done)

  async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                     request_id: str | None = None,
                     priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Streams one request; if the consumer stops early (a client disconnect), aborts it."""
    stream = self.submit(prompt_ids, sampling, request_id, priority)
    try:
      async for out in stream:
        yield out
    finally:
      stream.abort()

  # The engine thread.

  def _run(self) -> None:
    try:
      while self._drain_inbox(wait=not self._runner.can_step):
        # Asleep nothing may step, but aborts (of queued requests) still end their streams.
        outputs = self._runner.take_outbox() if self.is_sleeping else self._runner.step()
        if outputs:
          self._loop.call_soon_threadsafe(self._deliver, outputs)
    except BaseException as e:  # pylint: disable=broad-except
      # The cache and decode state were donated to the failed step: nothing on the device can be
      # trusted, so no request may go on. The owner decides what the process does next.
      self._error = e
      asyncio.run_coroutine_threadsafe(self._die(e), self._loop)

  def _drain_inbox(self, wait: bool) -> bool:
    """Runs every queued command (waiting for one when idle); False once told to stop."""
    try:
      command = self._inbox.get() if wait else self._inbox.get_nowait()
      while True:
        if command is None:
          return False
        fn, arg = command
        fn(arg)
        command = self._inbox.get_nowait()
    except queue.Empty:
      return True

  def _add(self, req: Request) -> None:
    try:
      self._runner.submit(req)
    except (ValueError, RuntimeError) as e:  # A duplicate id or a full queue.
      self._loop.call_soon_threadsafe(self._fail, req.request_id, e)

  # The event loop's thread.

  async def _die(self, error: BaseException) -> None:
    if self._on_failure is not None:
      await self._on_failure(error)
    dead = EngineDead(f"the engine loop failed: {type(error).__name__}: {error}")
    dead.__cause__ = error
    self._fail_all(dead)
    for call in list(self._calls):
      with contextlib.suppress(concurrent.futures.InvalidStateError):  # Ran before the failure.
        call.set_exception(dead)

  def _deliver(self, outputs: list[RequestOutput]) -> None:
    for out in outputs:
      stream = self._streams.get(out.request_id)
      if stream is None:
        continue
      stream._queue.put_nowait(out)  # pylint: disable=protected-access
      if out.finished:
        del self._streams[out.request_id]

  def _fail(self, request_id: str, error: BaseException) -> None:
    stream = self._streams.pop(request_id, None)
    if stream is not None:
      stream._queue.put_nowait(error)  # pylint: disable=protected-access

  def _fail_all(self, error: BaseException) -> None:
    for request_id in list(self._streams):
      self._fail(request_id, error)

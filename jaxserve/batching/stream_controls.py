"""What an RL loop drives the served engine with (issue 49), as vLLM names it: pause
(pause_generation) and resume, sleep and wake_up, and whether it is paused or asleep. A part of
AsyncRunner (stream.py), kept apart for size: every call runs on the engine thread between two
steps, through `on_engine`.

  pause(mode)   no request is admitted until resume; ABORT ends the unfinished ones (each gets
                its last output, finish reason abort), WAIT lets the running ones finish and
                returns then, KEEP freezes them where they are (batching.request.PauseMode).
  sleep(level)  pause(mode) (vLLM's default ABORT), then the engine frees its KV cache (1) and
                its weights too (2); refused while requests run (KEEP froze them).
  wake_up()     the engine back, the pause that sleep made ended.

Nothing accepted is lost: a request submitted while paused or asleep queues, and runs after
resume / wake_up. The engine loop waits on its inbox meanwhile and never steps an engine asleep
(stream.AsyncRunner._run).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from jaxserve.batching.request import PauseMode

_DRAIN_POLL_S = 0.005  # How often pause(WAIT) asks whether requests still run.


class Controls:
  """AsyncRunner's training-loop controls; it gives `_runner` (the Runner), `on_engine` and
  `reset_prefix_cache`."""

  _resume_on_wake = False  # `sleep` paused the runner: `wake_up` resumes it.
  _runner: Any
  on_engine: Callable
  reset_prefix_cache: Callable

  @property
  def is_paused(self) -> bool:
    return self._runner.pause_mode is not None  # One attribute's read: any thread.

  @property
  def is_sleeping(self) -> bool:
    return bool(self._runner.engine.sleep_level)

  async def pause(self, mode: PauseMode = PauseMode.ABORT, clear_cache: bool = True) -> None:
    """Runner.pause; WAIT returns once no request runs (still paused). `clear_cache` (vLLM's;
    not for KEEP): the prefix cache is forgotten then, as after new weights it must be."""
    await self.on_engine(lambda: self._runner.pause(mode))
    # Polled, so the engine loop stays as it is: one inbox command a poll, between two steps.
    while mode is PauseMode.WAIT and await self.on_engine(self._draining):
      await asyncio.sleep(_DRAIN_POLL_S)
    if clear_cache and mode is not PauseMode.KEEP:
      await self.reset_prefix_cache()

  async def resume(self) -> None:
    await self.on_engine(self._runner.resume)

  async def sleep(self, level: int = 1, mode: PauseMode = PauseMode.ABORT) -> int:
    """`pause(mode)`, then Runner.sleep; the device bytes freed. ValueError for a bad level,
    when asleep already, or after KEEP with requests running (they stay frozen, and a pause
    this call made is undone). `wake_up` ends the pause this call made; one made before stays
    until `resume` (so new weights can go in between)."""
    if level not in (1, 2):
      raise ValueError(f"sleep level must be 1 (the KV cache) or 2 (the KV cache and the "
                       f"weights), got {level!r}")
    if self.is_sleeping:
      raise ValueError(f"the engine is asleep already (level {self._runner.engine.sleep_level})")
    paused_before = self.is_paused
    await self.pause(mode, clear_cache=False)  # Runner.sleep forgets the prefix cache.
    try:
      freed = await self.on_engine(lambda: self._runner.sleep(level))
    except ValueError:
      if not paused_before:
        await self.resume()
      raise
    self._resume_on_wake = not paused_before
    return freed

  async def wake_up(self) -> None:
    """Runner.wake_up, and the end of the pause `sleep` made, in one call between two steps."""
    resume, self._resume_on_wake = self._resume_on_wake, False

    def wake():
      self._runner.wake_up()
      if resume:
        self._runner.resume()
    await self.on_engine(wake)

  def _draining(self) -> bool:
    """On the engine thread: paused to WAIT, and some request still runs."""
    return self._runner.pause_mode is PauseMode.WAIT and bool(self._runner.scheduler.running)

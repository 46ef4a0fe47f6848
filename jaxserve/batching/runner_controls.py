"""What a training loop drives the Runner with (issue 49), as vLLM names it: reset_prefix_cache,
pause and resume, sleep and wake_up, update_weights and update_lora. A part of Runner
(runner.py), kept apart for size, as stream_controls.py is of AsyncRunner: each call comes
between two steps.

  pause(mode)        no request admitted until resume(); ABORT ends the unfinished ones, WAIT
                     lets the running ones finish, KEEP freezes them (batching.request.PauseMode)
  sleep(level)       the engine frees its KV cache (1) and weights too (2); refused while a
                     request runs; queued ones wait for wake_up()
  update_weights(p)  new weights, the requests in flight finished on the old ones or aborted;
                     the prefix cache forgotten
"""

from __future__ import annotations

from typing import Any

from jaxserve.batching.request import PauseMode, RequestOutput
from jaxserve.config import LoRARequest


class RunnerControls:
  """Runner's training-loop controls; Runner gives `engine`, `scheduler`, `loras`, `_requests`,
  `_in_flight`, `_outbox`, `has_unfinished`, `abort`, `step` and `_collect`."""

  pause_mode: PauseMode | None = None  # None: not paused (pause(), resume()).

  def reset_prefix_cache(self) -> bool:
    """Forgets every cached prefix page, device and host tier (vLLM's reset_prefix_cache):
    False, changing nothing, while a request holds pages (finish or abort it first)."""
    done = self.scheduler.pools.reset_prefix_cache()
    if self.scheduler.pages.events is not None:
      self.scheduler.pages.events.flush()
    return done

  def pause(self, mode: PauseMode = PauseMode.ABORT) -> None:
    """vLLM's pause_generation: no request is admitted until resume(), and `mode` says what
    becomes of those already in. Requests submitted meanwhile queue, as do preempted ones.
    Pausing again changes the mode (ABORT then aborts the queued ones too)."""
    if mode is PauseMode.ABORT:
      for request_id in list(self._requests):
        self.abort(request_id)
    self.pause_mode = mode

  def resume(self) -> None:
    self.pause_mode = None

  @property
  def can_step(self) -> bool:
    """Whether step() has anything to do: awake, and a step in flight, an abort to report, or
    a request it may schedule (while paused the running ones only; frozen, none)."""
    if self.engine.sleep_level:
      return False
    if self._in_flight is not None or self._outbox:
      return True
    if self.pause_mode is None:
      return self.scheduler.has_unfinished
    return self.pause_mode is not PauseMode.KEEP and bool(self.scheduler.running)

  def take_outbox(self) -> list[RequestOutput]:
    """The aborted requests' last outputs that the next step() would report: for a caller that
    may not step (the engine asleep)."""
    outputs, self._outbox = self._outbox, []
    return outputs

  def sleep(self, level: int = 1) -> int:
    """Frees the engine's KV cache (level 1) and weights (2) between uses; the device bytes
    freed. Refused while a request runs (holds pages: pause(ABORT or WAIT) first); queued ones
    wait for wake_up. The prefix cache is forgotten (its pages are gone)."""
    if self.scheduler.running:
      raise ValueError(f"{len(self.scheduler.running)} requests are running: finish or abort "
                       "them before sleep")
    if self._in_flight is not None:  # Every sample in it is stale: its requests have left.
      self._outbox += self._collect(self._in_flight)
      self._in_flight = None
    self.reset_prefix_cache()
    return self.engine.sleep(level)

  def wake_up(self) -> None:
    self.engine.wake_up()

  def update_weights(self, params: Any, in_flight: str = "finish") -> None:
    """Writes new weights into the engine (Engine.update_weights; `params` checked first: a
    ValueError naming a weight that does not fit changes nothing). The unfinished requests
    (`in_flight`): "finish" runs them to their end on the old weights first, "abort" ends
    them; either way their last outputs come from the next step(). The prefix cache is
    forgotten, device and host tier: no page computed with the old weights is read again."""
    self.engine.check_weights(params)
    self._settle(in_flight)
    self.engine.update_weights(params)

  def update_lora(self, lora: LoRARequest, adapter: Any, in_flight: str = "finish") -> None:
    """update_weights for adapter `lora`'s weights (added already): its host copy, and its
    device slot if it sits in one."""
    if self.loras.get(lora.lora_int_id) != lora:
      raise ValueError(f"LoRA adapter {lora.lora_name!r} (id {lora.lora_int_id}) is not added")
    self._settle(in_flight)
    self.engine.update_lora(lora.lora_int_id, adapter,
                            self.scheduler.loras.slot_of(lora.lora_int_id))

  def _settle(self, in_flight: str) -> None:
    """Every unfinished request finished ("finish") or aborted ("abort"), their outputs kept
    for the next step(); then the prefix cache forgotten."""
    if in_flight not in ("finish", "abort"):
      raise ValueError(f"in_flight must be 'finish' or 'abort', got {in_flight!r}")
    if in_flight == "abort":
      for request_id in list(self._requests):
        self.abort(request_id)
    outputs = []
    while self.has_unfinished:
      outputs += self.step()
    self._outbox = outputs
    self.reset_prefix_cache()

"""The engine loop: plan a step, run it on the engine, turn sampled tokens into request outputs.

Each step is one engine call (`Engine.step(plan)`: every prefill chunk and decode token of the
plan). `step()` overlaps host and device. It dispatches step n+1 before it reads step n's tokens:

  schedule(n+1) -> dispatch(n+1) -> read tokens of n (StepFuture.result) -> outputs of n
    -> Scheduler.update(tokens of n)

The plan is final: the engine runs it as given, in one call, and the step's tokens go back to the
scheduler in one call (nano-vllm's schedule() / postprocess()).

Planning needs no token values (decode reads its input token from the engine's device state), and
the engine runs its steps in dispatch order, so while the host waits for step n, step n+1 is
already queued behind it. The price is that a request is seen to finish one step late: its slot
decodes once more, and that token is discarded (every sample carries the request's epoch, which
finishing, aborting and preempting all bump). A constrained request is the exception: its mask
needs its last token, so it decodes every other step (constrained.py tells how).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
import time
from typing import Any, Callable, Sequence

from jaxserve.batching.constrained import Constraints
from jaxserve.batching.images import ImageSpan
from jaxserve.batching.outputs import Outputs, token_logprobs
from jaxserve.batching.plan import Engine, EngineInfo, StepFuture
from jaxserve.batching.request import (
  Completion,
  FinishReason,
  PauseMode,
  Request,
  RequestOutput,
  RequestRejected,
)
from jaxserve.batching.runner_controls import RunnerControls
from jaxserve.batching.scheduler import ScheduledStep, Scheduler
from jaxserve.batching.stop import Detokenizer
from jaxserve.config import LoRARequest, SamplingParams, SchedulerConfig
from jaxserve.text.constraint import Grammar
from jaxserve.text.detokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class _Dispatched:
  """One step in flight: where its sampled tokens will land, and for whom."""

  future: StepFuture
  samples: list[tuple[Request, int]]  # (request, epoch) of each of the future's rows
  # Chunks that score or pool their prompt positions: (plan index, request, epoch, chunk start,
  # length).
  prompts: list[tuple[int, Request, int, int, int]] = dataclasses.field(default_factory=list)
  # Chunks that verify proposals (speculative decoding): (plan index, request, epoch).
  verifies: list[tuple[int, Request, int]] = dataclasses.field(default_factory=list)


class Runner(RunnerControls):

  def __init__(self, engine: Engine, tokenizer: Any, config: SchedulerConfig = SchedulerConfig(),
               detokenizer: Callable[[Any, Sequence[int]], Detokenizer] = IncrementalDetokenizer):
    """`tokenizer` has `.stop_ids` (the end-of-turn ids) and `.detokenize`; `detokenizer(tokenizer,
    prompt_ids)` makes a request's incremental detokenizer."""
    self.engine = engine
    self.tokenizer = tokenizer
    self.scheduler = Scheduler(config, engine)
    self._arrivals = itertools.count()
    self._requests: dict[str, Request] = {}  # Unfinished ones.
    self._in_flight: _Dispatched | None = None
    self._outbox: list[RequestOutput] = []  # Aborts, reported by the next step().
    self.constraints = Constraints(tokenizer, engine.info.vocab_size, engine.info.num_slots)
    self.outputs = Outputs(tokenizer, detokenizer, self.constraints)
    self.loras: dict[int, LoRARequest] = {}  # Adapters added to the engine, by id.
    self.pause_mode: PauseMode | None = None  # None: not paused (pause(), resume()).

  @property
  def engine_info(self) -> EngineInfo:
    return self.engine.info

  @property
  def has_unfinished(self) -> bool:
    return self.scheduler.has_unfinished or self._in_flight is not None or bool(self._outbox)

  def new_request(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                  request_id: str | None = None, priority: int = 0,
                  cache_salt: str | None = None,
                  grammar: Grammar | None = None, lora: LoRARequest | None = None,
                  images: Sequence[ImageSpan] = ()) -> Request:
    """Builds a request, or raises RequestRejected if it could never run. Reads only fixed
    limits, so another thread may call it while this one steps. `grammar`: sampling.constraint
    compiled already (the serving core's, in a worker thread); else it is compiled here.
    `lora`: the adapter it runs under, one `add_lora` added. `images`: a vision-language
    model's, placed in prompt_ids (images.place_images)."""
    self.scheduler.check(len(prompt_ids), sampling)
    self._check_lora(lora)
    if images and self.engine.info.vision is None:
      raise ValueError(f"this model is text-only: it takes no images, and the request has "
                       f"{len(images)}")
    if sampling.constraint is not None and grammar is None:  # A ValueError naming the problem.
      grammar = self.constraints.grammar(sampling.constraint, sampling.allowed_token_ids)
    seq = next(self._arrivals)
    seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
    return Request(request_id if request_id is not None else f"req-{seq}-{secrets.token_hex(4)}",
                   tuple(prompt_ids), sampling, seed, seq, priority, grammar=grammar,
                   cache_salt=cache_salt, lora=lora, images=tuple(images))

  def submit(self, req: Request) -> None:
    """Queues a request made by `new_request`."""
    if req.request_id in self._requests:
      raise ValueError(f"request id {req.request_id!r} is already in use")
    self._check_lora(req.lora)  # It may have been removed since new_request.
    self.scheduler.add(req)
    self._requests[req.request_id] = req
    self.outputs.start(req)
    self.constraints.start(req)

  def add_request(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                  request_id: str | None = None, priority: int = 0) -> Request:
    req = self.new_request(prompt_ids, sampling, request_id, priority)
    self.submit(req)
    return req

  def _check_lora(self, lora: LoRARequest | None) -> None:
    if lora is not None and self.loras.get(lora.lora_int_id) != lora:
      raise RequestRejected(f"LoRA adapter {lora.lora_name!r} (id {lora.lora_int_id}) is not "
                            "loaded")

  def add_lora(self, lora: LoRARequest, adapter: Any) -> None:
    """Makes adapter `lora` available to requests; `adapter`: its weights as the engine takes
    them (loading.lora.LoraAdapter). Raises ValueError for an id added under another name or
    path (remove it first), or past max_cpu_loras adapters."""
    known = self.loras.get(lora.lora_int_id)
    if known is not None and known != lora:
      raise ValueError(f"LoRA adapter id {lora.lora_int_id} is {known.lora_name!r} already")
    limit = self.engine.info.max_cpu_loras
    if known is None and limit is not None and len(self.loras) >= limit:
      raise ValueError(f"LoRA adapter {lora.lora_name!r}: {limit} adapters are loaded already "
                       "(max_cpu_loras); remove one first")
    self.engine.add_lora(lora.lora_int_id, adapter)
    self.loras[lora.lora_int_id] = lora

  def remove_lora(self, lora_id: int) -> bool:
    """Removes an adapter; False if it was not added. Raises ValueError while an unfinished
    request uses it."""
    if lora_id not in self.loras:
      return False
    users = [r.request_id for r in self._requests.values()
             if r.lora is not None and r.lora.lora_int_id == lora_id]
    if users:
      raise ValueError(f"LoRA adapter id {lora_id} is in use by {len(users)} requests")
    slot = self.scheduler.loras.slot_of(lora_id)
    self.scheduler.loras.forget(lora_id)
    self.engine.remove_lora(lora_id, slot)
    del self.loras[lora_id]
    return True

  def abort(self, request_id: str) -> bool:
    """Stops a request in any state; its last output (finish reason ABORT) comes from the next
    step(). False if it is unknown or already finished."""
    req = self._requests.get(request_id)
    if req is None:
      return False
    self.scheduler.abort(req)
    self._retire(req)  # First: an aborted request's last output carries no prompt logprobs.
    self._outbox.append(self.outputs.last(req, FinishReason.ABORT, "", time.monotonic()))
    return True

  def step(self) -> list[RequestOutput]:
    if self.engine.sleep_level:
      raise RuntimeError("the engine is asleep: wake_up() first")
    dispatched = (None if self.pause_mode is PauseMode.KEEP
                  else self._dispatch(self.scheduler.schedule(admit=self.pause_mode is None)))
    outputs = self.take_outbox()
    if self._in_flight is not None:
      outputs += self._collect(self._in_flight)
    self._in_flight = dispatched
    if self.scheduler.pages.events is not None:  # One batch of KV-cache events a step.
      self.scheduler.pages.events.flush()
    return outputs

  def generate(self, prompts: Sequence[tuple]) -> list[Completion]:
    """Runs every (prompt_ids, sampling), (prompt_ids, sampling, LoRARequest or None) or
    (prompt_ids, sampling, LoRARequest or None, its ImageSpans) to completion; results in input
    order. Every prompt is checked before any runs."""
    if self.pause_mode is not None:  # Nothing queued would run: it would never return.
      raise RuntimeError("the runner is paused: resume() first")
    reqs = [self.new_request(p[0], p[1], lora=p[2] if len(p) > 2 else None,
                             images=p[3] if len(p) > 3 else ()) for p in prompts]
    outputs = {r.request_id: [] for r in reqs}
    queued = collections.deque(reqs)
    while queued or self.has_unfinished:
      while queued and len(self.scheduler.waiting) < self.scheduler.config.max_queue_len:
        self.submit(queued.popleft())
      for out in self.step():
        outputs.get(out.request_id, []).append(out)
    return [r.completion(outputs[r.request_id]) for r in reqs]

  def _dispatch(self, scheduled: ScheduledStep) -> _Dispatched | None:
    plan = scheduled.plan
    if not plan.has_work:
      return None
    # The future's rows: the decode slots, then the chunks that end their prompts.
    pairs = list(zip(plan.prefills, scheduled.prefill_requests))
    ends = [req for chunk, req in pairs if chunk.is_last and not chunk.num_drafts]
    verifies = [(i, req, req.epoch) for i, (chunk, req) in enumerate(pairs) if chunk.num_drafts]
    samples = [(r, r.epoch) for r in scheduled.decode_requests] + [(r, r.epoch) for r in ends]
    prompts = [(i, req, req.epoch, chunk.start_pos, len(chunk.token_ids))
               for i, (chunk, req) in enumerate(zip(plan.prefills, scheduled.prefill_requests))
               if chunk.prompt_logprob_targets is not None or chunk.pool_len]
    mask = self.constraints.step_mask(scheduled.decode_requests, ends)
    future = self.engine.step(plan) if mask is None else self.engine.step(plan, mask)
    if samples or prompts or verifies:
      return _Dispatched(future, samples, prompts, verifies)
    return None

  def _collect(self, step: _Dispatched) -> list[RequestOutput]:
    """Reads a step's sampled tokens, turns them into outputs, and hands them to the scheduler
    in one call; stale ones are dropped unread."""
    for i, req, epoch, start, length in step.prompts:
      if req.epoch == epoch:  # Before the step's first tokens, which hand these out.
        self.outputs.store_prompt(req, step.future, i, start, length)
    outputs = [self._verified(req, step.future.verified(i))
               for i, req, epoch in step.verifies if req.epoch == epoch]
    live = [(i, req) for i, (req, epoch) in enumerate(step.samples) if req.epoch == epoch]
    if not live:
      return outputs
    tokens = step.future.result().tolist()
    # One read of the logprob arrays for the whole step, and none when nobody asked.
    arrays = step.future.logprobs() if any(r.sampling.logprobs for _, r in live) else None
    now = time.monotonic()
    singles = [self.outputs.token(req, tokens[i], now,
                                  token_logprobs(arrays, i, req.sampling.logprobs))
               for i, req in live]
    self.scheduler.update([(req, tokens[i], out.finished)
                           for (i, req), out in zip(live, singles)])
    for (_, req), out in zip(live, singles):
      if out.finished:
        self._retire(req)
    return outputs + singles

  def _verified(self, req: Request, verified) -> RequestOutput:
    """One output for a verified run's tokens (Outputs.verified); the scheduler takes them and
    rolls the rest back."""
    out = self.outputs.verified(req, verified, time.monotonic())
    self.scheduler.update_verified(req, out.token_ids, verified[0], out.finished)
    if out.finished:
      self._retire(req)
    return out

  def _retire(self, req: Request) -> None:
    del self._requests[req.request_id]
    self.outputs.end(req)
    self.constraints.end(req)

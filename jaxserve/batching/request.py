"""One request's host state: its tokens, counters, status and timestamps.

The runner creates a `Request` and decides when it stops; the scheduler moves it between queues,
owns its KV counters and appends the sampled tokens the runner hands back (`Scheduler.update`).
Token counters:

  all_token_ids        prompt + the output tokens that have reached the host
  num_pending_tokens   samples on the device, not read back yet (the overlap keeps one step in
                       flight); a verified chunk's is one sample of up to k + 1 tokens
  num_computed_tokens  positions whose KV write has been dispatched (a verified chunk in flight
                       counts all its proposals until it lands)
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any, Sequence

import numpy as np

from jaxserve.batching.acceptance import Acceptance
from jaxserve.batching.images import ImageSpan
from jaxserve.config import LoRARequest, SamplingParams


@dataclasses.dataclass(frozen=True)
class InFlightRun:
  """A verified chunk on the device (speculative.py): its proposals, and what they assumed."""

  drafts: tuple[int, ...]
  num_known: int  # len(all_token_ids) when it was proposed.
  # The tokens the proposals assumed would come after those (the outcome of the request's
  # sample then in flight); None: no assumption (a draft model proposes on the device).
  guess: tuple[int, ...] | None


class RequestStatus(enum.Enum):
  WAITING = "waiting"  # Queued, or preempted and queued again.
  RUNNING = "running"  # Holds a slot and KV pages.
  FINISHED = "finished"
  ABORTED = "aborted"


class FinishReason(enum.Enum):
  STOP = "stop"  # An end-of-turn id, one of sampling.stop_token_ids, or a stop string.
  LENGTH = "length"  # max_tokens reached, or the context window is full.
  ABORT = "abort"  # The client went away or cancelled.


class PauseMode(enum.Enum):
  """vLLM's pause modes (pause_generation's `mode`): what becomes of the requests already in."""
  ABORT = "abort"  # Each unfinished one ends now: its last output's finish reason is ABORT.
  WAIT = "wait"  # Running ones finish; none waiting is admitted.
  KEEP = "keep"  # Frozen: nothing is scheduled; after resume() each goes on where it stopped.


class RequestRejected(ValueError):
  """The request can never run (too long for the context window or the KV pool)."""


class QueueFull(RuntimeError):
  """The waiting queue is at SchedulerConfig.max_queue_len; retry later."""


@dataclasses.dataclass
class RequestTimings:
  """time.monotonic() stamps; the runner fills them in as the request moves along."""

  arrival: float
  admitted: float | None = None  # First admission (a preemption does not move it).
  first_token: float | None = None
  token_times: list[float] = dataclasses.field(default_factory=list)  # One per output token.
  finish: float | None = None

  @property
  def time_to_first_token(self) -> float | None:
    return None if self.first_token is None else self.first_token - self.arrival

  @property
  def queue_time(self) -> float | None:
    return None if self.admitted is None else self.admitted - self.arrival


@dataclasses.dataclass(eq=False)
class Request:
  request_id: str
  prompt_token_ids: tuple[int, ...]
  sampling: SamplingParams
  seed: int  # sampling.seed, or one drawn at random when it is None.
  arrival_seq: int  # Arrival order: FCFS tie-breaker and "newest" for preemption.
  priority: int = 0  # Lower runs first under QueuePolicy.PRIORITY.
  status: RequestStatus = RequestStatus.WAITING
  finish_reason: FinishReason | None = None
  stop_reason: int | str | None = None  # The stop token id or stop string that ended it.
  all_token_ids: list[int] = dataclasses.field(default_factory=list)
  # Scheduler state, reset by a preemption.
  slot: int | None = None
  page_table: list[int] = dataclasses.field(default_factory=list)
  # With window pages: the local layers' pages, indexed as page_table (0: not held).
  window_table: list[int] = dataclasses.field(default_factory=list)
  num_prefill_tokens: int = 0  # Tokens the current admission must prefill (prompt + outputs).
  num_computed_tokens: int = 0
  num_pending_tokens: int = 0
  num_cached_pages: int = 0  # Leading pages of page_table registered in the prefix cache.
  # Verified chunks in flight, oldest first (speculative.py).
  runs_in_flight: list[InFlightRun] = dataclasses.field(default_factory=list)
  num_draft_tokens: int = 0  # Proposals verified, over the request's life.
  num_accepted_tokens: int = 0  # Of those, the ones the model agreed with.
  # Its measured acceptance, which pauses its proposals while they do not pay.
  acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)
  # Bumped by every preemption and abort: a token sampled under an older epoch is discarded.
  epoch: int = 0
  num_preemptions: int = 0
  # Prompt tokens the prefix cache held at the first admission (usage's cached_tokens; never
  # more than the prompt: a preempted request's later hits are its own recomputed KV).
  num_cached_tokens: int = 0
  timings: RequestTimings = dataclasses.field(
      default_factory=lambda: RequestTimings(time.monotonic()))
  # sampling.constraint compiled for the vocabulary (a text.constraint.Grammar); None: free text.
  grammar: Any = None
  # Why the grammar engine ended the output early (a limit reached after the first token): the
  # output is a valid prefix, not a finished answer, and the serving core reports it as an error.
  constraint_error: str | None = None
  # Shares prefix-cache pages only with requests of the same salt (vLLM's cache_salt).
  cache_salt: str | None = None
  # The LoRA adapter it runs under (None: the base model), and the engine slot that holds it
  # while the request runs (lora_slots.py; 0 otherwise).
  lora: LoRARequest | None = None
  lora_slot: int = 0
  # Its images (a vision-language model's), each at its image tokens' positions (images.py).
  images: tuple[ImageSpan, ...] = ()
  # prompt + max_tokens; the scheduler rejects requests whose limit exceeds the context window.
  max_num_tokens: int = dataclasses.field(init=False)

  def __post_init__(self):
    if not self.all_token_ids:
      self.all_token_ids = list(self.prompt_token_ids)
    self.max_num_tokens = len(self.prompt_token_ids) + self.sampling.max_tokens

  def preempted(self) -> None:
    """Back to waiting, its pages let go: it recomputes its prompt and output tokens later."""
    self.status = RequestStatus.WAITING
    self.num_prefill_tokens = self.num_computed_tokens = self.num_pending_tokens = 0
    self.num_cached_pages = 0
    self.runs_in_flight = []
    self.epoch += 1  # Its token in flight is dropped; the recompute samples it again.
    self.num_preemptions += 1

  @property
  def num_prompt_tokens(self) -> int:
    return len(self.prompt_token_ids)

  @property
  def num_tokens_in_flight(self) -> int:
    """The most tokens its samples in flight may bring: one each, and a verified chunk's
    proposals if all are accepted."""
    return self.num_pending_tokens + sum(len(run.drafts) for run in self.runs_in_flight)

  @property
  def output_token_ids(self) -> list[int]:
    return self.all_token_ids[len(self.prompt_token_ids):]

  @property
  def num_output_tokens(self) -> int:
    return len(self.all_token_ids) - len(self.prompt_token_ids)

  @property
  def is_prefilling(self) -> bool:
    return self.num_computed_tokens < self.num_prefill_tokens

  @property
  def is_finished(self) -> bool:
    return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

  def completion(self, outputs: Sequence[RequestOutput]) -> Completion:
    """The finished request from all its outputs: their texts joined, each output token's
    logprobs when the sampling asked for them, the prompt's (from the first output)."""
    logprobs = None
    if self.sampling.logprobs:
      logprobs = tuple(lp for o in outputs for lp in o.logprobs or ())
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None),
                           None)
    return Completion(self.request_id, self.prompt_token_ids, tuple(self.output_token_ids),
                      "".join(o.text for o in outputs), self.finish_reason, self.stop_reason,
                      self.num_cached_tokens, self.timings, logprobs, prompt_logprobs,
                      self.num_draft_tokens, self.num_accepted_tokens,
                      next((o.pooled for o in outputs if o.pooled is not None), None))


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprobs:
  """One output token's log-probability under the model, and the most likely alternatives."""

  logprob: float  # Of the chosen token.
  top_ids: tuple[int, ...]  # The top SamplingParams.logprobs ids, most likely first.
  top_logprobs: tuple[float, ...]
  rank: int | None = None  # 1 + how many tokens were more likely; set for prompt tokens.


@dataclasses.dataclass(slots=True)  # Not frozen: one is built per token, and frozen is 3x slower.
class RequestOutput:
  """What one step produced for one request: a piece of its stream. Read-only by convention."""

  request_id: str
  token_ids: Sequence[int]  # New output tokens (a stop token is included; its text is not).
  text: str  # New text; text that might start a stop string is held back until it cannot.
  finish_reason: FinishReason | None  # Set on the request's last output.
  timings: RequestTimings  # The request's live timings.
  # One per token of token_ids, when the request's SamplingParams.logprobs > 0.
  logprobs: Sequence[TokenLogprobs] | None = None
  # On the request's first output, when SamplingParams.prompt_logprobs is set: one per prompt
  # token, None for the first (nothing comes before it).
  prompt_logprobs: Sequence[TokenLogprobs | None] | None = None
  # On a pooling request's (SamplingParams.pooling) last output: its pooled vector, float32 [D],
  # or a reranker's logits [C] (StepFuture.pooled).
  pooled: np.ndarray | None = None

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class Completion:
  """A finished request, as the offline `generate` returns it."""

  request_id: str
  prompt_token_ids: Sequence[int]
  token_ids: Sequence[int]
  text: str
  finish_reason: FinishReason | None
  stop_reason: int | str | None
  num_cached_tokens: int
  timings: RequestTimings
  # One per token of token_ids when SamplingParams.logprobs > 0 (vLLM's CompletionOutput.logprobs).
  logprobs: tuple[TokenLogprobs, ...] | None = None
  prompt_logprobs: Sequence[TokenLogprobs | None] | None = None  # As RequestOutput's.
  # Speculative decoding: tokens proposed and verified, and how many of them the model accepted.
  num_draft_tokens: int = 0
  num_accepted_tokens: int = 0
  pooled: np.ndarray | None = None  # As RequestOutput's.

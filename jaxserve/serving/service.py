"""The serving core both front ends call (gRPC in api/grpc_api.py, HTTP in api/http_api.py).

One request, in the order it happens:

  Service.accept: refused while draining, its API key, its key's requests per minute: cheap
    checks on the event loop, before any work is done on it; from here the drain counts it
    -> Service.prepare_runs, on a worker (work_pool.py), once however many choices it has:
       each prompt made ready (prepare.py: its images decoded, tokenized and templated, its
       fields checked, its max_tokens decided), its constraint compiled, priced under the key's
       tokens per minute, the engine requests of its n runs built
    -> Service.generate, per run: AsyncRunner.submit_request (the engine thread takes it
       before its next step) -> outputs, grouped into chunks of `chunk_tokens` tokens -> a
       RequestRecord at the end (metrics, the log line, usage and timings for the client, the
       key's tokens settled)

The event loop only routes: whatever costs CPU in proportion to what a client sent runs on the
work pool, whose queue is bounded (a request over it gets RESOURCE_EXHAUSTED at once). A front
end maps `ApiError.status` to its own codes. Every error is raised before the first chunk,
except an engine failure, a drain's cut, and a grammar-engine error after the first token.
When the consumer stops early (a client cancels or disconnects), the generator's cleanup aborts
the run: the engine thread drops it before its next step, and its
slot and pages are free again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any, AsyncIterator, Callable, Sequence

from absl import logging

from jaxserve.batching.request import (
  FinishReason,
  QueueFull,
  Request,
  RequestOutput,
  RequestRejected,
)
from jaxserve.batching.stream import AsyncRunner, EngineDead, RequestStream
from jaxserve.config import LoRARequest, SamplingParams
from jaxserve.serving import gateway
from jaxserve.serving.adapters import Adapters
from jaxserve.serving.constraint_gate import ConstraintGate
from jaxserve.serving.gateway import ApiError, ApiKey, Lease, Status
from jaxserve.serving.media import MediaLimits
from jaxserve.serving.metrics import Metrics, RequestRecord
from jaxserve.serving.prepare import PromptPreparer
from jaxserve.serving.requests import (
  Accepted,
  Chunk,
  GenerateInput,
  PrefillPeer,
  Prepared,
  Run,
)
from jaxserve.serving.weights_from_disk import WeightsFromDisk
from jaxserve.serving.work_pool import WorkPool
from jaxserve.text.constraint import Grammar

_SEEDS = 2**63  # SamplingParams' seed range: seed + run wraps inside it.


class Service:

  def __init__(self, runner: AsyncRunner, tokenizer: Any, model_name: str,
               gateway_: gateway.Gateway, metrics: Metrics, log_prompts: bool = False,
               pool: WorkPool | None = None, read_lora: Callable[[str], Any] | None = None,
               kv_peer: PrefillPeer | None = None,
               runtime_lora_roots: Sequence[str] | None = None, pooler: Any = None,
               read_weights: Callable[[str], Any] | None = None,
               weights_roots: Sequence[str] = (), media: MediaLimits = MediaLimits()):
    """`read_lora(path)`: reads a LoRA adapter's folder (serving/adapters.py); None: LoRA off.
    `kv_peer`: a decode server's prefill server (the PrefillPeer port), whose `fetch` brings
    each request's prompt KV before it is queued; None: every prompt is prefilled here.
    `runtime_lora_roots`: where run-time adapter loads may read (None: run-time updates off).
    `pooler`: a pooling model's batching.pooled.Pooler (serve --task embed|rerank), else None.
    `read_weights(folder)`, `weights_roots`: /update_weights_from_disk's (weights_from_disk.py)."""
    self.runner = runner
    self.tokenizer = tokenizer
    self.model_name = model_name
    self.gateway = gateway_
    self.metrics = metrics
    self.log_prompts = log_prompts
    self.pool = pool or WorkPool()
    self.refusing: str | None = None  # Why new requests get UNAVAILABLE (draining, a dead engine).
    self._open: set[Accepted] = set()
    self._idle = asyncio.Event()
    self._idle.set()
    self.engine_info = info = runner.engine_info
    self.vocab_size = info.vocab_size
    self.max_model_len = info.max_model_len
    # A prompt's checks and ids (the tokenizer routes' too), its images decoded and placed.
    self.prompts = PromptPreparer(tokenizer, info, model_name, media, kv_peer is not None)
    self.constraint_gate = ConstraintGate(runner.constraints)
    self.adapters = Adapters(runner, model_name, read_lora, runtime_lora_roots)
    self.kv_peer = kv_peer
    self.pooler = pooler
    self.weights = WeightsFromDisk(runner, read_weights, weights_roots)

  def model_info(self) -> dict[str, Any]:
    """The fields of the proto's ModelInfo."""
    info = self.engine_info
    return dict(name=self.model_name, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                num_slots=info.num_slots, prefill_buckets=list(info.prefill_buckets),
                page_size=info.page_size, num_pages=info.num_pages, dtype=info.dtype,
                has_chat_template=self.tokenizer.chat_template is not None,
                stop_token_ids=sorted(self.tokenizer.stop_ids))

  def check_model(self, model: str) -> LoRARequest | None:
    """The LoRA adapter `model` names (None: the base model); NOT_FOUND for a name not served."""
    return self.adapters.resolve(model)

  @contextlib.asynccontextmanager
  async def accept(self, presented_key: str | None, limited: bool = True,
                   as_key: ApiKey | None = None) -> AsyncIterator[Accepted]:
    """Takes one request, with the checks that cost nothing, before any work is done on it:
    UNAVAILABLE while draining, the API key (bearer token) `presented_key`, and with `limited`
    the key's requests per minute (RESOURCE_EXHAUSTED). A request refused later, before its
    answer began, is refunded: it counts as no request; so is one whose client leaves before it
    reached the engine. `as_key`: the identity the front end checked itself (the P/D peer's)."""
    if self.refusing is not None:
      raise ApiError(Status.UNAVAILABLE, self.refusing)
    key = as_key or self.gateway.authenticate(presented_key)
    acc = Accepted(self.pool, key, self.gateway.admit(key) if limited else Lease(None, key))
    self._open.add(acc)
    self._idle.clear()
    try:
      yield acc
    except ApiError:
      if not acc.answered:
        acc.lease.refund()
      raise
    except BaseException:
      if not acc.submitted:
        acc.lease.refund()
      raise
    finally:
      self._open.discard(acc)
      if not self._open:
        self._idle.set()

  # The work of one request, on a worker thread.

  def prepare(self, inp: GenerateInput) -> Prepared:
    """Every check of one prompt, whichever front end parsed it: the one entry point. Raises an
    ApiError naming the bad field (the scheduler still refuses what the KV pool cannot hold)."""
    return self.prompts.prepare(inp, self.check_model(inp.model))

  def compile_constraint(self, key: ApiKey, sampling: SamplingParams) -> Grammar | None:
    """A constrained request's grammar, on a worker: compiled (or found in the cache) within the
    key's compile budget (serving/constraint_gate.py); a schema, regex or grammar the engine
    refuses is INVALID_ARGUMENT naming the problem, before anything is queued. None without a
    constraint."""
    return self.constraint_gate.compile(key.name, sampling)

  def prepare_runs(self, lease: Lease, inputs: Sequence[GenerateInput],
                   num_runs: int = 1) -> list[Run]:
    """A request's whole preparation, on a worker: each prompt (input) checked, tokenized and its
    constraint compiled once; the request priced under its key's tokens per minute (each prompt
    once, each run's max_tokens); `num_runs` engine requests built from each prompt, run r
    seeded seed + r when the client gave a seed (else each draws its own). Prompt p's run r is
    run p * num_runs + r."""
    prepared = [self.prepare(inp) for inp in inputs]
    grammars = [self.compile_constraint(lease.key, p.sampling) for p in prepared]
    max_tokens = iter(lease.reserve(
        sum(len(p.prompt_ids) for p in prepared),
        [p.sampling.max_tokens for p in prepared for _ in range(num_runs)],
        can_shorten=inputs[0].max_tokens is None))
    runs = []
    cache_salts = [self.gateway.cache_salt(lease.key, inp.cache_salt) for inp in inputs]
    for inp, p, grammar, salt in zip(inputs, prepared, grammars, cache_salts):
      for run in range(num_runs):
        seed = p.sampling.seed if p.sampling.seed is None else (p.sampling.seed + run) % _SEEDS
        sampling = p.sampling.for_run(seed, next(max_tokens))
        try:
          request = self.runner.new_request(p.prompt_ids, sampling, inp.request_id,
                                            inp.priority, salt, grammar, p.lora, p.image_spans)
        except (RequestRejected, ValueError) as e:  # Too big for the KV pool.
          raise gateway.invalid(str(e)) from e
        runs.append(Run(inp, request, p.tokenize_s, p.chunk_tokens))
    return runs

  # Running, on the event loop.

  async def generate(self, acc: Accepted, run: Run) -> AsyncIterator[Chunk]:
    """One run's chunks. Its tokens are settled with the key when it ends."""
    if self.kv_peer is not None:  # P/D: the prompt's KV from the prefill server, if it comes.
      await self.kv_peer.fetch(self.runner, run.request)
    try:
      stream = self.runner.submit_request(run.request)
    except ValueError as e:  # A request id in use.
      raise gateway.invalid(str(e)) from e
    except EngineDead as e:  # It died a moment ago; `refusing` is about to say so.
      raise ApiError(Status.UNAVAILABLE, "the engine failed; the server is restarting") from e
    acc.submitted = True
    acc.streams.add(stream)
    num_out, reason, failed = 0, None, False
    try:
      async for outputs in self._chunks(stream, run.chunk_tokens):
        num_out += sum(len(o.token_ids) for o in outputs)
        reason = outputs[-1].finish_reason
        record = None
        if reason is not None:
          record = self._record(stream, acc, run, reason, num_out)
        if reason is FinishReason.ABORT and acc.is_cut:
          raise ApiError(Status.UNAVAILABLE, "the server shut down before this request finished "
                         f"({num_out} tokens generated); retry on another replica")
        # Read at the last output only: the engine thread sets the error before it makes that
        # output, but may set it while earlier outputs are still on their way here.
        if reason is not None and stream.request.constraint_error is not None:
          raise gateway.invalid(  # num_out counts the end-of-sequence token it forced.
              f"the {stream.request.sampling.constraint.kind.value} constraint could not go on "
              f"after {num_out - 1} tokens ({stream.request.constraint_error}): the output "
              "would be cut short; make the constraint smaller or simpler")
        yield _chunk(stream.request, outputs, run.input.logprobs, record)
    except ApiError:
      failed = True
      raise
    finally:
      acc.streams.discard(stream)
      if reason is None:  # The consumer left before the end (a cancel, a disconnect).
        stream.abort()
        if not failed:
          self._record(stream, acc, run, FinishReason.ABORT, num_out)

  async def _chunks(self, stream: RequestStream,
                    chunk_tokens: int) -> AsyncIterator[list[RequestOutput]]:
    """The stream's outputs in groups of `chunk_tokens` tokens (the last group may be short)."""
    group, num_tokens, first = [], 0, True
    try:
      async for out in stream:
        if first:
          self.metrics.prompt_tokens.inc(stream.request.num_prompt_tokens)
          first = False
        group.append(out)
        num_tokens += len(out.token_ids)
        self.metrics.generation_tokens.inc(len(out.token_ids))
        if out.finished or num_tokens >= chunk_tokens:
          yield group
          group, num_tokens = [], 0
    except QueueFull as e:
      raise ApiError(Status.RESOURCE_EXHAUSTED, f"the queue is full: {e}") from e
    except RequestRejected as e:  # Its adapter was unloaded before it reached the engine.
      raise ApiError(Status.NOT_FOUND, str(e)) from e
    except RuntimeError as e:
      logging.exception("request %s failed in the engine", stream.request_id)
      raise ApiError(Status.INTERNAL, "the engine failed; see the server log") from e

  def _record(self, stream: RequestStream, acc: Accepted, run: Run, reason: FinishReason,
              num_out: int) -> RequestRecord:
    record = RequestRecord.of(stream.request, acc.key.name, reason, acc.received, run.tokenize_s,
                              time.monotonic())
    acc.lease.settle(num_out, run.request.sampling.max_tokens)
    self.metrics.observe(record)
    if self.log_prompts:
      logging.info("request %s prompt: %r", stream.request_id,
                   self.tokenizer.detokenize(stream.request.prompt_token_ids))
    return record

  # Draining.

  @property
  def num_active(self) -> int:
    """Requests accepted and not yet ended, in whatever stage (being prepared included)."""
    return len(self._open)

  async def wait_idle(self, timeout: float) -> bool:
    """Waits for every open request to end; False if some are still open after `timeout`."""
    try:
      await asyncio.wait_for(self._idle.wait(), max(timeout, 0))
      return True
    except asyncio.TimeoutError:
      return False

  def abort_all(self) -> None:
    """Ends every open request, whatever its stage: each client gets UNAVAILABLE."""
    for acc in list(self._open):
      acc.cut()


def _chunk(request: Request, outputs: Sequence[RequestOutput], num_top: int | None,
           record: RequestRecord | None) -> Chunk:
  logprobs = None
  if num_top is not None:
    logprobs = [dataclasses.replace(lp, top_ids=lp.top_ids[:num_top],
                                    top_logprobs=lp.top_logprobs[:num_top])
                for o in outputs for lp in (o.logprobs or ())]
  prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None),
                         None)
  return Chunk(request.request_id, "".join(o.text for o in outputs),
               [t for o in outputs for t in o.token_ids], logprobs, outputs[-1].finish_reason,
               record, request.prompt_token_ids, prompt_logprobs, outputs[-1].pooled)

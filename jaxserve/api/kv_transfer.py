"""Prefill/decode disaggregation between two servers, over the gRPC service (`PrefillKV`).

  client -> decode server (--kv-role decode --kv-peer HOST:PORT): tokenizes and checks the
    request as always, then, before queueing it, asks the prefill server for its prompt's KV
    -> prefill server (--kv-role prefill): runs the prompt and its first token as a request of
    its own, then streams the pages its prefix cache keeps for it (batching/kv_handoff.py): a
    header naming the pages' layout, then one message a page with its CRC-32
    -> decode server: checks each page, imports the intact ones into its host tier, then queues
    the request, whose admission loads them and prefills only the rest (its first token is its
    own), and streams the answer to the client.

Whatever goes wrong with a handoff (the peer down, hung past the deadline or dying mid-stream, a
page whose CRC-32 does not match, a stream cut short, a peer of another layout or other weights,
no room in the host tier) costs only the pages it did not bring: the request is recomputed
locally from the first page missing, and the outcome is counted
(`jaxserve:kv_transfers{outcome}`). A peer that fails opens the circuit (api/kv_link.py): for a
while no request waits for it ("circuit_open"), then one tries it again. The link itself (the
credential, TLS, the model's identity, the check at start) is api/kv_link.py's.

Nothing is held on either side while pages travel: the prefill server's request has finished
and its pages are only cached (the engine thread dispatches their copies between two steps, a
worker reads the bytes), and the decode server's host tier takes pages, a batch at a time as
they arrive (at most MAX_BUFFER_BYTES wait in memory), as cached ones, which it may evict.

The transport is this gRPC service, not `jax.experimental.transfer`: its transfer server starts
on this CPU, but its API is experimental and undocumented, a pull that never comes keeps the
sender's arrays alive, and it moves device arrays, where the decode side wants the bytes in its
host tier (and a CRC it can check) anyway. Over gRPC a page is one message (SmolLM2's float32
page: 720 KiB); the decode side takes no message larger than a page of its own.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import AsyncIterator, Sequence

import grpc
from absl import logging

from jaxserve.api import kv_link
from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.api.proto import jaxserve_pb2_grpc
from jaxserve.batching import kv_handoff
from jaxserve.batching.request import Request
from jaxserve.batching.stream import AsyncRunner
from jaxserve.config import LoRARequest, SamplingParams

# Pages received and not yet in the host tier, at most: a batch is imported when the next page
# would pass it (a page larger than it is imported alone).
MAX_BUFFER_BYTES = 16 * 2**20
_FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)
# Outcomes that say the peer, not one stream, is at fault: they open the circuit.
PEER_FAILURES = frozenset({"unavailable", "deadline", "rpc_error", "layout", "model_mismatch"})


class TransferError(Exception):
  """A handoff that brought fewer pages than it announced; `outcome` labels the metric."""

  def __init__(self, outcome: str, message: str):
    super().__init__(message)
    self.outcome = outcome


def _lora_key(lora: LoRARequest | None) -> str | None:
  return None if lora is None else lora.cache_key


def header(store: kv_handoff.PageStore, model: str, num_pages: int = 0,
           first_token: int = -1) -> pb.KVPage:
  return pb.KVPage(layout=store.layout(), model=model, num_pages=num_pages,
                   first_token=first_token)


async def prefill(runner: AsyncRunner, token_ids: Sequence[int], cache_salt: str | None,
                  lora: LoRARequest | None, request_id: str | None, skip: int,
                  model: str) -> AsyncIterator[pb.KVPage]:
  """The prefill server's side: the prompt run to its first token, then its pages streamed
  but the first `skip` (the decode server's already), under a header naming `model` (the
  fingerprint of the weights and adapter). No prompt: the header alone (the check at start)."""
  store = runner.page_store
  if not token_ids:
    yield header(store, model)
    return
  req = runner.new_request(token_ids, _FIRST_TOKEN, request_id, cache_salt=cache_salt,
                           lora=lora)
  stream = runner.submit_request(req)
  first = -1
  try:
    async for out in stream:
      first = out.token_ids[0] if out.token_ids else first
  finally:
    stream.abort()  # The caller left before the prefill ended: it is dropped.
  export = await runner.export_prefix(req.prompt_token_ids, cache_salt, _lora_key(lora), skip)
  pages = await asyncio.to_thread(lambda: [(p, zlib.crc32(p.data)) for p in export()])
  yield header(store, model, len(pages), first)
  for page, crc in pages:
    yield pb.KVPage(group=page.group, index=page.index, data=page.data, crc32=crc)


async def start(config, store: kv_handoff.PageStore | None, gate: kv_link.PeerGate | None,
                counter=None) -> KVPeer | None:
  """A P/D role's start, once the engine is loaded (`config`: api/server_config.ServerConfig): the
  model's identity (computed off the event loop) for the prefill side's gate, or the decode
  side's peer, checked (raises kv_link.PeerRefused)."""
  if config.kv_role == "both":
    return None
  if store is None:
    raise ValueError(f"kv_role {config.kv_role} needs the engine's page copies: give it a host "
                     "tier (EngineConfig.kv_offload_gib, --kv-offload-gib)")
  identity = kv_link.ModelIdentity(await asyncio.to_thread(store.fingerprint))
  if gate is not None:
    gate.identity = identity
    return None
  if config.kv_peer_api_key and config.kv_peer_tls_ca is None and not kv_link.is_loopback(
      config.kv_peer.rpartition(":")[0]):
    logging.warning("the P/D peer credential travels to %s in plain text: give "
                    "--kv-peer-tls-ca", config.kv_peer)
  peer = KVPeer(config.kv_peer, identity, config.kv_peer_api_key, config.kv_peer_timeout_s,
                config.kv_peer_tls_ca, counter)
  await peer.check(store)
  return peer


class _Batches:
  """Pages received, put in the host tier a batch at a time: at most MAX_BUFFER_BYTES of them
  (or one page) wait in memory."""

  def __init__(self, runner: AsyncRunner, importer: kv_handoff.Importer):
    self._runner, self._importer = runner, importer
    self._pages: list[kv_handoff.Page] = []
    self._bytes = 0
    self.num_received = self.num_imported = self.max_bytes = 0

  async def add(self, page: kv_handoff.Page) -> None:
    if self._pages and self._bytes + len(page.data) > MAX_BUFFER_BYTES:
      await self.flush()
    self._pages.append(page)
    self._bytes += len(page.data)
    self.num_received += 1
    self.max_bytes = max(self.max_bytes, self._bytes)

  async def flush(self) -> None:
    pages, self._pages, self._bytes = self._pages, [], 0
    if pages:
      self.num_imported += await self._runner.on_engine(lambda: self._importer.add(pages))


def _rpc_outcome(e: grpc.RpcError) -> str:
  return {grpc.StatusCode.UNAVAILABLE: "unavailable",
          grpc.StatusCode.DEADLINE_EXCEEDED: "deadline"}.get(e.code(), "rpc_error")


class KVPeer:
  """The decode server's side: its prefill server, and the outcomes of its handoffs."""

  def __init__(self, address: str, identity: kv_link.ModelIdentity, api_key: str | None = None,
               timeout_s: float = 10.0, tls_ca: str | None = None, counter=None):
    """`timeout_s`: a handoff's deadline (the peer's prefill included); `tls_ca`: the PEM CA
    that verifies the peer's certificate (None: plain text); `counter`: a prometheus Counter
    labelled by outcome (Metrics.kv_transfers)."""
    self.address, self.identity = address, identity
    self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    self._timeout, self._tls_ca = timeout_s, tls_ca
    self._counter = counter
    self._channel: grpc.aio.Channel | None = None  # Made on the event loop, at first use.
    self.circuit = kv_link.Circuit()
    self.num_pages = 0  # Pages imported, in all.
    self.max_buffered_bytes = 0  # The most bytes of received pages held at once.

  async def check(self, store: kv_handoff.PageStore) -> None:
    """At start: one PrefillKV of no prompt, for the header alone. Raises kv_link.PeerRefused
    when the peer refuses this server (the credential, its role) or computes other pages
    (layout, weights); a peer that does not answer is logged and left to the circuit."""
    head, call = None, self._call(store, pb.PrefillKVRequest())
    try:
      async for head in call:
        break
    except grpc.RpcError as e:
      if e.code() in kv_link.PEER_REFUSALS:
        raise kv_link.PeerRefused(f"the prefill server at {self.address} refused this decode "
                                  f"server: {e.code().name}: {e.details()}") from e
      logging.warning("the prefill server at %s does not answer (%s: %s); prefilling here "
                      "until it does", self.address, e.code().name, e.details())
      return
    finally:
      call.cancel()
    try:
      self._check_header(head, store, self.identity.of(None))
    except TransferError as e:
      raise kv_link.PeerRefused(f"the prefill server at {self.address} cannot be this "
                                f"server's peer: {e}") from e

  async def fetch(self, runner: AsyncRunner, req: Request) -> int:
    """Prefills `req`'s prompt on the peer and imports its pages; how many were imported. Never
    raises for the peer's faults: the request then recomputes what did not arrive."""
    store, ids, lora = runner.page_store, req.prompt_token_ids, _lora_key(req.lora)
    have = await runner.num_cached(ids, req.cache_salt, lora)
    if have == (len(ids) - 1) // runner.engine_info.page_size:
      return 0  # Every full page a prefix hit could reuse is here (or there is none).
    if not self.circuit.allow():
      self._count("circuit_open")
      return 0
    batches = _Batches(runner, runner.importer(ids, req.cache_salt, lora))
    try:
      outcome = await self._handoff(store, req, have, batches)
      await batches.flush()  # The intact pages before a fault.
    except BaseException:  # Its caller left: as a probe, it proved nothing.
      self.circuit.abandon()
      raise
    self.circuit.record(failed=outcome in PEER_FAILURES)
    if outcome == "ok" and batches.num_imported < batches.num_received:
      outcome = "host_tier_full" if batches.num_imported else "not_imported"
    self.num_pages += batches.num_imported
    self.max_buffered_bytes = max(self.max_buffered_bytes, batches.max_bytes)
    self._count(outcome)
    return batches.num_imported

  async def _handoff(self, store, req: Request, have: int, batches: _Batches) -> str:
    """Receives the pages into `batches`; the outcome."""
    try:
      await self._receive(store, req, have, batches)
    except TransferError as e:
      logging.warning("KV handoff of %s from %s: %s; recomputing from page %d", req.request_id,
                      self.address, e, batches.num_received)
      return e.outcome
    except grpc.RpcError as e:
      logging.warning("KV handoff of %s from %s failed: %s %s; recomputing from page %d",
                      req.request_id, self.address, e.code().name, e.details(),
                      batches.num_received)
      return _rpc_outcome(e)
    return "ok"

  async def _receive(self, store, req: Request, skip: int, batches: _Batches) -> None:
    """Adds each intact page, in stream order, to `batches` (all but the first `skip`);
    raises at the first fault."""
    call = self._call(store, pb.PrefillKVRequest(
        token_ids=req.prompt_token_ids, cache_salt=req.cache_salt or "",
        model="" if req.lora is None else req.lora.lora_name, request_id=req.request_id,
        cached_pages=skip))
    head = None
    try:
      model = await self._model(req.lora)
      async for msg in call:
        if head is None:
          head = msg
          self._check_header(msg, store, model)
          continue
        self._check_page(msg, store, batches.num_received, head.num_pages)
        await batches.add(kv_handoff.Page(msg.group, msg.index, msg.data))
    finally:
      call.cancel()
    if head is None or batches.num_received != head.num_pages:
      announced = "no header" if head is None else f"{head.num_pages} announced"
      raise TransferError("incomplete", f"the stream ended after {batches.num_received} pages "
                          f"({announced})")

  async def _model(self, lora: LoRARequest | None) -> str:
    """This server's fingerprint for `lora` (an adapter's files are read once, on a worker)."""
    try:
      return await asyncio.to_thread(self.identity.of, lora)
    except OSError as e:  # Its folder is gone: no peer's pages can be shown to be its.
      raise TransferError("model_mismatch", f"the adapter's files cannot be read: {e}") from e

  def _check_header(self, head: pb.KVPage | None, store, model: str) -> None:
    layout = tuple(store.layout())
    if head is None:
      raise TransferError("incomplete", "the stream ended before its header")
    if tuple(head.layout) != layout:
      raise TransferError("layout", f"the peer's pages are {list(head.layout)}, this "
                          f"server's {list(layout)}")
    if head.model != model:
      raise TransferError("model_mismatch", f"the peer's pages are of the model {head.model!r}, "
                          f"this server runs {model!r} (another checkpoint, dtype or adapter)")

  @staticmethod
  def _check_page(msg: pb.KVPage, store, num_received: int, num_pages: int) -> None:
    if num_received >= num_pages:
      raise TransferError("malformed", f"more pages than the {num_pages} announced")
    if msg.group >= len(store.layout()) or len(msg.data) != store.page_nbytes(msg.group):
      raise TransferError("malformed", f"page {msg.index} of group {msg.group} is no page of "
                          "this server's layout")
    if zlib.crc32(msg.data) != msg.crc32:
      raise TransferError("corrupt", f"page {msg.index} of group {msg.group} fails its CRC-32")

  def _call(self, store, request: pb.PrefillKVRequest):
    if self._channel is None:  # A message is one page: no larger one is taken.
      largest = max(store.page_nbytes(g) for g in range(len(store.layout())))
      self._channel = kv_link.channel(self.address, self._tls_ca, largest + 2**16)
    stub = jaxserve_pb2_grpc.JaxserveStub(self._channel)
    return stub.PrefillKV(request, metadata=self._metadata, timeout=self._timeout)

  def _count(self, outcome: str) -> None:
    if self._counter is not None:
      self._counter.labels(outcome).inc()

  async def close(self) -> None:
    if self._channel is not None:
      await self._channel.close()

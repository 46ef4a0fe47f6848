"""Prefill/decode disaggregation between two servers, over the gRPC service (`PrefillKV`).

  client -> decode server (--kv-role decode --kv-peer HOST:PORT): tokenizes and checks the
    request as always, then, before queueing it, asks the prefill server for its prompt's KV
    -> prefill server (--kv-role prefill): runs the prompt and its first token as a request of
    its own, then streams the pages its prefix cache keeps for it (batching/kv_handoff.py): a
    header naming the pages' layout, then one message a page with its CRC-32
    -> decode server: checks each page, imports the intact ones into its host tier, then queues
    the request, whose admission loads them and prefills only the rest (its first token is its
    own), and streams the answer to the client.

Whatever goes wrong with a handoff (the peer down or dying mid-stream, a page whose CRC-32 does
not match, a stream cut short, a peer of another layout, no room in the host tier) costs only
the pages it did not bring: the request is recomputed locally from the first page missing, and
the outcome is counted (`jaxserve:kv_transfers{outcome}`). Nothing is held on either side while
pages travel: the prefill server's request has finished and its pages are only cached (their
bytes copied out between two steps), and the decode server's host tier takes pages as cached
ones, which it may evict.

The transport is this gRPC service, not `jax.experimental.transfer`: its transfer server starts
on this CPU, but its API is experimental and undocumented, a pull that never comes keeps the
sender's arrays alive, and it moves device arrays, where the decode side wants the bytes in its
host tier (and a CRC it can check) anyway. Over gRPC a page is one message (SmolLM2's float32
page: 720 KiB), well under the 8 MiB message limit.
"""

from __future__ import annotations

import zlib
from typing import AsyncIterator, Sequence

import grpc
from absl import logging

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.api.proto import jaxserve_pb2_grpc
from jaxserve.batching import kv_handoff
from jaxserve.batching.request import Request
from jaxserve.batching.stream import AsyncRunner
from jaxserve.config import LoRARequest, SamplingParams

MAX_MESSAGE_BYTES = 64 * 2**20  # A page of a large model's bfloat16 KV (Llama-3-8B's: 2 MiB).
_FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)


class TransferError(Exception):
  """A handoff that brought fewer pages than it announced; `outcome` labels the metric."""

  def __init__(self, outcome: str, message: str):
    super().__init__(message)
    self.outcome = outcome


def _lora_key(lora: LoRARequest | None) -> str | None:
  return None if lora is None else lora.cache_key


async def prefill(runner: AsyncRunner, token_ids: Sequence[int], cache_salt: str | None,
                  lora: LoRARequest | None, request_id: str | None,
                  skip: int = 0) -> AsyncIterator[pb.KVPage]:
  """The prefill server's side: the prompt run to its first token, then its pages streamed
  but the first `skip` (the decode server's already)."""
  store = runner.runner.engine.page_store
  if store is None:
    raise ValueError("this server keeps no page copies: start it with --kv-role prefill")
  req = runner.runner.new_request(token_ids, _FIRST_TOKEN, request_id, cache_salt=cache_salt,
                                  lora=lora)
  stream = runner.submit_request(req)
  first = -1
  try:
    async for out in stream:
      first = out.token_ids[0] if out.token_ids else first
  finally:
    stream.abort()  # The caller left before the prefill ended: it is dropped.
  scheduler = runner.runner.scheduler
  pages = await runner.on_engine(lambda: kv_handoff.export_prefix(
      scheduler, store, req.prompt_token_ids, cache_salt, _lora_key(lora), skip))
  yield pb.KVPage(layout=store.layout(), num_pages=len(pages), first_token=first)
  for page in pages:
    yield pb.KVPage(group=page.group, index=page.index, data=page.data,
                    crc32=zlib.crc32(page.data))


class KVPeer:
  """The decode server's side: its prefill server, and the outcomes of its handoffs."""

  def __init__(self, address: str, api_key: str | None = None, timeout_s: float = 120.0,
               counter=None):
    """`counter`: a prometheus Counter labelled by outcome (Metrics.kv_transfers)."""
    self.address = address
    self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    self._timeout = timeout_s
    self._counter = counter
    self._channel: grpc.aio.Channel | None = None  # Made on the event loop, at first use.
    self.num_pages = 0  # Pages imported, in all.

  async def fetch(self, runner: AsyncRunner, req: Request) -> int:
    """Prefills `req`'s prompt on the peer and imports its pages; how many were imported. Never
    raises for the peer's faults: the request then recomputes what did not arrive."""
    store, scheduler = runner.runner.engine.page_store, runner.runner.scheduler
    ids, lora = req.prompt_token_ids, _lora_key(req.lora)
    have = await runner.on_engine(lambda: kv_handoff.num_cached(scheduler, ids, req.cache_salt,
                                                                lora))
    if have == (len(ids) - 1) // runner.engine_info.page_size:
      return 0  # Every full page a prefix hit could reuse is here (or there is none).
    pages: list[kv_handoff.Page] = []
    outcome = "ok"
    try:
      await self._receive(req, store.layout(), pages, have)
    except TransferError as e:
      outcome = e.outcome
      logging.warning("KV handoff of %s from %s: %s; recomputing from page %d", req.request_id,
                      self.address, e, len(pages))
    except grpc.RpcError as e:
      outcome = "unavailable" if e.code() is grpc.StatusCode.UNAVAILABLE else "rpc_error"
      logging.warning("KV handoff of %s from %s failed: %s %s; recomputing from page %d",
                      req.request_id, self.address, e.code().name, e.details(), len(pages))
    imported = await runner.on_engine(lambda: kv_handoff.import_prefix(
        scheduler, store, ids, pages, req.cache_salt, lora))
    if outcome == "ok" and imported < len(pages):
      outcome = "host_tier_full" if imported else "not_imported"
    self.num_pages += imported
    if self._counter is not None:
      self._counter.labels(outcome).inc()
    return imported

  async def _receive(self, req: Request, layout: Sequence[str], pages: list[kv_handoff.Page],
                     skip: int) -> None:
    """Appends each intact page, in stream order, to `pages` (all but the first `skip`);
    raises at the first fault."""
    if self._channel is None:
      options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
      self._channel = grpc.aio.insecure_channel(self.address, options=options)
    stub = jaxserve_pb2_grpc.JaxserveStub(self._channel)
    call = stub.PrefillKV(pb.PrefillKVRequest(
        token_ids=req.prompt_token_ids, cache_salt=req.cache_salt or "",
        model="" if req.lora is None else req.lora.lora_name, request_id=req.request_id,
        cached_pages=skip),
        metadata=self._metadata, timeout=self._timeout)
    try:
      header = None
      async for msg in call:
        if header is None:
          header = msg
          if tuple(msg.layout) != tuple(layout):
            raise TransferError("layout", f"the peer's pages are {list(msg.layout)}, this "
                                f"server's {list(layout)}")
          continue
        if zlib.crc32(msg.data) != msg.crc32:
          raise TransferError("corrupt", f"page {msg.index} of group {msg.group} fails its "
                              "CRC-32")
        pages.append(kv_handoff.Page(msg.group, msg.index, msg.data))
      if header is None or len(pages) != header.num_pages:
        announced = "no header" if header is None else f"{header.num_pages} announced"
        raise TransferError("incomplete", f"the stream ended after {len(pages)} pages "
                            f"({announced})")
    finally:
      call.cancel()

  async def close(self) -> None:
    if self._channel is not None:
      await self._channel.close()

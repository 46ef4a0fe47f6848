"""Publishes the prefix cache's events over ZMQ, as vLLM's `ZmqEventPublisher` does.

The engine thread hands each step's allocator ops to a queue (`sink`) and goes on; this thread
hashes them into vLLM's events (batching/kv_events.py), encodes each step's batch with msgpack
and sends it as three frames: the topic, an 8-byte big-endian sequence number, the payload.
With a replay endpoint, a ROUTER socket answers a request [identity, b"", start seq] with every
kept batch from that seq on ([identity, b"", seq, payload] each), then [identity, b"", -1, b""],
the frames vLLM's subscribers (and llm-d's) expect.

The first batch says AllBlocksCleared: whatever a router remembers of this endpoint is from an
earlier run. A full queue blocks the engine thread, as vLLM's does: dropping a batch would leave
the router's index wrong for good.
"""

from __future__ import annotations

import collections
import queue
import threading

from absl import logging

from jaxserve.batching.kv_events import ALL_BLOCKS_CLEARED, EventMirror, KVEventLog, batch
from jaxserve.config.kv_events import KVEventsConfig

_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_CLEARED = object()  # Queued first: the AllBlocksCleared batch.


class ZmqPublisher:

  def __init__(self, config: KVEventsConfig, page_size: int):
    try:  # The kv-events extra: only a server that publishes needs them.
      import msgpack
      import zmq
    except ImportError as e:
      raise ImportError(f"--kv-events-config needs pyzmq and msgpack: pip install "
                        f"'jaxserve[kv-events]' ({e})") from e

    self._pack = msgpack.packb
    self._config = config
    self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
    self._mirror = EventMirror(page_size, config.hash_seed)
    self._kept: collections.deque[tuple[int, bytes]] = collections.deque(
        maxlen=config.buffer_steps)
    self._topic = config.topic.encode()
    self._seq = 0
    # Bound here, so a port in use fails the server's start, not a thread later.
    self._ctx = zmq.Context.instance()
    self._pub = self._ctx.socket(zmq.PUB)
    self._pub.set_hwm(config.hwm)
    _bind_or_connect(self._pub, config.endpoint)
    self._replay = None
    if config.replay_endpoint is not None:
      self._replay = self._ctx.socket(zmq.ROUTER)
      self._replay.bind(config.replay_endpoint)
    self._queue.put(_CLEARED)
    self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
    self._thread.start()

  def attach(self, allocator) -> None:
    """Makes `allocator` (the scheduler's full pool) record its changes for this publisher."""
    allocator.events = KVEventLog(self.sink)

  def sink(self, ops: list[tuple]) -> None:
    """One step's ops, from the engine thread."""
    self._queue.put(ops)

  def close(self, timeout: float = 2.0) -> None:
    """Sends what is queued (within `timeout`), then closes the sockets."""
    self._queue.put(None)
    self._thread.join(timeout)
    self._pub.close(linger=0)
    if self._replay is not None:
      self._replay.close(linger=0)

  def _run(self) -> None:
    while True:
      if self._replay is not None and self._replay.poll(0):
        self._serve_replay()
      try:
        item = self._queue.get(timeout=0.05)
      except queue.Empty:
        continue
      if item is None:
        return
      try:
        events = [ALL_BLOCKS_CLEARED] if item is _CLEARED else self._mirror.events(item)
        if events:
          self._send(self._pack(batch(events)))
      except Exception:  # A bad batch must not stop the ones after it.
        logging.exception("kv-events: publishing a batch failed")

  def _send(self, payload: bytes) -> None:
    seq = self._seq
    self._seq += 1
    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
    self._kept.append((seq, payload))

  def _serve_replay(self) -> None:
    frames = self._replay.recv_multipart()
    if len(frames) != 3:
      logging.warning("kv-events: a replay request of %d frames, not 3", len(frames))
      return
    client, _, start = frames
    start_seq = int.from_bytes(start, "big")
    for seq, payload in list(self._kept):
      if seq >= start_seq:
        self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
    self._replay.send_multipart((client, b"", _END_SEQ, b""))


def _bind_or_connect(socket, endpoint: str) -> None:
  """vLLM's rule: a wildcard or local address is bound (a stable server), another connected to."""
  if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
    socket.bind(endpoint)
  else:
    socket.connect(endpoint)


def start(config: KVEventsConfig | None, scheduler) -> ZmqPublisher | None:
  """A publisher of `scheduler`'s prefix cache, when `config` asks for one."""
  if config is None or not config.publishes:
    return None
  publisher = ZmqPublisher(config, scheduler.page_size)
  publisher.attach(scheduler.pages)
  logging.info("kv-events: publishing to %s (topic %r, block size %d)", config.endpoint,
               config.topic, scheduler.page_size)
  return publisher

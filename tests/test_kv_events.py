"""KV-cache events (issue 27 item 2): vLLM's KVEventBatch over ZMQ, with block hashes a router
(llm-d's indexer) computes from a prompt's tokens, replaying to the prefix cache's contents."""

import hashlib
import json
import pathlib
import socket
import time

import msgpack
import pytest
import zmq

from jaxserve.batching import kv_events
from jaxserve.batching.kv_pages import page_hash
from jaxserve.batching.runner import Runner
from jaxserve.config import SamplingParams
from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.serving import kv_publisher
from support.mock_engine import MockEngine, MockTokenizer

DATA = pathlib.Path(__file__).parent / "data" / "vllm_block_stored.json"


def test_block_hashes_match_an_event_vllm_published():
  """The test vector llm-d checked its indexer against: 400 tokens, 16-token blocks, seed 42."""
  vector = json.loads(DATA.read_text())
  hashes = kv_events.prompt_hashes(vector["token_ids"], vector["block_size"], vector["hash_seed"])
  assert hashes == vector["block_hashes"] and len(hashes) == 25


def test_canonical_cbor_by_hand():
  assert kv_events.cbor([23, 24, 255, 256, 65536, 2**32, -1, None, "a", b"\0"]) == bytes.fromhex(
      "8a" "17" "1818" "18ff" "190100" "1a00010000" "1b0000000100000000" "20" "f6" "6161" "4100")


def test_the_config_reads_vllms_json_and_names_a_bad_key():
  cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                 '"endpoint": "tcp://*:5557", "topic": "kv@pod-0@smol"}')
  assert cfg.publishes and cfg.topic == "kv@pod-0@smol" and cfg.replay_endpoint is None
  assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').publishes
  for text, named in (('{"endpont": "x"}', "unknown key 'endpont'"),
                      ('{"hwm": "10"}', "hwm must be a number"),
                      ('{"publisher": "kafka"}', "publisher must be"), ("[1]", "JSON object"),
                      ('{"endpoint": "http://x"}', "endpoint must be")):
    with pytest.raises(ValueError, match=named):
      KVEventsConfig.from_json(text)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Router:
  """What a router's indexer keeps of one pod: block hash -> its tokens, from the events."""

  def __init__(self):
    self.blocks: dict[int, tuple[int, ...]] = {}
    self.parents: dict[int, int | None] = {}  # The parent each stored run named.

  def apply(self, payload: bytes) -> None:
    ts, events, rank = msgpack.unpackb(payload)
    assert rank == 0 and ts > 0
    for event in events:
      if event[0] == "BlockStored":
        _, hashes, parent, tokens, block_size, lora_id, medium = event
        assert lora_id is None and medium == "GPU" and len(tokens) == len(hashes) * block_size
        self.parents[hashes[0]] = parent
        for i, h in enumerate(hashes):
          self.blocks[h] = tuple(tokens[i * block_size:(i + 1) * block_size])
      elif event[0] == "BlockRemoved":
        for h in event[1]:
          del self.blocks[h]  # A block the router never heard of would be a bug.
      else:
        assert event == ["AllBlocksCleared"]
        self.blocks.clear()


def chains(sequences, page_size):
  """internal key -> (vLLM hash, parent vLLM hash or None) of every full page of `sequences`."""
  out = {}
  for seq in sequences:
    key, ext, parent = bytes(32), kv_events.root_hash(""), None
    for i in range(len(seq) // page_size):
      tokens = tuple(seq[i * page_size:(i + 1) * page_size])
      key, ext_next = page_hash(key, tokens), kv_events.block_hash(ext, tokens)
      out[key] = (kv_events.external(ext_next), parent)
      ext, parent = ext_next, kv_events.external(ext_next)
  return out


def expected_blocks(allocator, sequences) -> dict[int, tuple[int, ...]]:
  ext = chains(sequences, allocator.page_size)
  return {ext[key][0]: allocator._tokens[page] for key, page in allocator._cached.items()}


def replay(address: str, start: int = 0) -> list[tuple[int, bytes]]:
  """Every kept batch from `start` on, asked as vLLM's subscribers ask (a DEALER takes the many
  replies to one request, where a REQ socket would take one)."""
  req = zmq.Context.instance().socket(zmq.DEALER)
  req.connect(address)
  req.send_multipart([b"", start.to_bytes(8, "big")])
  out = []
  while True:
    assert req.poll(5000), "no replay answer"
    _, seq, payload = req.recv_multipart()
    if int.from_bytes(seq, "big", signed=True) == -1:
      req.close(linger=0)
      return out
    out.append((int.from_bytes(seq, "big"), payload))


def test_events_replay_to_the_prefix_cache_through_evictions_and_preemptions():
  port, replay_port = _free_port(), _free_port()
  config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                          replay_endpoint=f"tcp://*:{replay_port}", topic="kv@pod-0@mock")
  # 4 slots, 19 usable 4-token pages: requests of up to 11 pages preempt each other and evict.
  runner = Runner(MockEngine(num_slots=4, page_size=4, num_pages=20, max_model_len=64,
                             max_prefill_len=16), MockTokenizer())
  publisher = kv_publisher.start(config, runner.scheduler)
  sub = zmq.Context.instance().socket(zmq.SUB)
  sub.connect(f"tcp://127.0.0.1:{port}")
  sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
  try:
    base = list(range(100, 124))
    prompts = [base[:n] + [500 + i] * (i % 3) for i, n in enumerate((9, 24, 13, 20, 24, 16, 11, 22,
                                                                     24, 17, 8, 23))]
    requests = [(p, SamplingParams(max_tokens=8 + 3 * (i % 5), ignore_eos=True))
                for i, p in enumerate(prompts)]
    done = runner.generate(requests)
    sched, pages = runner.scheduler, runner.scheduler.pages
    assert sched.num_preemptions > 0 and pages.num_evictions > 0 and pages.num_hit_tokens > 0
    want = expected_blocks(pages, [c.prompt_token_ids + c.token_ids for c in done])
    assert len(want) == pages.num_cached_pages > 0
    # A subscriber as vLLM's example: batches in sequence, a gap filled from the replay socket
    # (the first batches go before ZMQ's connection is up).
    live, router, next_seq = [], Router(), 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (not live or router.blocks != want):
      if sub.poll(100):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@pod-0@mock"
        seq = int.from_bytes(seq, "big")
        missed = replay(f"tcp://127.0.0.1:{replay_port}", next_seq) if seq > next_seq else []
        for _, old in [b for b in missed if b[0] < seq] + [(seq, payload)]:
          router.apply(old)
        live.append((seq, payload))
        next_seq = seq + 1
    assert router.blocks == want
    # Replay from the start gives every batch, the ones received live among them, in order.
    batches = replay(f"tcp://127.0.0.1:{replay_port}")
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    assert set(live) <= set(batches) and len(batches) > 10
    replayed = Router()
    assert msgpack.unpackb(batches[0][1])[1] == [["AllBlocksCleared"]]
    for _, payload in batches:
      replayed.apply(payload)
    assert replayed.blocks == want
    # Each stored run names its first block's parent as the router would compute it.
    ext = {h: parent for h, parent in chains([c.prompt_token_ids + c.token_ids for c in done],
                                             4).values()}
    assert all(ext[h] == parent for h, parent in replayed.parents.items())
  finally:
    sub.close(linger=0)
    publisher.close()


def test_the_server_publishes_what_a_request_caches():
  """`jaxserve serve --kv-events-config ...` as parsed, on a server over the mock engine."""
  import grpc

  from jaxserve.api.proto import jaxserve_pb2 as pb
  from jaxserve.cli import main
  from support import mock_serving
  from support import server_harness as h

  port, replay_port = _free_port(), _free_port()
  args = main.build_parser().parse_args(["serve", "--kv-events-config", json.dumps(
      {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": "kv@p@mock",
       "replay_endpoint": f"tcp://*:{replay_port}"})])
  srv = mock_serving.serve(kv_events=main._server_config(args).kv_events)
  try:
    prompt = list(range(1, 11))  # Two full 4-token pages are cached after the prefill.
    h.generate(h.stub(grpc.insecure_channel(srv.grpc_address)), pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), max_tokens=1, ignore_eos=True), key=None)
    want = dict(zip(kv_events.prompt_hashes(prompt, 4), [(1, 2, 3, 4), (5, 6, 7, 8)]))
    router, deadline = Router(), time.monotonic() + 10
    while router.blocks != want and time.monotonic() < deadline:
      router = Router()
      for _, payload in replay(f"tcp://127.0.0.1:{replay_port}"):
        router.apply(payload)
    assert router.blocks == want
  finally:
    srv.close()


def test_a_salt_goes_into_the_first_blocks_key_and_hash():
  """vLLM puts cache_salt in the first block's extra keys; our keys take it the same way."""
  from jaxserve.batching.kv_pages import PageAllocator

  ops = []
  pages = PageAllocator(16, page_size=4)
  pages.events = kv_events.KVEventLog(ops.extend)
  tokens = list(range(1, 10))
  for salt in ("s", None):
    table, _ = pages.allocate(tokens, reuse=False)
    pages.cache_pages(table, tokens, 0, 2, cache_salt=salt)
  pages.events.flush()
  salted, plain = kv_events.EventMirror(4).events(ops)
  assert salted[1] == kv_events.prompt_hashes(tokens, 4, cache_salt="s")
  assert plain[1] == kv_events.prompt_hashes(tokens, 4) != salted[1]
  assert salted[2] is None and salted[3] == plain[3] == tokens[:8]
  assert len(pages.match_prefix(tokens, "s")) == len(pages.match_prefix(tokens)) == 2
  # Each run found only its own pages: a salt is a cache of its own.
  assert pages.match_prefix(tokens, "t") == []
  pages_of = lambda salt: {hit.page for hit in pages.match_prefix(tokens, salt)}
  assert not pages_of("s") & pages_of(None)


def test_an_images_hash_goes_into_the_extra_keys_of_its_blocks():
  """vLLM puts each multimodal item's identifier in the extra keys of every block holding its
  tokens (before cache_salt): same tokens, another image, other hashes from the image's first
  block on; the blocks before it the text's own. Also when a page comes back from the host tier."""
  from jaxserve.batching import images as mm
  from jaxserve.batching.kv_pages import PageAllocator

  tokens = list(range(1, 14))  # Pages [1-4] [5-8] [9-12]; an image on positions 5-9.
  extras = lambda h: mm.page_extras([mm.ImageSpan(h, None, 5, 5)], 4)
  ops = []
  pages = PageAllocator(10, page_size=4, host_slots=8)
  pages.events = kv_events.KVEventLog(ops.extend)
  tables = []
  for h in ("a" * 64, "b" * 64):
    tables.append(pages.allocate(tokens, reuse=False)[0])
    pages.cache_pages(tables[-1], tokens, 0, 3, cache_salt="s", extras=extras(h))
  root, cbor = kv_events.root_hash(""), kv_events.cbor
  by_hand = [hashlib.sha256(cbor([root, tokens[:4], ["s"]])).digest()]
  for i in (1, 2):
    by_hand.append(hashlib.sha256(cbor([by_hand[-1], tokens[4 * i:4 * i + 4], ["a" * 64]]))
                   .digest())
  mirror = kv_events.EventMirror(4)
  pages.events.flush()
  first, second = mirror.events(ops)
  assert first[1] == [kv_events.external(h) for h in by_hand]
  assert first[1] == kv_events.prompt_hashes(tokens, 4, cache_salt="s", images=extras("a" * 64))
  # The other image's request: its first page is the text's (not stored again, the parent).
  assert second[2] == first[1][0] and len(second[1]) == 2 and not set(second[1]) & set(first[1])
  assert kv_events.prompt_hashes(tokens, 4, cache_salt="s")[1] not in first[1]
  # Saved to the host tier as their pages are evicted, then loaded back: the same hashes.
  for table in tables:
    pages.free(table)
  ops.clear()
  pages.free(pages.allocate(list(range(100, 136)), reuse=False)[0])  # Evicts every page.
  hits = pages.match_prefix(tokens, "s", extras=extras("a" * 64))
  assert [(hit.on_host, hit.images) for hit in hits] == [
      (True, ()), (True, ("a" * 64,)), (True, ("a" * 64,))]
  pages.allocate(tokens, hits=hits, cache_salt="s")
  pages.events.flush()
  loaded = [e for e in mirror.events(ops) if e[0] == "BlockStored" and e[-1] == "GPU"]
  assert [h for e in loaded for h in e[1]][-3:] == first[1]

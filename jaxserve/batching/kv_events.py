"""KV-cache events: the prefix cache's changes, as vLLM publishes them for prefix-aware routers.

A router (llm-d's kv-cache manager, behind the GKE Inference Gateway) keeps an index of which
pod holds which blocks. It learns it from each engine's events, in vLLM's msgpack `KVEventBatch`
schema (`vllm/distributed/kv_events.py`): every struct is an array, every event a tagged union

  batch         [ts, [event, ...], data_parallel_rank]
  BlockStored   ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                 lora_id, medium]
  BlockRemoved  ["BlockRemoved", block_hashes, medium]
  AllBlocksCleared ["AllBlocksCleared"]

Block hashes are vLLM's `sha256_cbor` chain, the one llm-d's indexer reproduced from a prompt's
tokens (`pkg/kvcache/kvblock/token_processor.go` from v0.3, commit 994abf2): each block's hash
is SHA-256 of the canonical CBOR of [parent hash (32 bytes), token ids, extra keys], the first
block's parent is SHA-256 of the CBOR of the hash seed (vLLM's PYTHONHASHSEED, llm-d's
`hashSeed`), and extra keys are None but for a block of image tokens (the content hash of each
image it holds, as vLLM puts each multimodal item's identifier there) and a salted request's
first block (its cache_salt, after them): a router that hashes a prompt's tokens alone never
takes an image prompt's blocks for its text's.
The events carry each hash's last 8 bytes as an unsigned big-endian integer, which every llm-d
version reads (its `getHashAsUint64` takes bytes or integers the same way).

The engine thread only records what the allocator did (`KVEventLog`: a few tuples a page); the
hashing, the merging into events and the encoding happen on the publisher's thread
(`EventMirror`), which mirrors each page's hash. Only the full pool's pages (every layer's KV,
or the global layers' with window pages) are published: a window pool page is reused only
beside its full page, so the full pool says what a router needs. The router's block size must be
the engine's page size. With a host tier (host_pages.py) a page saved to host memory is a
BlockStored of medium "CPU" (its parent is not sent: the host tier keeps no chains), and one
evicted from there a BlockRemoved of medium "CPU", as vLLM's offloading connector reports them;
a page a decode server takes from its prefill peer (kv_handoff.py) is a BlockStored of medium
"CPU" too, hashed from the prompt it came with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence

MEDIUM = "GPU"  # vLLM's name for the accelerator's memory (llm-d's device tier "gpu").
HOST_MEDIUM = "CPU"  # ...and for host memory, where its CPU offloading keeps blocks.
_STORED, _DROPPED, _SAVED, _HOST_DROPPED, _ADOPTED = 0, 1, 2, 3, 4


def cbor(value) -> bytes:
  """Canonical CBOR (RFC 8949 4.2.1) of ints, strings, bytes, None and lists: what vLLM's
  `cbor2.dumps(..., canonical=True)` and Go's `cbor.CanonicalEncOptions` both write."""
  if value is None:
    return b"\xf6"
  if isinstance(value, int):
    return _head(0, value) if value >= 0 else _head(1, -1 - value)
  if isinstance(value, bytes):
    return _head(2, len(value)) + value
  if isinstance(value, str):
    data = value.encode()
    return _head(3, len(data)) + data
  if isinstance(value, (list, tuple)):
    if all(type(v) is int and v >= 0 for v in value):  # Token ids: the common case, fast.
      return _head(4, len(value)) + b"".join([_head(0, v) for v in value])
    return _head(4, len(value)) + b"".join([cbor(v) for v in value])
  raise TypeError(f"cbor: cannot encode {type(value).__name__}")


def _head(major: int, n: int) -> bytes:
  """A CBOR item's first bytes: its major type and length (or value) in the fewest bytes."""
  m = major << 5
  if n < 24:
    return bytes((m | n,))
  if n < 0x100:
    return bytes((m | 24, n))
  if n < 0x10000:
    return bytes((m | 25,)) + n.to_bytes(2, "big")
  if n < 0x100000000:
    return bytes((m | 26,)) + n.to_bytes(4, "big")
  if n < 1 << 64:
    return bytes((m | 27,)) + n.to_bytes(8, "big")
  raise ValueError(f"cbor: {n} does not fit in 64 bits")


def root_hash(seed: str) -> bytes:
  """The first block's parent: vLLM's NONE_HASH under sha256_cbor, llm-d's init hash."""
  return hashlib.sha256(cbor(seed)).digest()


def block_hash(parent: bytes, token_ids: Sequence[int], cache_salt: str | None = None,
               images: Sequence[str] = ()) -> bytes:
  """One block's 32-byte hash; `cache_salt` only on a sequence's first block, `images` the
  hashes of the images whose tokens it holds."""
  extra = [*images, *([cache_salt] if cache_salt else [])] or None
  return hashlib.sha256(cbor([parent, list(token_ids), extra])).digest()


def external(h: bytes) -> int:
  """A hash as the events carry it: its last 8 bytes, big-endian (llm-d's ChunkHash)."""
  return int.from_bytes(h[24:], "big")


def chain(root: bytes, token_ids: Sequence[int], page_size: int, cache_salt: str | None = None,
          images: Sequence[Sequence[str]] = ()) -> list[bytes]:
  """The 32-byte hashes of every full block of `token_ids`, the first one's parent `root`;
  `images`: each block's image hashes (images.page_extras)."""
  parent, out = root, []
  for i in range(len(token_ids) // page_size):
    parent = block_hash(parent, token_ids[i * page_size:(i + 1) * page_size],
                        cache_salt if i == 0 else None, images[i] if i < len(images) else ())
    out.append(parent)
  return out


def prompt_hashes(token_ids: Sequence[int], page_size: int, seed: str = "",
                  cache_salt: str | None = None, images: Sequence[Sequence[str]] = ()
                  ) -> list[int]:
  """The hashes of every full block of `token_ids`, as a router computes them for a prompt."""
  return [external(h) for h in chain(root_hash(seed), token_ids, page_size, cache_salt, images)]


class KVEventLog:
  """What the allocator did in one step, recorded on the engine thread and handed to `sink`
  whole at `flush()`: cheap tuples, no hashing."""

  def __init__(self, sink: Callable[[list[tuple]], None]):
    self._sink = sink
    self._ops: list[tuple] = []

  def stored(self, page: int, parent_page: int | None, tokens: tuple[int, ...],
             cache_salt: str | None, findable: bool, images: tuple[str, ...] = ()) -> None:
    """`page` got its key, after `parent_page` (None: the sequence's first page); `images`: the
    hashes of the images whose tokens it holds. Only a findable page is in the cache; a
    duplicate keeps its hash for its children's sake."""
    self._ops.append((_STORED, page, parent_page, tokens, cache_salt, findable, images))

  def dropped(self, page: int, evicted: bool) -> None:
    """`page` lost its key: evicted from the cache, or freed while not findable."""
    self._ops.append((_DROPPED, page, evicted))

  def saved(self, page: int, slot: int) -> None:
    """Device `page`'s KV was saved to host `slot` (before the page is evicted)."""
    self._ops.append((_SAVED, page, slot))

  def adopted(self, token_ids: Sequence[int], slots: Sequence[tuple[int, int]],
              cache_salt: str | None) -> None:
    """Host slots took pages of `token_ids`'s prefix from elsewhere (P/D: kv_handoff.py), as
    (page index in the prompt, slot) pairs."""
    self._ops.append((_ADOPTED, tuple(token_ids), tuple(slots), cache_salt))

  def host_dropped(self, slot: int) -> None:
    """Host `slot` lost its page: evicted from the host tier."""
    self._ops.append((_HOST_DROPPED, slot))

  def flush(self) -> None:
    if self._ops:
      ops, self._ops = self._ops, []
      self._sink(ops)


@dataclasses.dataclass
class EventMirror:
  """Turns a step's ops into vLLM events, keeping each keyed page's hash (publisher thread)."""

  page_size: int
  seed: str = ""

  def __post_init__(self):
    self._root = root_hash(self.seed)
    self._hash: dict[int, bytes] = {}  # page -> its block hash, while it has a key.
    self._host: dict[int, bytes] = {}  # host slot -> its block hash.

  def events(self, ops: Sequence[tuple]) -> list[list]:
    out: list[list] = []
    last_stored = None  # The page that ends out[-1] when that is a BlockStored.
    for op in ops:
      if op[0] == _STORED:
        _, page, parent, tokens, salt, findable, images = op
        parent_hash = self._root if parent is None else self._hash[parent]
        self._hash[page] = h = block_hash(parent_hash, tokens, salt, images)
        if not findable:
          continue
        if last_stored is not None and last_stored == parent:  # The chain goes on.
          out[-1][1].append(external(h))
          out[-1][3].extend(tokens)
        else:
          parent_ext = None if parent is None else external(parent_hash)
          out.append(["BlockStored", [external(h)], parent_ext, list(tokens), self.page_size,
                      None, MEDIUM])
        last_stored = page
      elif op[0] in (_SAVED, _ADOPTED):
        for slot, h in self._host_slots(op):
          self._host[slot] = h
          out.append(["BlockStored", [external(h)], None, [], self.page_size, None,
                      HOST_MEDIUM])
        last_stored = None
      else:
        evicted, h, medium = True, self._host.pop(op[1], None), HOST_MEDIUM
        if op[0] == _DROPPED:
          evicted, h, medium = op[2], self._hash.pop(op[1], None), MEDIUM
        if evicted and h is not None:
          if out and out[-1][0] == "BlockRemoved" and out[-1][2] == medium:
            out[-1][1].append(external(h))
          else:
            out.append(["BlockRemoved", [external(h)], medium])
          last_stored = None
    return out

  def _host_slots(self, op: tuple) -> list[tuple[int, bytes]]:
    """The (host slot, block hash) pairs a save or an import (P/D) filled."""
    if op[0] == _SAVED:
      return [(op[2], self._hash[op[1]])]
    _, tokens, adopted, salt = op
    last = max(i for i, _ in adopted)
    hashes = chain(self._root, tokens[:(last + 1) * self.page_size], self.page_size, salt)
    return [(slot, hashes[i]) for i, slot in adopted]


def batch(events: list[list], ts: float | None = None) -> list:
  """A KVEventBatch as an array, data-parallel rank 0 (one scheduler holds every slot)."""
  return [time.time() if ts is None else ts, events, 0]


ALL_BLOCKS_CLEARED = ["AllBlocksCleared"]

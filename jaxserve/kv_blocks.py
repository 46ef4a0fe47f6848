"""The host side of the paged KV cache: which pages are free, who holds which, which are cached.

Pages (blocks) 1..num_blocks-1 are handed out; page 0 is the engine's scratch page (padding rows of
block tables point at it). A block is in exactly one of three states:

  held       ref count > 0, in some request's block table
  cached     ref count 0 but its KV is still valid and findable by hash (evictable, LRU order)
  free       ref count 0, no valid contents

Automatic prefix caching: a full block is keyed by a chained hash of its token ids and its parent
block's key, so one key names the whole prefix up to that block. A new request walks its prompt block
by block and reuses every block whose key is cached; only the rest is prefilled. When no free block is
left, the least recently freed cached block is evicted.
"""

from __future__ import annotations

import collections
from typing import Sequence

_ROOT_HASH = 0  # The parent key of a sequence's first block.


def block_hash(parent: int, token_ids: tuple[int, ...]) -> int:
  return hash((parent, token_ids))


class BlockAllocator:

  def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
    if num_blocks < 2:
      raise ValueError(f"num_blocks must be >= 2 (page 0 is the scratch page), got {num_blocks}")
    self.block_size = block_size
    self.num_blocks = num_blocks
    self.enable_prefix_caching = enable_prefix_caching
    self._free = collections.deque(range(1, num_blocks))
    self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first.
    self._ref = [0] * num_blocks
    self._hash: list[int | None] = [None] * num_blocks
    self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # Guards against collisions.
    self._cached: dict[int, int] = {}  # hash -> block
    self.num_query_tokens = 0  # Tokens looked up in the prefix cache at allocation.
    self.num_hit_tokens = 0  # ...of which were found there.
    self.num_evictions = 0

  @property
  def num_usable_blocks(self) -> int:
    return self.num_blocks - 1

  @property
  def num_free_blocks(self) -> int:
    """Blocks an allocation may take: free ones and evictable cached ones."""
    return len(self._free) + len(self._evictable)

  @property
  def num_cached_blocks(self) -> int:
    return len(self._cached)

  def num_blocks_for(self, num_tokens: int) -> int:
    return -(-num_tokens // self.block_size)

  def ref_count(self, block: int) -> int:
    return self._ref[block]

  def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
    """The cached blocks that hold a prefix of `token_ids`.

    The block holding the last token never matches: its prefill samples the next token, and
    rewriting a page other requests share is best avoided.
    """
    if not self.enable_prefix_caching:
      return []
    hits, parent, bs = [], _ROOT_HASH, self.block_size
    for i in range((len(token_ids) - 1) // bs):
      tokens = tuple(token_ids[i * bs:(i + 1) * bs])
      parent = block_hash(parent, tokens)
      block = self._cached.get(parent)
      if block is None or self._tokens[block] != tokens:
        break
      hits.append(block)
    return hits

  def can_allocate(self, token_ids: Sequence[int], num_reserve: int = 0) -> bool:
    """Whether `allocate(token_ids)` would leave at least `num_reserve` blocks free."""
    hits = self.match_prefix(token_ids)
    num_revived = sum(self._ref[b] == 0 for b in hits)  # Cached hits leave the evictable pool.
    num_new = self.num_blocks_for(len(token_ids)) - len(hits)
    return self.num_free_blocks - num_revived >= num_new + num_reserve

  def allocate(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
    """A block table covering every position of `token_ids`, reusing the cached prefix.

    Returns the table and how many leading tokens already have their KV in it. Check
    `can_allocate` first.
    """
    hits = self.match_prefix(token_ids)
    for block in hits:
      if self._ref[block] == 0:
        del self._evictable[block]
      self._ref[block] += 1
    num_new = self.num_blocks_for(len(token_ids)) - len(hits)
    table = hits + [self._take_fresh() for _ in range(num_new)]
    num_cached = len(hits) * self.block_size
    self.num_query_tokens += len(token_ids)
    self.num_hit_tokens += num_cached
    return table, num_cached

  def append_block(self, table: list[int]) -> bool:
    """Grows `table` by one fresh block; False (and no change) when none is left."""
    if not self.num_free_blocks:
      return False
    table.append(self._take_fresh())
    return True

  def cache_blocks(self, table: Sequence[int], token_ids: Sequence[int], start: int, end: int):
    """Registers blocks [start, end) of `table`, now full of the KV of `token_ids`, by hash.

    Blocks [0, start) must be registered already (their keys chain into these). If another block
    already holds the same prefix, this one keeps its key for chaining but is not findable.
    """
    if not self.enable_prefix_caching:
      return
    bs = self.block_size
    parent = self._hash[table[start - 1]] if start else _ROOT_HASH
    for i in range(start, end):
      tokens = tuple(token_ids[i * bs:(i + 1) * bs])
      parent = block_hash(parent, tokens)
      block = table[i]
      self._hash[block], self._tokens[block] = parent, tokens
      self._cached.setdefault(parent, block)

  def free(self, table: Sequence[int]) -> None:
    """Drops one reference to each block of `table`.

    Tail blocks go first, so within one sequence the blocks furthest from the prompt's start are
    the first evicted: a shorter shared prefix stays useful longer.
    """
    for block in reversed(table):
      self._ref[block] -= 1
      if self._ref[block]:
        continue
      if self._is_findable(block):
        self._evictable[block] = None
      else:
        self._hash[block] = self._tokens[block] = None
        self._free.append(block)

  def _is_findable(self, block: int) -> bool:
    h = self._hash[block]
    return h is not None and self._cached.get(h) == block

  def _take_fresh(self) -> int:
    if self._free:
      block = self._free.popleft()
    else:
      block, _ = self._evictable.popitem(last=False)
      del self._cached[self._hash[block]]
      self._hash[block] = self._tokens[block] = None
      self.num_evictions += 1
    self._ref[block] = 1
    return block

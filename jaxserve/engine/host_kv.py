"""The prefix cache's host tier on the engine side: a host pool of pages, and the programs that
copy pages between it and the device cache (batching/host_pages.py keeps the index).

Each page group of the cache (`cache.groups`: the KV pool, and with window pages the window
pool) has its own host pool, one numpy array per cache array, [N, L, ...] (N host slots; a
slot's page is one contiguous block). A plan's copies run before its step (StepPlan.kv_saves,
kv_loads: a list per page group):

  save   one program gathers a batch of device pages into pinned host memory (its output's
         memory kind: the device-to-host copy is the compiler's, dispatched like a step, so it
         waits on nothing); the bytes land in the pool at a later call (`land`), by when the
         gather has run: it only waited for the step before it
  load   the slots' bytes, taken from the pool and put in pinned host memory, are scattered
         into the donated cache by one program: the cache is updated in place

Batches are padded to `copy_buckets` pages (powers of 4, up to a sequence's pages), so every
program is compiled at warm-up; padding reads and writes the scratch page. `copy_programs`
defines the programs once: HostKV jits them, and `abstract_copies` lists them on abstract
arguments, as `plan --compile` compiles them for a chip (compiling/compile_plan.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.engine.fingerprint import weights_fingerprint
from jaxserve.model.kv_cache import SCRATCH_PAGE, KVPool

HOST_MEMORY = "pinned_host"


def copy_buckets(max_pages: int) -> tuple[int, ...]:
  """Pages one copy program moves: 1, 4, 16, ... up to `max_pages` (a sequence's pages)."""
  sizes, b = [], 1
  while b < max_pages:
    sizes.append(b)
    b *= 4
  return tuple(sizes) + (max_pages,)


def page_bytes(cache) -> int:
  """Bytes of one page in every group: what a host slot of each pool holds together."""
  return sum(map(pool_page_bytes, cache.groups))


def pool_page_bytes(group: KVPool) -> int:
  """Bytes of one page of one group's pool (every layer's)."""
  return sum(math.prod(x.shape) // x.shape[1] * x.dtype.itemsize for x in jax.tree.leaves(group))


def num_host_slots(cache, gib: float) -> int:
  """Pages of every group that `gib` GiB of host memory hold (the plan reports it too)."""
  return int(gib * 2**30 // page_bytes(cache))


def gather_pages(group: KVPool, ids):
  """[n, L, ...] of each cache array: pages `ids` of every layer."""
  return jax.tree.map(lambda x: jnp.moveaxis(x[:, ids], 1, 0), group)


def scatter_pages(group: KVPool, ids, pages, placed=None):
  """`group` with pages `ids` of every layer set to `pages` ([n, L, ...] each, from host
  memory: `placed` gives each array's device sharding to move it to first)."""
  placed = placed or jax.tree.map(lambda _: None, group)

  def put(x, p, sharding):
    if sharding is not None:
      p = jax.device_put(p, sharding)
    return x.at[:, ids].set(jnp.moveaxis(p, 0, 1).astype(x.dtype))
  return jax.tree.map(put, group, pages, placed)


def host_shape(x, n: int) -> tuple[int, ...]:
  """[n, L, ...]: `n` pages of cache array `x` ([L, P, ...]), as host memory holds them."""
  return (n, x.shape[0], *x.shape[2:])


def host_sharding(sharding, ndim: int):
  """An array's sharding with its first two axes swapped, in pinned host memory."""
  if isinstance(sharding, NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(spec[1], spec[0], *spec[2:]),
                         memory_kind=HOST_MEMORY)
  return sharding.with_memory_kind(HOST_MEMORY)


class CopyShape(NamedTuple):
  """What sets a copy program: a save or a load, of `pages` pages of page group `group`."""
  load: bool
  group: int
  pages: int

  @property
  def name(self) -> str:
    return f"kv {'load' if self.load else 'save'} pages={self.pages} group={self.group}"


@dataclasses.dataclass(frozen=True)
class CopyProgram:
  """One group's save or load: `fn` as jitted with `donate` and `out_shardings`. HostKV jits it
  and `plan --compile` lowers it on abstract arguments (`abstract_copies`): one definition."""
  fn: Callable
  donate: tuple[int, ...]
  out_shardings: Any
  host: Any  # The host pages' shardings (pinned host memory), [n, L, ...] each.

  def jit(self):
    return jax.jit(self.fn, donate_argnums=self.donate, out_shardings=self.out_shardings)


def copy_programs(group: KVPool, shardings: KVPool) -> tuple[CopyProgram, CopyProgram]:
  """(save, load): the programs of one page group whose arrays have `shardings`. The save's
  output is in pinned host memory; the load updates the donated group in place."""
  host = jax.tree.map(lambda x, s: host_sharding(s, x.ndim), group, shardings)
  save = CopyProgram(gather_pages, (), host, host)
  load = CopyProgram(functools.partial(scatter_pages, placed=shardings), (0,), shardings, host)
  return save, load


def abstract_copies(cache, shardings, max_pages: int) -> list[tuple[CopyShape, CopyProgram,
                                                                    tuple, tuple]]:
  """[(shape, program, abstract arguments, their shardings)] of every copy program
  `HostKV.warmup` compiles, in its order, for `cache` (ShapeDtypeStructs) with `shardings`: a
  save takes the group and page ids [n] (on every device), a load the host pages too."""
  out = []
  for g, (group, placed) in enumerate(zip(cache.groups, shardings.groups)):
    save, load = copy_programs(group, placed)
    on_all = _replicated(jax.tree.leaves(placed)[0])
    for n in copy_buckets(max_pages):
      ids = jax.ShapeDtypeStruct((n,), jnp.int32)
      pages = jax.tree.map(lambda x: jax.ShapeDtypeStruct(host_shape(x, n), x.dtype), group)
      out += [(CopyShape(False, g, n), save, (group, ids), (placed, on_all)),
              (CopyShape(True, g, n), load, (group, ids, pages), (placed, on_all, load.host))]
  return out


def _replicated(sharding):
  """Where page ids go: on every device of `sharding`'s mesh (or on its one device)."""
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, PartitionSpec())
  return sharding


class HostKV:

  def __init__(self, cache, num_slots: int, max_pages: int, current: Callable[[], Any],
               weights: Callable[[], Any] = dict):
    """A host pool of `num_slots` pages for each page group of `cache` (committed arrays);
    `current()` gives the engine's cache as it is now (P/D's export reads it), `weights()` its
    parameters (P/D's fingerprint)."""
    if cache.draft:  # Config refuses it too: the draft's KV would not move with the pages.
      raise ValueError("the host tier runs on one model's page groups, not a draft model's too")
    self.num_slots = num_slots
    self._current, self._weights = current, weights
    self._fingerprint: str | None = None
    self.buckets = copy_buckets(max_pages)
    self._groups = []
    for group in cache.groups:
      shardings = jax.tree.map(lambda x: x.sharding, group)
      # Zero pages cost no memory until written.
      pool = jax.tree.map(lambda x: np.zeros(host_shape(x, num_slots), x.dtype), group)
      save, load = copy_programs(group, shardings)
      self._groups.append((pool, save.jit(), load.jit(), load.host))
    self._pending: collections.deque = collections.deque()  # (group, slots, pinned arrays)
    self.num_saved = self.num_loaded = 0

  @classmethod
  def of(cls, cache, config, current: Callable[[], Any],
         weights: Callable[[], Any] = dict) -> HostKV | None:
    """The host tier config.kv_offload_gib (EngineConfig) buys for `cache`; None for 0."""
    gib, max_pages = config.kv_offload_gib, config.max_pages_per_seq
    if not gib:
      return None
    if jax.process_count() > 1:
      raise ValueError("kv_offload_gib runs on one host, not across processes yet")
    num_slots = num_host_slots(cache, gib)
    if num_slots < 1:
      raise ValueError(f"kv_offload_gib {gib} holds no KV page (one is "
                       f"{page_bytes(cache) / 2**20:.2f} MiB)")
    return cls(cache, num_slots, max_pages, current, weights)

  def copy(self, cache, saves: Sequence[Sequence[tuple[int, int]]],
           loads: Sequence[Sequence[tuple[int, int]]]):
    """Runs a plan's saves, then its loads, each a list per page group of (device page, host
    slot) and (host slot, device page); returns the cache (donated to the loads)."""
    self.land()  # Earlier plans' saves: they ran before the last step, so they are done.
    groups = list(cache.groups)
    for g, copies in enumerate(saves):
      self._save(g, groups[g], copies)
    loading = {(g, slot) for g, copies in enumerate(loads) for slot, _ in copies}
    if any((g, s) in loading for g, slots, _ in self._pending for s in slots):
      self.land()  # This plan saved a page it also loads: rare, and it waits for the copy.
    for g, copies in enumerate(loads):
      groups[g] = self._load(g, groups[g], copies)
    return cache.with_groups(tuple(groups))

  def _save(self, g: int, group: KVPool, copies: Sequence[tuple[int, int]]) -> None:
    """Dispatches the gathers of group `g`'s (device page, host slot) `copies` (`land`s them)."""
    for ids, at, n in self._batches([page for page, _ in copies]):
      slots = [slot for _, slot in copies[at:at + n]]
      self._pending.append((g, slots, self._groups[g][1](group, ids)))
    self.num_saved += len(copies)

  def _load(self, g: int, group: KVPool, copies: Sequence[tuple[int, int]]) -> KVPool:
    """`group` with the device pages of its (host slot, device page) `copies` loaded."""
    pool, _, load, host = self._groups[g]
    for ids, at, n in self._batches([page for _, page in copies]):
      rows = np.zeros(len(ids), np.int64)
      rows[:n] = [slot for slot, _ in copies[at:at + n]]
      data = jax.tree.map(lambda p, sh: jax.device_put(p[rows], sh), pool, host)
      group = load(group, ids, data)
    self.num_loaded += len(copies)
    return group

  def land(self) -> None:
    """Writes every dispatched save's bytes into the host pool (waiting for its copy)."""
    while self._pending:
      g, slots, out = self._pending.popleft()
      jax.tree.map(lambda p, x: p.__setitem__(slots, np.asarray(x)[:len(slots)]),
                   self._groups[g][0], out)

  # P/D's page bytes (batching/kv_handoff.py PageStore): one page of a group is its arrays'
  # bytes, each [L, ...], in the pool's leaf order.

  def forget_fingerprint(self) -> None:
    """The weights changed (Engine.update_weights): the next `fingerprint` is computed again."""
    self._fingerprint = None

  def fingerprint(self) -> str:
    """The weights' (engine/fingerprint.py), computed at the first call."""
    if self._fingerprint is None:
      self._fingerprint = weights_fingerprint(self._weights())
    return self._fingerprint

  def page_nbytes(self, group: int) -> int:
    return sum(p[0].nbytes for p in jax.tree.leaves(self._groups[group][0]))

  def layout(self) -> tuple[str, ...]:
    return tuple(" ".join(f"{x.dtype}{list(x.shape[1:])}" for x in jax.tree.leaves(pool))
                 for pool, *_ in self._groups)

  def export(self, group: int, pages: Sequence[int]) -> Callable[[], list[bytes]]:
    """Dispatches the save program's gather of device pages from the current cache (it waits
    for nothing: the steps after it may donate the cache); the callable, for any thread,
    waits for the copy and gives the pages' bytes."""
    save = self._groups[group][1]
    cache = self._current().groups[group]
    outs = [(save(cache, ids), n) for ids, _, n in self._batches(list(pages))]

    def pages_bytes() -> list[bytes]:
      out = []
      for gathered, n in outs:
        arrays = [np.asarray(x) for x in jax.tree.leaves(gathered)]
        out += [b"".join(a[i].tobytes() for a in arrays) for i in range(n)]
      return out
    return pages_bytes

  def read(self, group: int, slots: Sequence[int]) -> Callable[[], list[bytes]]:
    """Copies host slots out of the pool (one gather an array: the engine may overwrite the
    slots once it moves on); the callable, for any thread, gives their bytes."""
    self.land()
    rows = np.asarray(slots, np.int64)
    copies = [p[rows] for p in jax.tree.leaves(self._groups[group][0])]
    return lambda: [b"".join(c[i].tobytes() for c in copies) for i in range(len(rows))]

  def write(self, group: int, slots: Sequence[int], pages: Sequence[bytes]) -> None:
    """Sets slots' bytes; ValueError, writing none, for a page of the wrong size."""
    self.land()
    leaves = jax.tree.leaves(self._groups[group][0])
    sizes = [p[0].nbytes for p in leaves]
    for data in pages:  # All checked before any is written.
      if len(data) != sum(sizes):
        raise ValueError(f"a page of group {group} is {sum(sizes)} bytes, got {len(data)}")
    for slot, data in zip(slots, pages):
      at = 0
      for p, size in zip(leaves, sizes):
        p[slot] = np.frombuffer(data, p.dtype, size // p.dtype.itemsize, at).reshape(p.shape[1:])
        at += size

  def warmup(self, cache):
    """Compiles every copy program on padding (the scratch page); returns the cache."""
    groups = list(cache.groups)
    for g, (pool, save, load, host) in enumerate(self._groups):
      for n in self.buckets:
        ids = np.full(n, SCRATCH_PAGE, np.int32)
        jax.block_until_ready(save(groups[g], ids))
        data = jax.tree.map(lambda p, sh: jax.device_put(np.zeros((n, *p.shape[1:]), p.dtype),
                                                         sh), pool, host)
        groups[g] = load(groups[g], ids, data)
    return cache.with_groups(tuple(groups))

  def _batches(self, pages: Sequence[int]):
    """(ids padded to a bucket, its first page's index, how many are real) of each batch."""
    top = self.buckets[-1]
    for i in range(0, len(pages), top):
      part = pages[i:i + top]
      size = next(b for b in self.buckets if b >= len(part))
      ids = np.full(size, SCRATCH_PAGE, np.int32)
      ids[:len(part)] = part
      yield ids, i, len(part)


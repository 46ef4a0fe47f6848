"""The device side of jaxserve: parameters, the KV cache, the decode state, and compiled steps.

It implements `plan.Engine`: the runner calls `prefill` for each chunk of a plan and `decode` for
the decode slots, and gets tokens back as futures (async device-to-host copies). Both take an
optional allowed-token bitmask per row (constrained decoding, batching/constrained.py); without
one the step gets a reused all-ones mask, so unconstrained steps build none.
Every shape the engine compiles for comes from `EngineConfig` and is compiled by `warmup()`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils

from jaxserve.batching.plan import EngineInfo, PrefillChunk
from jaxserve.config import AttentionBackend, EngineConfig, ModelConfig, SamplingParams
from jaxserve.engine import placement
from jaxserve.engine.decode import DecodeState, decode_step
from jaxserve.engine.prefill import PromptLogprobs, prefill_step, prompt_logprobs_step
from jaxserve.engine.sample import Sampled, SamplingRow, SamplingState
from jaxserve.model import kv_cache
from jaxserve.model.attention import AttentionSpec
from jaxserve.model.kv_cache import SCRATCH_PAGE, KVCache
from jaxserve.model.llama import Transformer
from jaxserve.planning import capacity


def enable_compilation_cache(path: str | None) -> None:
  """JAX's persistent cache: a second start loads compiled buckets instead of compiling."""
  if path is None:
    return
  path = os.path.expanduser(path)
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def default_backend() -> AttentionBackend:
  """Plain jnp on CPU (Pallas there is interpret mode only); the kernels on TPU and GPU."""
  return AttentionBackend.REFERENCE if jax.default_backend() == "cpu" else AttentionBackend.PALLAS


class TokenFuture:
  """Sampled tokens on their way to the host: the copy starts now, `result()` waits for it."""

  def __init__(self, sampled: Sampled):
    self._sampled = sampled
    sampled.tokens.copy_to_host_async()

  def result(self) -> np.ndarray:
    return np.asarray(self._sampled.tokens)

  def logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chosen [B], top ids [B, 20], top logprobs [B, 20])."""
    s = self._sampled
    return np.asarray(s.logprobs), np.asarray(s.top_ids), np.asarray(s.top_logprobs)


class PromptLogprobsFuture(TokenFuture):
  """A prefill chunk's sampled token and its positions' prompt logprobs, copied together."""

  def __init__(self, sampled: Sampled, prompt: PromptLogprobs):
    super().__init__(sampled)
    self._prompt = prompt
    for x in jax.tree.leaves(prompt):
      x.copy_to_host_async()

  def prompt_logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(chosen [T], ranks [T], top ids [T, 20], top logprobs [T, 20]) of the padded chunk."""
    p = self._prompt
    return (np.asarray(p.logprobs), np.asarray(p.ranks), np.asarray(p.top_ids),
            np.asarray(p.top_logprobs))


class PrefillArgs(NamedTuple):
  """The host arrays of one prefill step (see `prefill_step`)."""

  tokens: np.ndarray  # [T] int32, padded to a prefill bucket
  start_pos: np.int32
  true_len: np.int32
  page_table: np.ndarray  # [W] int32
  slot: np.int32
  is_last: np.bool_
  row: SamplingState | None  # The slot's sampling settings (numpy leaves); set when is_last.
  # [T] int32, the prompt token after each position: set for a chunk that wants prompt logprobs.
  targets: np.ndarray | None = None
  bitmask: np.ndarray | None = None  # [1, ceil(V/32)] int32: the sampled token's allowed ids.


class DecodeArgs(NamedTuple):
  """The host arrays of one decode step (see `decode_step`)."""

  rows: np.ndarray  # [B] int32: the decoding slots, then num_slots as padding; B a batch bucket
  page_tables: np.ndarray  # [B, W] int32, W a compiled decode width
  bitmask: np.ndarray | None = None  # [B, ceil(V/32)] int32: each row's allowed tokens


class Engine:
  def __init__(self, model: Transformer, config: EngineConfig, stop_ids: Sequence[int] = ()):
    if config.num_pages is None:
      config = size_kv_pool(config, model)
    self.model_config: ModelConfig = model.cfg
    self.config = config
    self.num_slots = config.num_slots
    self.page_size = config.page_size
    self.num_pages = config.num_pages
    self.max_model_len = min(config.max_model_len, model.cfg.max_seq_len)
    self.max_prefill_len = config.prefill_buckets[-1]
    self.backend = config.attention_backend or default_backend()
    mesh = placement.mesh_for(config)
    attn = AttentionSpec(self.backend, mesh)
    enable_compilation_cache(config.compilation_cache_dir)

    graphdef, self.params = nnx.split(model)
    self.state = DecodeState.create(config.num_slots, model.cfg.vocab_size)
    self.stop_ids = jnp.asarray(sorted(stop_ids) or [0], jnp.int32)  # [E]
    self.shardings, step_out, state_out = None, {}, {}
    if mesh is not None:
      # One SPMD program over the mesh: the state goes to its shardings, and the steps return it
      # in the same shardings, so donation aliases the buffers and no step recompiles.
      s = self.shardings = placement.EngineShardings.create(
          mesh, model.cfg, config, self.params, self.state)
      self.params, self.state = s.place(self.params, s.params), s.place(self.state, s.state)
      self.stop_ids = s.place(self.stop_ids, s.replicated)
      self.cache = s.create_cache(model.cfg, config)
      step_out, state_out = {"out_shardings": s.step_out}, {"out_shardings": s.state}
    else:
      # Committed from the start, as every step's output is: warm-up then compiles the steps
      # for the arrays they will see (uncommitted first ones made the first request's
      # set_sampling and prefill compile again).
      device = jax.local_devices()[0]
      self.cache = jax.device_put(KVCache.create(model.cfg, config), device)
      self.state = jax.device_put(self.state, device)
    # The contiguous layout owns one region per slot: its pool is those regions' pages, and the
    # engine hands each slot its own identity table, whatever pages the scheduler picked.
    self.num_pages = self.cache.num_pages
    self.max_model_len = fit_to_pool(self.max_model_len, self.num_pages, self.page_size)
    self._slot_page_tables = kv_cache.slot_page_tables(config)
    self.can_share_pages = self._slot_page_tables is None  # A slot's own region holds no one else's KV.
    self.info = EngineInfo(self.num_slots, self.page_size, self.num_pages, self.max_model_len,
                           self.max_prefill_len, self.can_share_pages, model.cfg.vocab_size,
                           config.decode_width_buckets, config.prefill_buckets, config.dtype.value)
    # The cache and decode state are donated: each step updates them in place.
    self._prefill = jax.jit(functools.partial(prefill_step, graphdef, attn=attn),
                            donate_argnums=(1, 2), **step_out)
    lp_out = {"out_shardings": (*s.step_out, s.replicated)} if mesh is not None else {}
    self._prefill_logprobs = jax.jit(functools.partial(prompt_logprobs_step, graphdef, attn=attn),
                                     donate_argnums=(1, 2), **lp_out)
    self._decode = jax.jit(functools.partial(decode_step, graphdef, attn=attn, in_place=config.dp > 1),
                           donate_argnums=(1, 2), **step_out)
    self._set_sampling = jax.jit(_set_sampling, donate_argnums=(0,), **state_out)
    self._masks = _AllAllowed(model.cfg.vocab_size)
    logging.info("Engine: %d slots, %d pages of %d tokens (KV cache %.1f MiB), backend %s",
                 self.num_slots, self.num_pages, self.page_size, self.cache.num_bytes / 2**20,
                 self.backend.value)

  def prefill(self, chunk: PrefillChunk, bitmask: np.ndarray | None = None) -> TokenFuture | None:
    return self.run_prefill(self.prefill_args(chunk, bitmask))

  def decode(self, slots: Sequence[int], page_tables: np.ndarray,
             bitmask: np.ndarray | None = None) -> TokenFuture:
    return self.run_decode(self.decode_args(slots, page_tables, bitmask=bitmask))

  # The host inputs of each compiled step are built apart from the call, so that `multihost` can
  # broadcast them from process 0 and make every other process run the same call on them.

  def prefill_args(self, chunk: PrefillChunk, bitmask: np.ndarray | None = None) -> PrefillArgs:
    n = len(chunk.token_ids)
    if not 0 < n <= self.max_prefill_len:
      raise ValueError(f"prefill chunk of {n} tokens: must be 1..{self.max_prefill_len}")
    bucket = next(b for b in self.config.prefill_buckets if b >= n)
    tokens = np.zeros(bucket, np.int32)
    tokens[:n] = chunk.token_ids
    row = None
    if chunk.is_last:
      row = SamplingRow.from_params(chunk.sampling, chunk.seed, chunk.prompt_token_ids,
                                    chunk.output_token_ids, self.model_config.vocab_size).as_state()
    targets = None
    if chunk.prompt_logprob_targets is not None:
      targets = np.zeros(bucket, np.int32)
      targets[:len(chunk.prompt_logprob_targets)] = chunk.prompt_logprob_targets
    return PrefillArgs(tokens, np.int32(chunk.start_pos), np.int32(n),
                       self._page_table_row(chunk.page_table, chunk.slot), np.int32(chunk.slot),
                       np.bool_(chunk.is_last), row, targets, self._masks.rows(bitmask, 1))

  def run_prefill(self, args: PrefillArgs) -> TokenFuture | None:
    if args.row is not None:
      self.state = self._set_sampling(self.state, args.slot, args.row)
    inputs = (self.params, self.cache, self.state, args.tokens, args.start_pos, args.true_len,
              args.page_table, args.slot, args.is_last, args.bitmask,
              self.stop_ids)
    if args.targets is not None:
      self.cache, self.state, sampled, prompt = self._prefill_logprobs(*inputs, args.targets)
      return PromptLogprobsFuture(sampled, prompt)
    self.cache, self.state, sampled = self._prefill(*inputs)
    return TokenFuture(sampled) if args.is_last else None

  def decode_args(self, slots: Sequence[int], page_tables: np.ndarray,
                  batch: int | None = None, bitmask: np.ndarray | None = None) -> DecodeArgs:
    """page_tables [num_slots, W]: row s is slot s's table. `batch`: a bucket to pad to (by
    default the smallest that holds the slots). bitmask [len(slots), ceil(V/32)]: row i is
    slots[i]'s allowed tokens (None: every token, for every slot)."""
    given = list(slots)
    if self.config.dp > 1:  # Slots are split over devices by position: row i must be slot i.
      live = set(slots)
      slots = [s if s in live else self.num_slots for s in range(self.num_slots)]
    batch = batch or next(b for b in self.config.decode_batch_buckets if b >= len(slots))
    rows = np.full(batch, self.num_slots, np.int32)
    rows[:len(slots)] = slots
    if bitmask is not None and list(slots) != given:  # dp: the mask rows follow the slots.
      where = {s: i for i, s in enumerate(given)}
      bitmask = np.stack([bitmask[where[s]] if s in where else self._masks.rows(None, 1)[0]
                          for s in slots])
    return DecodeArgs(rows, self._decode_tables(rows, page_tables),
                      self._masks.rows(bitmask, batch))

  def run_decode(self, args: DecodeArgs) -> TokenFuture:
    self.cache, self.state, sampled = self._decode(
        self.params, self.cache, self.state, args.rows, args.page_tables,
        args.bitmask, self.stop_ids)
    return TokenFuture(sampled)

  def free(self, slot: int) -> None:
    """Nothing to do on the device: a slot decodes only when the plan lists it."""

  def warmup(self) -> None:
    """Compiles every prefill bucket (both variants) and decode width. Writes only to the
    scratch page."""
    row = SamplingRow.from_params(SamplingParams(), 0, (), (), self.model_config.vocab_size)
    self.state = self._set_sampling(self.state, np.int32(0), row.as_state())
    for bucket in self.config.prefill_buckets:
      inputs = (self.params, self.cache, self.state, np.zeros(bucket, np.int32), np.int32(0),
                np.int32(bucket), self._page_table_row([]), np.int32(0), np.bool_(False),
                self._masks.rows(None, 1), self.stop_ids)
      self.cache, self.state, _ = self._prefill(*inputs)
      inputs = (self.params, self.cache, self.state, *inputs[3:])
      self.cache, self.state, _, _ = self._prefill_logprobs(*inputs, np.zeros(bucket, np.int32))
    for batch in self.config.decode_batch_buckets:
      rows = np.full(batch, self.num_slots, np.int32)  # All padding: nothing is written.
      for width in self.config.decode_width_buckets:
        tables = np.full((batch, width), SCRATCH_PAGE, np.int32)
        self.cache, self.state, out = self._decode(
            self.params, self.cache, self.state, rows, tables,
            self._masks.rows(None, batch), self.stop_ids)
    out.tokens.block_until_ready()

  def _page_table_row(self, pages: Sequence[int], slot: int | None = None) -> np.ndarray:
    if self._slot_page_tables is not None and slot is not None:
      return self._slot_page_tables[slot].copy()
    row = np.full(self.config.max_pages_per_seq, SCRATCH_PAGE, np.int32)
    row[:len(pages)] = pages
    return row

  def _decode_tables(self, rows: np.ndarray, page_tables: np.ndarray) -> np.ndarray:
    """[B, W]: the tables of `rows`, padded to the narrowest compiled width that holds them.
    Padding rows (num_slots) get an all-scratch table."""
    width = next(w for w in self.config.decode_width_buckets if w >= page_tables.shape[1])
    tables = np.full((self.num_slots + 1, width), SCRATCH_PAGE, np.int32)
    if self._slot_page_tables is not None:
      tables[:-1] = self._slot_page_tables[:, :width]
    else:
      tables[:page_tables.shape[0], :page_tables.shape[1]] = page_tables
    return tables[rows]


def fit_to_pool(max_model_len: int, num_pages: int, page_size: int) -> int:
  """The context window the KV pool can hold for one sequence, with a warning when that is
  less than asked (as vLLM does). Clamped rather than refused: a small pool still serves
  shorter requests (the preemption tests and scripts run on one on purpose), and the window
  advertised (GetModelInfo, /v1/models, the default max_tokens) is then one a request can use."""
  pool_len = (num_pages - 1) * page_size  # Page 0 is the scratch page.
  if max_model_len <= pool_len:
    return max_model_len
  logging.warning("max_model_len %d is more than the KV pool holds for one sequence (%d pages "
                  "of %d tokens): serving max_model_len %d; give more pages (--num-pages, "
                  "--memory-fraction) for the full window", max_model_len, num_pages - 1,
                  page_size, pool_len)
  return pool_len


def device_memory_bytes(device: jax.Device) -> int:
  """An accelerator's memory; on CPU, where memory_stats() says nothing, the host's RAM."""
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemTotal:"):
        return int(line.split()[1]) * 1024  # The value is in kB.
  raise ValueError("cannot find the device's memory size: give EngineConfig.num_pages instead")


def size_kv_pool(config: EngineConfig, model: Transformer) -> EngineConfig:
  """`config` with `num_pages` filling `memory_fraction` of one device, less the weights that
  device holds. Under tensor parallelism each device holds 1/tp of every page (its KV heads)."""
  device = jax.local_devices()[0]  # jax.devices()[0] is process 0's: other hosts cannot query it.
  weight_bytes = sum(shard.data.nbytes for x in jax.tree.leaves(nnx.state(model))
                     for shard in x.addressable_shards if shard.device == device)
  memory = device_memory_bytes(device)
  pages = capacity.num_kv_pages(model.cfg, memory * config.tp, config.memory_fraction,
                                  config.page_size, kv_cache.kv_dtype_of(config),
                                  weight_bytes * config.tp)
  if jax.process_count() > 1:  # Every process must build the same cache shape: the smallest pool.
    pages = int(np.min(multihost_utils.process_allgather(np.int32(pages))))
  logging.info("KV pool: %d pages of %d tokens (%d tokens) from %.0f%% of %.2f GiB on %s, "
               "less %.2f GiB of weights", pages, config.page_size, pages * config.page_size,
               100 * config.memory_fraction, memory / 2**30, device.device_kind, weight_bytes / 2**30)
  return dataclasses.replace(config, num_pages=pages)


class _AllAllowed:
  """The masks of steps without a constrained row: one all-ones [B, ceil(V/32)] int32 array per
  batch size, built once and reused, so such a step builds no mask. A given mask is padded to
  the batch with all-ones rows. Masks go to the step as numpy, as every other host input does: a
  device array kept here would commit the state the step returns to its device, and the next
  step on numpy inputs would compile again."""

  def __init__(self, vocab_size: int):
    self.num_words = -(-vocab_size // 32)
    self._ones: dict[int, np.ndarray] = {}

  def rows(self, bitmask: np.ndarray | None, batch: int) -> np.ndarray:
    ones = self._ones.get(batch)
    if ones is None:
      ones = self._ones[batch] = np.full((batch, self.num_words), -1, np.int32)  # -1: 32 bits set.
    if bitmask is None:
      return ones
    if bitmask.shape[0] > batch or bitmask.shape[1:] != (self.num_words,):
      raise ValueError(f"bitmask must be int32 [<= {batch}, {self.num_words}], got "
                       f"{bitmask.dtype} {list(bitmask.shape)}")
    padded = ones.copy()
    padded[:bitmask.shape[0]] = bitmask
    return padded


def _set_sampling(state: DecodeState, slot, row) -> DecodeState:
  sampling = state.sampling.set_row(slot, jax.tree.map(lambda x: x[None], row))
  return DecodeState(state.tokens, state.positions, sampling)

"""The device side of jaxserve: parameters, the KV cache, the decode state, and the compiled step.

It implements `plan.Engine`: the runner hands each plan to `step`, one compiled call that runs
every prefill chunk and decode token of it (engine/step.py), and gets the sampled tokens back as
one future (one async device-to-host copy). Every shape the engine compiles for comes from
`EngineConfig` (step_args.Packer.shapes) and is compiled by `warmup()`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils

from jaxserve.batching.plan import EngineInfo, StepKind, StepPlan
from jaxserve.config import (
  AttentionBackend,
  EngineConfig,
  KVLayout,
  ModelConfig,
  default_attention_backend,
)
from jaxserve.engine import adapters, assembly, kv_spec, placement
from jaxserve.engine.draft import check_draft
from jaxserve.engine.host_kv import HostKV
from jaxserve.engine.sample import NUM_TOP_LOGPROBS
from jaxserve.engine.step import StepOutput
from jaxserve.engine.step_args import StepArgs
from jaxserve.model.llama import Transformer, unstacked
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
  return default_attention_backend(jax.default_backend())


class StepFuture:
  """One step's StepOutput on its way to the host: every copy starts now.

  `result()` and `logprobs()` give the plan's samples in its order: one per decode slot, then one
  per prompt that ends in the step; a scoring step's `prompt_logprobs(chunk)` and a verifying
  step's `verified(chunk)` give its chunks' extra results. `chunk_lens`: the plan's chunks'
  lengths, packed back to back in plan order (where a scoring step's positions are)."""

  def __init__(self, out: StepOutput, rows: list[int], chunk_lens: Sequence[int] = ()):
    self._out, self._rows = out, rows
    self._starts = np.cumsum([0, *chunk_lens]).tolist()
    self._host: dict[str, np.ndarray] = {}
    for x in jax.tree.leaves(out):
      x.copy_to_host_async()

  def _take(self) -> np.ndarray:
    if "sampled" not in self._host:
      self._host["sampled"] = np.asarray(self._out.sampled)[self._rows]
    return self._host["sampled"]

  def result(self) -> np.ndarray:
    return self._take()[:, 0].copy()

  def logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chosen [B], top ids [B, 20], top logprobs [B, 20])."""
    return _unpacked(self._take()[:, 1:])

  def prompt_logprobs(self, chunk: int):
    """(chosen [n], ranks [n], top ids [n, 20], top logprobs [n, 20]) of the chunk's positions."""
    p = self._out.prompt
    if p is None:
      raise ValueError(f"chunk {chunk} of this step did not ask for prompt logprobs")
    at, end = self._starts[chunk], self._starts[chunk + 1]
    return tuple(np.asarray(x)[at:end] for x in (p.logprobs, p.ranks, p.top_ids, p.top_logprobs))

  def verified(self, chunk: int):
    """(accepted a, tokens [k + 1], chosen logprobs [k + 1], top ids [k + 1, 20], top logprobs
    [k + 1, 20]) of plan.prefills[chunk]: its output is tokens[:a + 1]."""
    if self._out.verified is None:
      raise ValueError(f"chunk {chunk} of this step verified no proposals")
    if "verified" not in self._host:
      self._host["verified"] = np.asarray(self._out.verified)
    row = self._host["verified"][chunk]
    x = row[1:].reshape(-1, 2 + 2 * NUM_TOP_LOGPROBS)
    return (int(row[0]), x[:, 0].copy(), *_unpacked(x[:, 1:]))


def _unpacked(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """[n, 1 + 2k] int32 (a logprob's bits, k top ids, their logprobs' bits) -> (logprobs [n],
  top ids [n, k], top logprobs [n, k])."""
  n = NUM_TOP_LOGPROBS
  as_float = lambda a: np.ascontiguousarray(a).view(np.float32)
  return as_float(x[:, 0]), x[:, 1:1 + n].copy(), as_float(x[:, 1 + n:])


def engine_config_for(config: EngineConfig, backend: AttentionBackend) -> EngineConfig:
  """`config` with what the backend and platform decide filled in: the KV layout (the kernels
  read and write the ragged one in place; the jnp path reads every layout, token-major by
  default), speculation's "auto" disable_by_batch_size (SpeculativeConfig.resolved). Raises
  ValueError when the backend cannot store the config's kv_dtype (EngineConfig.check_backend)."""
  config.check_backend(backend)
  if config.speculative is not None:  # "auto" settings are the platform's.
    config = dataclasses.replace(config,
                                 speculative=config.speculative.resolved(jax.default_backend()))
  if config.kv_layout is None:
    reference = backend is AttentionBackend.REFERENCE
    layout = KVLayout.PAGED_TOKEN_MAJOR if reference else KVLayout.RAGGED
    config = dataclasses.replace(config, kv_layout=layout)
  return config


def _assemble(model: Transformer, draft: Transformer | None, config: EngineConfig,
              backend: AttentionBackend):
  """(the steps, their shardings and the programs warm-up compiles: one assembly, shared with
  `plan --compile` (engine/assembly.py); the params the steps take: the model's, or with a
  draft both models'). With unroll_layers the steps run the engine's own copies of the models,
  their layers unrolled (llama.unstacked)."""
  if config.unroll_layers:
    model, draft = unstacked(model), None if draft is None else unstacked(draft)
  graphdef, params = nnx.split(model)
  draft_spec = None
  if draft is not None:
    draft_graphdef, draft_params = nnx.split(draft)
    params, draft_spec = (params, draft_params), (draft_graphdef, draft.cfg)
  return assembly.assemble(graphdef, params, model.cfg, config, backend,
                           placement.mesh_for(config), draft_spec), params


class Engine:
  def __init__(self, model: Transformer, config: EngineConfig, stop_ids: Sequence[int] = (),
               draft: Transformer | None = None):
    """`draft`: the speculative draft model, for SpeculativeConfig(method="draft")
    (engine/draft.py); its vocabulary must be the model's."""
    backend = config.attention_backend or default_backend()
    config = within_model(engine_config_for(config, backend), model.cfg)
    check_draft(config, model.cfg, None if draft is None else draft.cfg)
    adapters.check_model(model, config)
    if config.num_pages is None:
      config = size_kv_pool(config, model, draft)
    self.model_config: ModelConfig = model.cfg
    self.config = config
    self.num_slots, self.page_size = config.num_slots, config.page_size
    self.max_prefill_len = config.prefill_buckets[-1]
    self.backend = backend
    enable_compilation_cache(config.compilation_cache_dir)

    self.assembly, params = _assemble(model, draft, config, backend)
    self.shardings = self.assembly.shardings
    self.params, self.cache, self.state, self.stop_ids = self.assembly.place(params, stop_ids)
    # LoRA adapters; the prefix cache's host tier, P/D's page bytes (kv_handoff.py); or None.
    self.loras = adapters.DeviceLoras.of(model.cfg, config, self.shardings and self.shardings.mesh)
    self.host_kv = self.page_store = HostKV.of(self.cache, config, lambda: self.cache, self._params)
    # The contiguous layout owns one region per slot: its pool is those regions' pages, and the
    # engine hands each slot its own identity table, whatever pages the scheduler picked.
    self.num_pages = self.cache.num_pages
    self.max_model_len = fit_to_pool(config.max_model_len, self.num_pages, self.page_size)
    self.packer = self.assembly.packer
    self._slot_page_tables = self.packer.slot_page_tables
    # A slot's own region holds no one else's KV: no pages to share.
    self.can_share_pages = self._slot_page_tables is None
    self.info = self._engine_info()
    # The cache and decode state are donated: each step updates them in place. Prefill-only
    # steps that also score their prompt positions, and steps that verify speculative
    # proposals, have one more output, so their own jit.
    self._steps = {kind: self.assembly.jit(kind) for kind in StepKind}
    logging.info("Engine: %d slots, %d pages of %d tokens (KV cache %.1f MiB), backend %s",
                 self.num_slots, self.num_pages, self.page_size, self.cache.num_bytes / 2**20,
                 self.backend.value)

  def _params(self):
    return self.params

  def _engine_info(self) -> EngineInfo:
    """What the host side knows of this engine (batching.plan.EngineInfo)."""
    c, windowed = self.config, self.cache.num_window_pages > 0
    return EngineInfo(self.num_slots, self.page_size, self.num_pages, self.max_model_len,
                      self.max_prefill_len, self.can_share_pages, self.model_config.vocab_size,
                      c.prefill_buckets, c.dtype.value, c.max_prefill_seqs,
                      window=self.model_config.sliding_window if windowed else None,
                      num_window_pages=self.cache.num_window_pages,
                      speculative=c.speculative, max_loras=c.max_loras,
                      max_cpu_loras=c.max_cpu_loras,
                      num_host_pages=0 if self.host_kv is None else self.host_kv.num_slots)

  def step(self, plan: StepPlan, bitmask: np.ndarray | None = None,
           run=None) -> StepFuture | None:
    """Runs the plan as given, in one call; the future holds one sample per decode slot, then
    one per prompt that ends in this step (in plan order). bitmask [samples, ceil(V/32)]: each
    sample's allowed tokens, in that order (None: all free). A plan with nothing to run (only
    free slots, which need no device work) makes no call: None. `run` (multihost's) makes the
    call in place of `run_step`."""
    for slot, lora_id in plan.lora_loads:  # Before the step: it may run the adapter.
      self.loras.load(slot, lora_id)
    if plan.kv_saves or plan.kv_loads:  # Before the step, which may overwrite saved pages.
      self.cache = self.host_kv.copy(self.cache, plan.kv_saves, plan.kv_loads)
    if plan.is_empty:
      return None
    args, rows = self.step_args(plan, bitmask)
    chunk_lens = [len(ch.token_ids) for ch in plan.prefills]
    return (run or self.run_step)(args, rows, plan.kind, chunk_lens)

  # The host inputs of the compiled step are built apart from the call, so that `multihost` can
  # broadcast them from process 0 and make every other process run the same call on them.

  def step_args(self, plan: StepPlan, bitmask: np.ndarray | None = None
                ) -> tuple[StepArgs, list[int]]:
    return self.packer.pack(plan, bitmask)

  def run_step(self, args: StepArgs, rows: list[int], kind: StepKind = StepKind.PLAIN,
               chunk_lens: Sequence[int] = ()) -> StepFuture:
    """The `kind` program on `args` (Packer.pack's for a plan of that kind). `chunk_lens`: the
    plan's chunks' lengths, which place them on a scoring step's token axis."""
    params = self.params if self.loras is None else (self.params, self.loras.weights)
    self.cache, self.state, out = self._steps[kind](params, self.cache, self.state, args,
                                                    self.stop_ids)
    return StepFuture(out, rows, chunk_lens)

  def add_lora(self, lora_id: int, adapter) -> None:
    """A host copy of adapter `lora_id` (loading.lora.LoraAdapter), for plans to load."""
    if self.loras is None:
      raise ValueError("LoRA is off: build the engine with EngineConfig(max_loras=N)")
    self.loras.add(lora_id, adapter)

  def remove_lora(self, lora_id: int, slot: int | None = None) -> None:
    """Forgets adapter `lora_id`; zeros the device slot it was in (`slot`, None: none)."""
    if self.loras is not None:
      self.loras.remove(lora_id, slot)

  def warmup(self) -> None:
    """Compiles every program of the assembly (each step shape, and the scoring variant of the
    prefill-only ones): the list `plan --compile` compiles too. Runs only padding: writes only
    to the scratch page."""
    for program in self.assembly.programs():
      self.run_step(program.args, [], program.kind)
    if self.loras is not None:
      self.loras.warmup()
    if self.host_kv is not None:
      self.cache = self.host_kv.warmup(self.cache)
    jax.block_until_ready(self.state)  # An output of the last step: it has run.


def within_model(config: EngineConfig, model: ModelConfig) -> EngineConfig:
  """`config` with max_model_len at most the model's positions (max_position_embeddings), with a
  warning, as vLLM derives it. Clamped before any shape is set from it: the page tables the
  steps compile for are then as wide as those the scheduler fills (the step compiled for 2,048
  positions while the scheduler's tables held 1,024, and a scheduler that sized its decode
  tables from the step's width crashed on the first decode)."""
  if config.max_model_len <= model.max_seq_len:
    return config
  logging.warning("max_model_len %d is more than the model's %d positions: serving "
                  "max_model_len %d", config.max_model_len, model.max_seq_len, model.max_seq_len)
  return dataclasses.replace(config, max_model_len=model.max_seq_len)


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


def size_kv_pool(config: EngineConfig, model: Transformer,
                 draft: Transformer | None = None) -> EngineConfig:
  """`config` with `num_pages` filling `memory_fraction` of one device, less the weights that
  device holds (a speculative draft model's too, whose KV each page also holds). Under tensor
  parallelism each device holds 1/tp of every page (its KV heads)."""
  device = jax.local_devices()[0]  # jax.devices()[0] is process 0's: other hosts cannot query it.
  models = (model,) if draft is None or draft is model else (model, draft)
  weight_bytes = sum(shard.data.nbytes for m in models for x in jax.tree.leaves(nnx.state(m))
                     for shard in x.addressable_shards if shard.device == device)
  # The LoRA adapter slots, made after the pool: counted whole on each device (part of them is).
  weight_bytes += capacity.lora_bytes(model.cfg, config.max_loras, config.max_lora_rank,
                                      np.dtype(config.dtype.value).itemsize)
  memory = device_memory_bytes(device)
  pages = capacity.num_kv_pages(model.cfg, memory * config.tp, config.memory_fraction,
                                  config.page_size, kv_spec.kv_dtype_of(config),
                                  weight_bytes * config.tp,
                                  kv_spec.num_window_pages(model.cfg, config),
                                  kv_spec.lane_groups(config),
                                  None if draft is None else draft.cfg)
  if jax.process_count() > 1:  # Every process must build the same cache shape: the smallest pool.
    pages = int(np.min(multihost_utils.process_allgather(np.int32(pages))))
  logging.info("KV pool: %d pages of %d tokens (%d tokens) from %.0f%% of %.2f GiB on %s, "
               "less %.2f GiB of weights", pages, config.page_size, pages * config.page_size,
               100 * config.memory_fraction, memory / 2**30, device.device_kind,
               weight_bytes / 2**30)
  return dataclasses.replace(config, num_pages=pages)

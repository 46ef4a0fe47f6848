"""The config an engine is built from, resolved once: `resolve(config, model, backend)`.

An `EngineConfig` as given leaves some values to the engine (the KV layout, speculation's "auto"
settings, the pool's pages) and may ask for more than the model or the pool can hold (a longer
window). `resolve` fills in and clamps each of them, in order, once, before any shape is set,
and returns one frozen `EngineSpec`: everything after it (the assembly, the Packer, the KV
cache, the adapter slots, the host tier, the scheduler's `EngineInfo`) reads it and never
decides one of these again.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils

from jaxserve.config import (
  AttentionBackend,
  EngineConfig,
  KVLayout,
  ModelConfig,
  default_attention_backend,
)
from jaxserve.engine import adapters, kv_spec
from jaxserve.engine.draft import check_draft
from jaxserve.model.llama import Transformer
from jaxserve.planning import capacity


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """What an engine is built from, resolved once: the config with every choice made, the
  model's config (and the speculative draft model's), the attention backend. The assembly takes
  it whole; the parts below it take the piece they need (`adapter_slots`), and the scheduler
  takes the engine's `EngineInfo`."""

  config: EngineConfig
  model: ModelConfig
  backend: AttentionBackend
  draft: ModelConfig | None = None

  @property
  def adapter_slots(self) -> adapters.AdapterSlots | None:
    """The LoRA adapter slots' shape; None when LoRA is off."""
    c = self.config
    if not c.max_loras:
      return None
    return adapters.AdapterSlots(c.max_loras + 1, c.max_lora_rank, c.dtype.value)


def resolve(config: EngineConfig, model: Transformer, backend: AttentionBackend,
            draft: Transformer | None = None) -> EngineSpec:
  """The spec of an engine of `model` (and its speculative `draft`) on `backend`: what the
  backend decides filled in (engine_config_for), max_model_len within the model's positions
  (within_model), the draft and the adapters checked against the model, and with num_pages None
  the pool sized to the device (size_kv_pool). Raises ValueError for a config the model or the
  backend cannot run."""
  config = within_model(engine_config_for(config, backend), model.cfg)
  draft_cfg = None if draft is None else draft.cfg
  check_draft(config, model.cfg, draft_cfg)
  if config.max_loras:
    adapters.check_model(model)
  if config.num_pages is None:
    config = size_kv_pool(config, model, draft)
  return EngineSpec(config, model.cfg, backend, draft_cfg)


def default_backend(config: EngineConfig) -> AttentionBackend:
  """Plain jnp on CPU (Pallas there is interpret mode only; kernels_cpu's ragged kernel with
  int8 activations); the kernels on TPU and GPU (config.engine.default_attention_backend)."""
  return default_attention_backend(jax.default_backend(), config.cpu_activations)


def engine_config_for(config: EngineConfig, backend: AttentionBackend) -> EngineConfig:
  """`config` with what the backend and platform decide filled in: the KV layout (the kernels
  read and write the ragged one in place; the jnp path reads every layout, token-major by
  default), speculation's "auto" disable_by_batch_size and verify_cost
  (SpeculativeConfig.resolved). Raises ValueError when the backend cannot store the config's
  kv_dtype (EngineConfig.check_backend)."""
  config.check_backend(backend)
  if config.speculative is not None:  # "auto" settings are the platform's.
    config = dataclasses.replace(config,
                                 speculative=config.speculative.resolved(jax.default_backend()))
  if config.kv_layout is None:
    reference = backend is AttentionBackend.REFERENCE
    layout = KVLayout.PAGED_TOKEN_MAJOR if reference else KVLayout.RAGGED
    config = dataclasses.replace(config, kv_layout=layout)
  return config


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

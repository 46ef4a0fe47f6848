"""The device side of jaxserve: parameters, the KV cache, the decode state, and the compiled step.

It implements `plan.Engine`: the runner hands each plan to `step`, one compiled call that runs
every prefill chunk and decode token of it (engine/step.py), and gets the sampled tokens back as
one future (one async device-to-host copy: engine/step_future.py). It is built from the config
`resolve` gives (engine/resolve.py); every shape it compiles for comes from that config
(step_args.Packer.shapes) and is compiled by `warmup()`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx

from jaxserve.batching.plan import EngineInfo, StepKind, StepPlan
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import adapters, assembly, placement, weight_update
from jaxserve.engine.host_kv import HostKV
from jaxserve.engine.images import ImageEncoder
from jaxserve.engine.resolve import EngineSpec, default_backend, fit_to_pool, resolve
from jaxserve.engine.step_args import StepArgs
from jaxserve.engine.step_future import StepFuture
from jaxserve.model import quant_linear
from jaxserve.model.llama import Transformer, unstacked


def enable_compilation_cache(path: str | None) -> None:
  """JAX's persistent cache: a second start loads compiled buckets instead of compiling."""
  if path is None:
    return
  path = os.path.expanduser(path)
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _assemble(model: Transformer, draft: Transformer | None, spec: EngineSpec):
  """(the steps, their shardings and the programs warm-up compiles: one assembly, shared with
  `plan --compile` (engine/assembly.py); the params the steps take: the model's, or with a
  draft both models'; the model's graphdef, which the image encoder takes too). With
  unroll_layers the steps run the engine's own copies of the models, their layers unrolled
  (llama.unstacked)."""
  if spec.config.unroll_layers:
    model, draft = unstacked(model), None if draft is None else unstacked(draft)
  # The engine's own view of the models, its products in the config's mode (a draft's too, so
  # that every row of every step runs in it).
  mode = spec.config.cpu_activations
  model, draft = (None if m is None else quant_linear.with_activations(m, mode)
                  for m in (model, draft))
  graphdef, params = nnx.split(model)
  draft_graphdef = None
  if draft is not None:
    draft_graphdef, draft_params = nnx.split(draft)
    params = (params, draft_params)
  return assembly.assemble(graphdef, params, spec, placement.mesh_for(spec.config),
                           draft_graphdef), params, graphdef


def _is_weight(x) -> bool:
  return not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True)
class _HostCopy:
  """A weight in host memory while the engine sleeps, and the sharding it goes back to (None:
  uncommitted, as it was)."""

  value: np.ndarray
  sharding: jax.sharding.Sharding | None


def _to_host(x):
  return _HostCopy(np.asarray(x), x.sharding if x.committed else None) if _is_weight(x) else x


def _is_host_copy(x) -> bool:
  return isinstance(x, _HostCopy)


def _to_device(x):
  if not _is_host_copy(x):
    return x
  return jax.device_put(x.value, x.sharding)  # No sharding: uncommitted. (jnp.asarray compiles.)


def _pure(params):
  """A pure dict of the weights: nnx.State's (nnx.to_pure_dict), or `params` as they are."""
  return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


class Engine:
  sleep_level = 0  # 1: no KV cache on the device, 2: nor weights (`sleep`); set per engine.

  def __init__(self, model: Transformer, config: EngineConfig, stop_ids: Sequence[int] = (),
               draft: Transformer | None = None):
    """`draft`: the speculative draft model, for SpeculativeConfig(method="draft")
    (engine/draft.py); its vocabulary must be the model's."""
    self.spec = resolve(config, model, config.attention_backend or default_backend(config),
                         draft)
    config = self.spec.config
    self.model_config: ModelConfig = model.cfg
    self.config, self.backend = config, self.spec.backend
    self.num_slots, self.page_size = config.num_slots, config.page_size
    self.max_prefill_len = config.prefill_buckets[-1]
    enable_compilation_cache(config.compilation_cache_dir)

    self.assembly, params, graphdef = _assemble(model, draft, self.spec)
    self.shardings = self.assembly.shardings
    self.params, self.cache, self.state, self.stop_ids = self.assembly.place(params, stop_ids)
    # LoRA adapters; the prefix cache's host tier, P/D's page bytes (kv_handoff.py); or None.
    self.loras = adapters.DeviceLoras.of(model.cfg, self.spec.adapter_slots,
                                         self.shardings and self.shardings.mesh)
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
    # The cache and decode state are donated: each step updates them in place. Steps of each
    # kind (scoring, verifying, pooling: one more output) have their own jit.
    self._steps = {kind: self.assembly.jit(kind) for kind in StepKind}
    # The target's weights' forms, for `update_weights`; one CPU device: the numpy way.
    on_cpu = self.shardings is None and jax.local_devices()[0].platform == "cpu"
    self._weights = weight_update.WeightUpdate(model, config.unroll_layers, on_cpu)
    self._draft_is_target = draft is model
    self.images = ImageEncoder.of(model.cfg.vision, graphdef, self._target_params, self.spec)
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
                      num_host_pages=0 if self.host_kv is None else self.host_kv.num_slots,
                      pooling=None if c.pooling is None else c.pooling.mode,
                      max_images=self._max_images(), vision=self.model_config.vision)

  def _max_images(self) -> int:
    """Images one prompt may carry: as many as the context holds (Gemma 3 sets no limit of its
    own); 0 for a text-only model."""
    v = self.model_config.vision
    return 0 if v is None else self.max_model_len // v.num_image_tokens

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
    if self.images is None:
      return self.packer.pack(plan, bitmask)
    return self.packer.pack(plan, bitmask, self.images.soft_tokens, self.images.rope_deltas(plan))

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

  def sleep(self, level: int = 1) -> int:
    """vLLM's sleep mode, for a process that needs the device for something else (a trainer):
    level 1 frees the KV cache, level 2 the weights too (a host copy is kept for `wake_up`).
    The device bytes freed. Every page's KV is gone: the runner resets its prefix cache first."""
    if level not in (1, 2):
      raise ValueError(f"sleep level must be 1 (the KV cache) or 2 (the KV cache and the "
                       f"weights), got {level!r}")
    if self.sleep_level:
      raise ValueError(f"the engine is asleep already (level {self.sleep_level})")
    freed = {id(x): x for x in jax.tree.leaves(self.cache)}
    if level == 2:
      # Each weight's host copy and where it goes back (uncommitted ones stay uncommitted, as
      # the compiled steps took them); PRNG keys (an NNX model's Rngs) stay on the device.
      self._asleep = jax.tree.map(_to_host, self.params)
      freed.update({id(x): x for x in jax.tree.leaves(self.params) if _is_weight(x)})
      self.params = None
    self.cache, self.sleep_level = None, level
    for x in freed.values():
      x.delete()
    return sum(x.nbytes for x in freed.values())

  def wake_up(self) -> None:
    """Back from `sleep`: the weights as they were, an empty KV cache; nothing compiles."""
    if self.sleep_level == 2:
      self.params = jax.tree.map(_to_device, self._asleep, is_leaf=_is_host_copy)
      self._asleep = None
    if self.sleep_level:
      self.cache, self.sleep_level = self.assembly.new_cache(), 0

  def check_weights(self, params) -> None:
    """Raises ValueError naming the first weight of `params` that `update_weights` would not
    take; changes nothing."""
    self._weights.check(self._target_params(), _pure(params))

  def update_weights(self, params, on_host: bool | None = None) -> None:
    """Writes a trainer's weights into the engine's: `params` in the model's float layout
    (`nnx.to_pure_dict(nnx.state(model))`, or that nnx.State), any float dtype, anywhere; each
    weight cast, quantized or moved to the engine's form (engine/weight_update.py), the old
    arrays donated, and nothing compiled again for the steps. With a speculative draft model
    that is the target itself, both. The caller forgets the prefix cache (Runner's does): no KV
    computed with the old weights may be read again. `on_host`: weight_update's."""
    if self.sleep_level == 2:
      raise ValueError("the engine's weights are asleep (level 2): wake_up() first")
    new = self._weights(self._target_params(), _pure(params), on_host)
    if self.spec.draft is None:
      self.params = new
    else:
      self.params = (new, new if self._draft_is_target else self.params[1])
    if self.host_kv is not None:
      self.host_kv.forget_fingerprint()
    if self.images is not None:
      self.images.forget()

  def update_lora(self, lora_id: int, adapter, slot: int | None = None) -> None:
    """Adapter `lora_id`'s weights replaced by `adapter`'s: its host copy, and `slot`, the
    device slot it sits in (None: none)."""
    if self.loras is None:
      raise ValueError("LoRA is off: build the engine with EngineConfig(max_loras=N)")
    self.loras.replace(lora_id, adapter, slot)

  def _target_params(self):
    return self.params[0] if self.spec.draft is not None else self.params

  def warmup(self) -> None:
    """Compiles every program of the assembly (each step shape, and the scoring variant of the
    prefill-only ones): the list `plan --compile` compiles too. Runs only padding: writes only
    to the scratch page."""
    for program in self.assembly.programs():
      self.run_step(program.args, [], program.kind)
    if self.loras is not None:
      self.loras.warmup()
    if self.images is not None:
      self.images.warmup()
    if self.host_kv is not None:
      self.cache = self.host_kv.warmup(self.cache)
    jax.block_until_ready(self.state)  # An output of the last step: it has run.

"""Every program the engine compiles at warm-up, compiled for a real chip on this machine.

The engine is built on abstract weights (`nnx.eval_shape`: shapes only, no memory), so
Llama-3-8B compiles for a v6e from a laptop. `engine_programs` lists what `Engine.warmup`
compiles (sampling set-up, each prefill bucket, each decode batch bucket x table width);
`compile_engine` compiles them for a target (`targets.py`) and sizes the KV pool the way a chip
must: weights + cache + the largest program's other needs (temp, and outputs not aliased to a
donated input) within `memory_fraction` of the chip. Today a step's temp grows with the cache
(issue 14), so the pool is found by compiling: two small probe pools give each program's need as
a line in the page count, the line gives the pool, and a compile at that pool confirms it (or
shrinks it). The compiler's verdict is the final word.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve import capacity, kv_cache, targets
from jaxserve.config import AttentionBackend, EngineConfig, KVLayout, ModelConfig, SamplingParams
from jaxserve.decode import DecodeState, decode_step
from jaxserve.engine import _set_sampling
from jaxserve.kv_cache import KVCache
from jaxserve.model import Transformer
from jaxserve.prefill import prefill_step
from jaxserve.sample import SamplingRow

_KERNELS = {targets.Platform.TPU: AttentionBackend.PALLAS_TPU,
            targets.Platform.CUDA: AttentionBackend.PALLAS_GPU}
_MAX_CONFIRMS = 3  # Compiles at a computed pool before giving up on fitting it.
_SHRINK = 0.97  # When the confirming compile does not fit, the next try has 3% fewer pages.


@dataclasses.dataclass(frozen=True)
class Program:
  name: str
  fn: Callable
  args: tuple  # Pytrees of ShapeDtypeStructs.
  donate: tuple[int, ...] = ()


def _i32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.int32)


def abstract_weights(model: ModelConfig, dtype: str):
  """(graphdef, params) of the model with ShapeDtypeStruct leaves: no weight is ever made."""
  abstract = nnx.eval_shape(lambda: Transformer(model, jnp.dtype(dtype), rngs=nnx.Rngs(0)))
  return nnx.split(abstract)


def engine_programs(model: ModelConfig, config: EngineConfig, backend: AttentionBackend,
                    num_stop_ids: int = 1) -> list[Program]:
  """The programs `Engine.warmup` compiles, on abstract arguments (single device: tp = dp = 1)."""
  if config.tp * config.dp > 1:
    raise ValueError("compiling for a target covers one device (tp = dp = 1) so far")
  graphdef, params = abstract_weights(model, config.dtype)
  cache = jax.eval_shape(lambda: KVCache.create(model, config))
  state = jax.eval_shape(lambda: DecodeState.create(config.num_slots, model.vocab_size))
  row = jax.eval_shape(lambda: SamplingRow.from_params(SamplingParams(), 0, (), (), model.vocab_size).as_state())
  stop_ids, scalar = _i32(num_stop_ids), _i32()
  programs = [Program("set_sampling", _set_sampling, (state, scalar, row), donate=(0,))]
  prefill = functools.partial(prefill_step, graphdef, backend=backend)
  for T in config.prefill_buckets:
    programs.append(Program(
        f"prefill T={T}", prefill, (params, cache, state, _i32(T), scalar, scalar,
                                    _i32(config.max_blocks_per_seq), scalar,
                                    jax.ShapeDtypeStruct((), jnp.bool_), stop_ids), donate=(1, 2)))
  decode = functools.partial(decode_step, graphdef, backend=backend, in_place=False)
  for B in config.decode_batch_buckets:
    for W in config.decode_block_buckets:
      programs.append(Program(f"decode B={B} W={W}", decode,
                              (params, cache, state, _i32(B), _i32(B, W), stop_ids), donate=(1, 2)))
  return programs


def need_bytes(report: dict[str, Any]) -> int:
  """What a compiled program holds at its peak: its arguments, its temp, and its outputs less
  those written into donated inputs."""
  r = report
  return r["argument_bytes"] + r["temp_bytes"] + r["output_bytes"] - r["alias_bytes"]


def compile_programs(target: str, model: ModelConfig, config: EngineConfig) -> list[dict[str, Any]]:
  device = targets.abstract_device(target)
  backend = config.attention_backend or _KERNELS[targets.TARGETS[target].platform]
  return [targets.compile_report(p.fn, p.args, device, donate=p.donate, name=p.name)
          for p in engine_programs(model, config, backend)]


def kv_pool(model: ModelConfig, config: EngineConfig) -> dict[str, int]:
  """The pool of `config` as the engine allocates it: pages (scratch page 0 included), tokens a
  sequence can use (the scratch page holds none), bytes."""
  cache = jax.eval_shape(lambda: KVCache.create(model, config))
  pages = cache.num_pages
  return {"pages": pages, "page_size": config.block_size, "tokens": (pages - 1) * config.block_size,
          "bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))}


def compile_engine(target: str, model: ModelConfig, config: EngineConfig) -> dict[str, Any]:
  """Compiles every warm-up program for `target`. With `config.num_blocks` None the pool is
  sized to fit (see the module docstring). Returns {target, usable_bytes, memory_fraction,
  fits, programs: [report, ...], kv_pool: {pages, page_size, tokens, bytes}, tries: [pages...]}:
  `fits` says every program compiled and the largest need is within the fraction."""
  usable = targets.TARGETS[target].usable_bytes
  budget = int(usable * config.memory_fraction)
  run = lambda pages: (pages, compile_programs(target, model, _with_pages(config, pages)))
  if config.num_blocks is not None or config.kv_layout is KVLayout.CONTIGUOUS:
    tries = [run(config.num_blocks or 2)]  # Contiguous: the slots' regions set the pool.
  else:
    tries = _size_pool(model, config, budget, run)
  pages, reports = tries[-1]
  final = _with_pages(config, pages)
  return {"target": target, "usable_bytes": usable, "memory_fraction": config.memory_fraction,
          "fits": _fits(reports, budget), "programs": reports, "kv_pool": kv_pool(model, final),
          "tries": [p for p, _ in tries]}


def _size_pool(model, config, budget, run) -> list[tuple[int, list]]:
  # Today's sizing, from the weights alone: the most pages there can be.
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_weights(model, config.dtype)[1]))
  ceiling = capacity.num_kv_blocks(model, budget, 1.0, config.block_size, kv_cache.kv_dtype_of(config), weights)
  probes = [run(max(2, ceiling // 16)), run(max(3, ceiling // 8))]
  tries = list(probes)
  if not all(_compiled(r) for _, r in probes):
    return tries  # Not a matter of size: the report carries the compiler's message.
  (p0, r0), (p1, r1) = probes
  # Each program's need is a + s * pages; the pool is the largest that keeps every one in budget.
  lines = [(need_bytes(a), (need_bytes(b) - need_bytes(a)) / (p1 - p0)) for a, b in zip(r0, r1)]
  pages = min(int(p0 + (budget - a) // s) if s > 0 else ceiling for a, s in lines)
  for _ in range(_MAX_CONFIRMS):
    tries.append(run(max(2, min(pages, ceiling))))
    if _fits(tries[-1][1], budget) or pages <= 2:
      break
    pages = int(pages * _SHRINK)
  return tries


def _compiled(reports) -> bool:
  return all(r["compiled"] for r in reports)


def _fits(reports, budget: int) -> bool:
  return _compiled(reports) and max(need_bytes(r) for r in reports) <= budget


def _with_pages(config: EngineConfig, pages: int) -> EngineConfig:
  return dataclasses.replace(config, num_blocks=pages, compilation_cache_dir=None)

"""The KV pool a real chip fits, found by compiling the engine's programs for it (programs.py).

`compile_engine` compiles every warm-up program for a target and sizes the KV pool the way a
chip must: weights + cache + the largest program's other needs (temp, and outputs not aliased to
a donated input) within `memory_fraction` of the chip. The pool is found by compiling, and each
need is a line in the page count (its slope about the cache's own bytes a page, now that the
kernels write it in place): the neediest program of each kind (`neediest`: picked by shape) at a
small probe pool gives the lines at that slope; the neediest of those (as many as compile at
once) compiled at the pool the lines predict give their own slopes (a step's temp can grow near
a full chip); the lines give the pool, and compiling every program once at it confirms it (or
refits the lines and shrinks it). The compiler's verdict is the final word.

With a host tier (`kv_offload_gib`) the host pool is host memory: it takes nothing from the KV
pool.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.compiling import targets
from jaxserve.compiling.programs import (
  COMPILE_WORKERS,
  UPDATE,
  abstract_weights,
  compile_programs,
  draft_model,
  need_bytes,
  neediest,
)
from jaxserve.config import AttentionBackend, EngineConfig, KVLayout, ModelConfig
from jaxserve.engine import host_kv, kv_spec
from jaxserve.engine.draft import create_cache
from jaxserve.engine.resolve import engine_config_for
from jaxserve.planning import capacity

_MAX_CONFIRMS = 3  # Compiles of every program at a computed pool before giving up on fitting.


def kv_pool(model: ModelConfig, config: EngineConfig) -> dict[str, int]:
  """The pool of `config` as the engine allocates it: pages (scratch page 0 included), tokens a
  sequence can use (the scratch page holds none), bytes (all devices'; `device_bytes`: each
  one's, under tp), and the host tier's pages (in host memory, beside the pool). The layout is
  the kernels' unless the config names one."""
  config = engine_config_for(config, config.attention_backend or AttentionBackend.PALLAS)
  cache = jax.eval_shape(lambda: create_cache(model, config, draft_model(config)))
  pages, size = cache.num_pages, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  window = cache.num_window_pages
  return {"pages": pages, "page_size": config.page_size, "tokens": (pages - 1) * config.page_size,
          "bytes": size, "device_bytes": size // config.tp, "window_pages": window,
          "host_pages": host_kv.num_host_slots(cache, config.kv_offload_gib)}


def compile_engine(target: str, model: ModelConfig, config: EngineConfig,
                   workers: int = COMPILE_WORKERS) -> dict[str, Any]:
  """Compiles every warm-up program for `target`, `workers` at a time; with `config.num_pages`
  None the pool is sized to fit first (see the module docstring). Returns {target, usable_bytes,
  memory_fraction, fits, programs: [report, ...], kv_pool: {pages, page_size, tokens, bytes},
  tries: [pages, ...]}: `fits` says every program compiled and the largest need is within the
  fraction; `tries` lists the pools compiled on the way (the last is the one reported; its
  reports cover every program unless the probe failed, when they are the probe's)."""
  usable = targets.TARGETS[target].usable_bytes
  budget = int(usable * config.memory_fraction)
  run = lambda pages, only=None: compile_programs(target, model, _with_pages(config, pages), only,
                                                  workers)
  if config.num_pages is not None or config.kv_layout is KVLayout.CONTIGUOUS:
    pages = config.num_pages or 2  # Contiguous: the slots' regions set the pool, not this.
    tries = [(pages, run(pages))]
  else:
    tries = _size_pool(run, target, model, config, budget, workers)
  pages, reports = tries[-1]
  return {"target": target, "usable_bytes": usable, "memory_fraction": config.memory_fraction,
          "fits": _fits(reports, budget), "programs": reports,
          "kv_pool": kv_pool(model, _with_pages(config, pages)), "tries": [p for p, _ in tries]}


def _size_pool(run, target, model, config, budget, workers) -> list[tuple[int, list]]:
  """[(pages, reports), ...]: the neediest programs at a probe pool, the neediest of those at the
  pool their lines predict, then every program at pools computed to fit, the first of those
  fitting (or the last one tried)."""
  ceiling = _most_pages(model, config, budget)
  p0 = max(2, ceiling // 16)  # Small enough to compile whatever each page costs the steps.
  base = run(p0, neediest)
  if not _compiled(base):
    return [(p0, base)]  # Not a matter of size: the reports carry the compiler's messages.
  base = _serving(base)
  # The lines at the cache's own bytes a page predict the pool; the neediest programs compiled
  # there (as many as compile at once) give their own slopes. A slope from a second small pool
  # missed: Qwen2.5-0.5B's mixed step holds 30 MB more temp near a full chip than at 1/8 of it.
  top = max(ceiling, p0 + 1)  # A ceiling under the probe pool: the weights leave no room.
  cache_slope = ((kv_pool(model, _with_pages(config, top))["device_bytes"]
                  - kv_pool(model, _with_pages(config, p0))["device_bytes"]) / (top - p0))
  p1 = _pool_within([(need_bytes(r), cache_slope) for r in base], p0, budget, ceiling)
  worst = sorted(base, key=need_bytes, reverse=True)[:workers]
  probes = run(p1, [r["name"] for r in worst]) if p1 > p0 else []
  at_p0 = {r["name"]: need_bytes(r) for r in base}
  if not _compiled(probes):  # Out of memory there: from halfway back, at the cache's slope.
    return [(p0, base), (p1, probes)] + _confirm(run, at_p0, p0, (p0 + p1) // 2, cache_slope,
                                                 budget, ceiling)
  slope = max([cache_slope] + [(need_bytes(r) - at_p0[r["name"]]) / (p1 - p0) for r in probes])
  lines = [(at_p0[r["name"]], slope) for r in base]
  pages = _pool_within(lines, p0, budget, ceiling)
  return [(p0, base)] + ([(p1, probes)] if probes else []) + _confirm(
      run, at_p0, p0, pages, slope, budget, ceiling)


def _most_pages(model, config, budget) -> int:
  """The pool that the weights alone leave room for (today's engine sizes so): the most pages
  there can be."""
  params = abstract_weights(model, config.dtype.value, config.quantization)[1]
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  # Under ep each device holds 1/ep of the experts (and all of the rest, 1/tp of it split).
  experts = (model.num_layers * model.num_experts * 3 * model.dim * model.expert_hidden_dim
             * jnp.dtype(config.dtype.value).itemsize)
  weights -= experts - experts // config.ep
  weights += capacity.lora_bytes(model, config.max_loras, config.max_lora_rank,
                                 jnp.dtype(config.dtype.value).itemsize)
  draft = draft_model(config)
  if draft is not None:
    weights += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        abstract_weights(draft, config.dtype.value, config.quantization)[1]))
  resolved = engine_config_for(config, config.attention_backend or AttentionBackend.PALLAS)
  return capacity.num_kv_pages(model, budget * config.tp, 1.0, config.page_size,
                               kv_spec.kv_dtype_of(config), weights,  # tp: each holds 1/tp.
                               kv_spec.num_window_pages(model, config),
                               kv_spec.lane_groups(resolved), draft)


def _confirm(run, at_p0, p0, pages, slope, budget, ceiling) -> list[tuple[int, list]]:
  """Every program compiled at `pages`: once, unless the compiler disagrees with the lines
  (need = a + slope * (pages - p0), a from `at_p0`: {name: need} at the probe pool); then
  refitted, or
  halfway back to the probe when a program did not compile, at most _MAX_CONFIRMS times."""
  tries = []
  for _ in range(_MAX_CONFIRMS):
    reports = run(pages)
    tries.append((pages, reports))
    if _fits(reports, budget) or pages <= p0:
      break
    if _compiled(reports):  # Every program's line through its need here, at the steepest slope.
      slope = max([slope] + [(need_bytes(r) - at_p0[r["name"]]) / (pages - p0)
                             for r in reports if r["name"] in at_p0])
      lines = [(need_bytes(r) - slope * (pages - p0), slope) for r in _serving(reports)]
      pages = min(pages - 1, _pool_within(lines, p0, budget, ceiling))
    else:  # Out of memory after all: halfway back to the probe that compiled.
      pages = (p0 + pages) // 2
  return tries


def _pool_within(lines, p0: int, budget: int, ceiling: int) -> int:
  """The most pages that keep every need a + s * (pages - p0) within `budget`."""
  return max(2, min([ceiling] + [p0 + int((budget - a) // s) for a, s in lines if s > 0]))


def _serving(reports) -> list:
  """The reports that size the pool and decide the fit: every program but `update weights`,
  which only LLM.update_weights runs (a trainer's float32 weights beside the engine's may not fit
  a chip that serves the model: Gemma 3 4B on v5e); its own report still says so."""
  return [r for r in reports if r["name"] != UPDATE or r["compiled"]]


def _compiled(reports) -> bool:
  return all(r["compiled"] for r in _serving(reports))


def _fits(reports, budget: int) -> bool:
  serving = _serving(reports)
  return _compiled(serving) and max(need_bytes(r) for r in serving) <= budget


def _with_pages(config: EngineConfig, pages: int) -> EngineConfig:
  return dataclasses.replace(config, num_pages=pages, compilation_cache_dir=None)

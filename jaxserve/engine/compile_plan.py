"""Every program the engine compiles at warm-up, compiled for a real chip on this machine.

The engine is built on abstract weights (`nnx.eval_shape`: shapes only, no memory), so
Llama-3-8B compiles for a v6e from a laptop. `engine_programs` lists what `Engine.warmup`
compiles (one program per step shape: decode rows x prefill tokens x table width);
`compile_engine` compiles them for a target (`targets.py`) and sizes the KV pool the way a chip
must: weights + cache + the largest program's other needs (temp, and outputs not aliased to a
donated input) within `memory_fraction` of the chip. The pool is found by compiling: every
program at a small probe pool, the neediest again at a second one, gives each program's need as
a line in the page count (flat, now that the kernels write the cache in place); the lines give
the pool, and compiling every program at it confirms it (or refits the lines and shrinks it).
The compiler's verdict is the final word.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import AttentionBackend, EngineConfig, KVLayout, ModelConfig
from jaxserve.engine import placement, targets
from jaxserve.engine.engine import engine_config_for
from jaxserve.engine.step import DecodeState, step
from jaxserve.engine.step_args import Packer
from jaxserve.model import kv_cache
from jaxserve.model.attention import AttentionSpec
from jaxserve.model.families import model_class
from jaxserve.planning import capacity

_KERNELS = {targets.Platform.TPU: AttentionBackend.PALLAS_TPU,
            targets.Platform.CUDA: AttentionBackend.PALLAS_GPU}
_MAX_CONFIRMS = 3  # Compiles of every program at a computed pool before giving up on fitting.


@dataclasses.dataclass(frozen=True)
class Program:
  name: str
  fn: Callable
  args: tuple  # Pytrees of ShapeDtypeStructs.
  donate: tuple[int, ...] = ()
  shardings: tuple | None = None  # Over a mesh (tp > 1): each argument's, and the results'.
  out_shardings: Any = None


def _i32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.int32)


def abstract_weights(model: ModelConfig, dtype: str):
  """(graphdef, params) of the model with ShapeDtypeStruct leaves: no weight is ever made."""
  abstract = nnx.eval_shape(lambda: model_class(model)(model, jnp.dtype(dtype), rngs=nnx.Rngs(0)))
  return nnx.split(abstract)


def engine_programs(model: ModelConfig, config: EngineConfig, backend: AttentionBackend,
                    num_stop_ids: int = 1, devices=None) -> list[Program]:
  """The programs `Engine.warmup` compiles, on abstract arguments: one per step shape
  (Packer.shapes), and the scoring variant of the prefill-only ones. With tp > 1, over a
  `model` mesh of `devices` (abstract ones), the arrays placed as the engine places them."""
  if config.dp > 1:
    raise ValueError("compiling for a target covers tensor parallelism (--tp) only, not --dp")
  config = engine_config_for(config, backend)
  graphdef, params = abstract_weights(model, config.dtype.value)
  cache = jax.eval_shape(lambda: kv_cache.create(model, config))
  state = jax.eval_shape(lambda: DecodeState.create(config.num_slots, model.vocab_size))
  stop_ids = _i32(num_stop_ids)  # [E]: the tokenizer's stop ids; E sets no memory.
  mesh = placement.make_mesh(config.tp, 1, devices=list(devices)) if config.tp > 1 else None
  fn = functools.partial(step, graphdef, attn=AttentionSpec(backend, mesh))
  packer = Packer(config, model.vocab_size, None, cache.PAGE_GROUPS)
  abstract = lambda args: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
  programs = []
  for scored, shapes in ((False, packer.shapes()), (True, packer.scored_shapes())):
    for shape in shapes:
      D, T, W = shape
      name = f"step D={D} T={T} W={W}" + (" scored" if scored else "")
      args = (params, cache, state, abstract(packer.template(shape, scored=scored)), stop_ids)
      shardings = out = None
      if mesh is not None:
        s = placement.EngineShardings.create(mesh, model, config, params, state)
        rep = lambda tree: jax.tree.map(lambda _: s.replicated, tree)
        shardings = (s.params, s.cache, s.state, rep(args[3]), s.replicated)
        out = (*s.step_out, s.replicated) if scored else s.step_out
      programs.append(Program(name, fn, args, donate=(1, 2), shardings=shardings,
                              out_shardings=out))
  return programs


def need_bytes(report: dict[str, Any]) -> int:
  """What a compiled program holds at its peak: its arguments, its temp, and its outputs less
  those written into donated inputs."""
  r = report
  return r["argument_bytes"] + r["temp_bytes"] + r["output_bytes"] - r["alias_bytes"]


def compile_programs(target: str, model: ModelConfig, config: EngineConfig,
                     only: str | None = None) -> list[dict[str, Any]]:
  """The reports of every warm-up program (or of the one named `only`) compiled for `target`."""
  devices = targets.abstract_devices(target)
  if config.tp > len(devices):
    raise ValueError(f"--tp {config.tp}: {target}'s compile-only topology has {len(devices)} chips")
  backend = config.attention_backend or _KERNELS[targets.TARGETS[target].platform]
  return [targets.compile_report(p.fn, p.args, devices[0], donate=p.donate, name=p.name,
                                 shardings=p.shardings, out_shardings=p.out_shardings)
          for p in engine_programs(model, config, backend, devices=devices)
          if only in (None, p.name)]


def kv_pool(model: ModelConfig, config: EngineConfig) -> dict[str, int]:
  """The pool of `config` as the engine allocates it: pages (scratch page 0 included), tokens a
  sequence can use (the scratch page holds none), bytes (all devices'; `device_bytes`: each
  one's, under tp). The layout is the kernels' unless the config names one."""
  config = engine_config_for(config, config.attention_backend or AttentionBackend.PALLAS)
  cache = jax.eval_shape(lambda: kv_cache.create(model, config))
  pages, size = cache.num_pages, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  window = cache.window.num_pages if isinstance(cache, kv_cache.WindowedKV) else 0
  return {"pages": pages, "page_size": config.page_size, "tokens": (pages - 1) * config.page_size,
          "bytes": size, "device_bytes": size // config.tp, "window_pages": window}


def compile_engine(target: str, model: ModelConfig, config: EngineConfig) -> dict[str, Any]:
  """Compiles every warm-up program for `target`; with `config.num_pages` None the pool is sized
  to fit first (see the module docstring). Returns {target, usable_bytes, memory_fraction, fits,
  programs: [report, ...], kv_pool: {pages, page_size, tokens, bytes}, tries: [pages, ...]}:
  `fits` says every program compiled and the largest need is within the fraction; `tries` lists
  the pools compiled on the way (the last is the one reported)."""
  usable = targets.TARGETS[target].usable_bytes
  budget = int(usable * config.memory_fraction)
  if config.num_pages is not None or config.kv_layout is KVLayout.CONTIGUOUS:
    pages = config.num_pages or 2  # Contiguous: the slots' regions set the pool, not this.
    tries = [(pages, compile_programs(target, model, _with_pages(config, pages)))]
  else:
    tries = _size_pool(target, model, config, budget)
  pages, reports = tries[-1]
  return {"target": target, "usable_bytes": usable, "memory_fraction": config.memory_fraction,
          "fits": _fits(reports, budget), "programs": reports,
          "kv_pool": kv_pool(model, _with_pages(config, pages)), "tries": [p for p, _ in tries]}


def _size_pool(target, model, config, budget) -> list[tuple[int, list]]:
  """[(pages, reports), ...]: a probe pool, then pools computed to fit, the last one fitting (or
  the last one tried)."""
  run = lambda pages, only=None: compile_programs(target, model, _with_pages(config, pages), only)
  params = abstract_weights(model, config.dtype.value)[1]
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  # Today's engine sizes from the weights alone: the most pages there can be.
  ceiling = capacity.num_kv_pages(model, budget * config.tp, 1.0, config.page_size,
                                   kv_cache.kv_dtype_of(config), weights,  # tp: each holds 1/tp.
                                   kv_cache.num_window_pages(model, config))
  p0 = max(2, ceiling // 16)  # Small enough to compile whatever each page costs the steps.
  base = run(p0)
  tries = [(p0, base)]
  if not _compiled(base):
    return tries  # Not a matter of size: the reports carry the compiler's messages.
  # How fast the largest need grows with the pool, from that program at a second pool.
  worst = max(base, key=need_bytes)
  p1 = max(p0 + 1, ceiling // 8)
  probe = run(p1, only=worst["name"])[0]
  if not probe["compiled"]:
    return tries + [(p1, [probe])]
  slope = (need_bytes(probe) - need_bytes(worst)) / (p1 - p0)
  lines = [(need_bytes(r), slope) for r in base]  # need = a + slope * (pages - p0)
  pages = _pool_within(lines, p0, budget, ceiling)
  for _ in range(_MAX_CONFIRMS):
    reports = run(pages)
    tries.append((pages, reports))
    if _fits(reports, budget) or pages <= p0:
      break
    if _compiled(reports):  # Each program's own line, through both of its compiles.
      lines = [(need_bytes(a), (need_bytes(b) - need_bytes(a)) / (pages - p0))
               for a, b in zip(base, reports)]
      pages = min(pages - 1, _pool_within(lines, p0, budget, ceiling))
    else:  # Out of memory after all: halfway back to the probe that compiled.
      pages = (p0 + pages) // 2
  return tries


def _pool_within(lines, p0: int, budget: int, ceiling: int) -> int:
  """The most pages that keep every need a + s * (pages - p0) within `budget`."""
  return max(2, min([ceiling] + [p0 + int((budget - a) // s) for a, s in lines if s > 0]))


def _compiled(reports) -> bool:
  return all(r["compiled"] for r in reports)


def _fits(reports, budget: int) -> bool:
  return _compiled(reports) and max(need_bytes(r) for r in reports) <= budget


def _with_pages(config: EngineConfig, pages: int) -> EngineConfig:
  return dataclasses.replace(config, num_pages=pages, compilation_cache_dir=None)


def format_table(result: dict[str, Any]) -> str:
  """The result of `compile_engine` as a table, one program a row, sizes in MiB."""
  mib = lambda n: "-" if n is None else f"{n / 2**20:,.1f}"
  rows = [f"{'program':<20} {'compiled':>8} {'argument':>10} {'temp':>10} {'output':>10} "
          f"{'alias':>10}  (MiB)"]
  for r in result["programs"]:
    rows.append(f"{r['name']:<20} {'yes' if r['compiled'] else 'NO':>8} "
                f"{mib(r['argument_bytes']):>10} {mib(r['temp_bytes']):>10} "
                f"{mib(r['output_bytes']):>10} {mib(r['alias_bytes']):>10}")
    if r["error"]:
      rows.append(f"  error: {r['error'][:300]}")
  pool = result["kv_pool"]
  window = f" + {pool['window_pages']} window pages" if pool.get("window_pages") else ""
  rows.append(f"KV pool: {pool['pages']} pages{window} of {pool['page_size']} tokens "
              f"({pool['tokens']} tokens), {mib(pool['bytes'])} MiB; "
              f"pools compiled: {result['tries']}")
  worst = max((need_bytes(r) for r in result["programs"] if r["compiled"]), default=0)
  rows.append(f"{result['target']}: largest need {mib(worst)} MiB of "
              f"{mib(result['usable_bytes'])} MiB x {result['memory_fraction']}: "
              f"{'fits' if result['fits'] else 'DOES NOT FIT'}")
  return "\n".join(rows)


def run_compile(args) -> int:
  """`jaxserve plan --compile TARGET`: prints the table (or JSON); 1 when the pool does not fit."""
  jax.config.update("jax_platforms", "cpu")  # Before anything starts a backend: see targets.py.
  model = capacity.load_model_config(args.model)
  config = EngineConfig(num_slots=args.slots, page_size=args.page_size, num_pages=args.num_pages,
                        memory_fraction=args.memory_fraction, max_model_len=args.max_model_len,
                        dtype=args.dtype,
                        prefill_buckets=tuple(int(b) for b in args.buckets.split(",")),
                        tp=args.tp, compilation_cache_dir=None, window_pages=args.window_pages)
  result = compile_engine(args.compile, model, config)
  print(json.dumps(result, indent=1) if args.json else format_table(result))
  return 0 if result["fits"] else 1

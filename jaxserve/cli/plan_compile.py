"""`jaxserve plan --compile TARGET`: the engine's programs compiled for a chip
(compiling/compile_plan.py), printed as a table of their memory, or as JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

import jax

from jaxserve.cli import flags
from jaxserve.compiling import compile_plan
from jaxserve.planning import capacity


def format_table(result: dict[str, Any]) -> str:
  """The result of `compile_engine` as a table, one program a row, sizes in MiB (host: the
  bytes a program reads from or writes to host memory)."""
  mib = lambda n: "-" if n is None else f"{n / 2**20:,.1f}"
  rows = [f"{'program':<28} {'compiled':>8} {'argument':>10} {'temp':>10} {'output':>10} "
          f"{'alias':>10} {'host':>10}  (MiB) {'lower':>6} {'compile':>8}"]
  for r in result["programs"]:
    host = r["host_argument_bytes"]
    host = None if host is None else host + r["host_output_bytes"]
    sizes = [mib(r[k]) for k in ("argument_bytes", "temp_bytes", "output_bytes", "alias_bytes")]
    sizes.append(mib(host))
    rows.append(f"{r['name']:<28} {'yes' if r['compiled'] else 'NO':>8} "
                + " ".join(f"{x:>10}" for x in sizes)
                + f"  {r['lower_seconds']:>11.1f}s {r['seconds']:>7.1f}s")
    if r["error"]:
      rows.append(f"  error: {r['error'][:300]}")
  pool = result["kv_pool"]
  window = f" + {pool['window_pages']} window pages" if pool.get("window_pages") else ""
  host = f"; host tier: {pool['host_pages']} pages" if pool.get("host_pages") else ""
  rows.append(f"KV pool: {pool['pages']} pages{window} of {pool['page_size']} tokens "
              f"({pool['tokens']} tokens), {mib(pool['bytes'])} MiB{host}; "
              f"pools compiled: {result['tries']}")
  worst = max((compile_plan.need_bytes(r) for r in result["programs"] if r["compiled"]), default=0)
  rows.append(f"{result['target']}: largest need {mib(worst)} MiB of "
              f"{mib(result['usable_bytes'])} MiB x {result['memory_fraction']}: "
              f"{'fits' if result['fits'] else 'DOES NOT FIT'}")
  return "\n".join(rows)


def run_compile(args) -> int:
  """`jaxserve plan --compile TARGET`: prints the table (or JSON); 1 when the pool does not fit."""
  jax.config.update("jax_platforms", "cpu")  # Before anything starts a backend: see targets.py.
  model = capacity.load_model_config(args.model)
  config = flags.compile_config(args)
  try:
    result = compile_plan.compile_engine(args.compile, model, config)
  except ValueError as e:  # The pool cannot fit (weights beyond the memory): say so, no trace.
    print(f"jaxserve plan --compile: {e}", file=sys.stderr)
    return 1
  print(json.dumps(result, indent=1) if args.json else format_table(result))
  return 0 if result["fits"] else 1

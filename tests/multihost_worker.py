"""One process of a multi-host `serve`, in a fresh process; prints one JSON line.

Process 0 (or a lone process) runs a Runner over its engine (wrapped in `LeaderEngine` when
there are several processes) on the prompts, then stops the followers; any other process runs
`multihost.follow`. Argument: a JSON object (see `main`; `_setup` reads devices, coordinator,
num_processes and process_id).
"""

from __future__ import annotations

import json
import sys
import time

from sharding_worker import _model, _setup


def _engine(args: dict):
  from jaxserve.config import EngineConfig
  from jaxserve.engine.engine import Engine

  tp, dp = args["layout"]
  # Two prefill buckets and two decode widths (8 and 16 pages of 4 tokens), all compiled by warmup.
  settings = dict(num_slots=4, page_size=4, num_pages=128, max_model_len=64,
                  prefill_buckets=(16, 32), tp=tp, dp=dp)
  settings.update(args.get("engine", {}))  # This process's own flags.
  engine = Engine(_model(args, tp, dp), EngineConfig(**settings))
  if args.get("warmup", True):
    engine.warmup()
  return engine


def _serve(engine, args: dict) -> dict:
  from jaxserve.batching.runner import Runner
  from jaxserve.config import SamplingParams, SchedulerConfig
  from jaxserve.engine import multihost
  from support.mock_engine import MockTokenizer

  leader = multihost.LeaderEngine(engine) if "coordinator" in args else None
  # A prefill budget of 24 tokens splits the longest prompt into chunks of two buckets.
  runner = Runner(leader or engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=24))
  prompts = [(ids, SamplingParams(temperature=0, max_tokens=n, repetition_penalty=penalty))
             for ids, n, penalty in args["requests"]]
  completions = runner.generate(prompts)
  out = {"tokens": [list(c.token_ids) for c in completions]}
  if leader is not None:
    leader.stop()
    out["num_calls"] = leader.num_calls
  return out


def _num_compiled(engine) -> list[int]:
  """Compiled versions of the jitted step (one per StepShape)."""
  from jaxserve.batching.plan import StepKind

  steps = (engine._steps[StepKind.PLAIN],)
  jitted = lambda f: f if hasattr(f, "_cache_size") else f.__wrapped__  # in_mesh wraps the jit.
  return [jitted(f)._cache_size() for f in steps]


def main() -> None:
  args = json.loads(sys.argv[1])
  _setup(args)
  import jax

  from jaxserve.engine import multihost

  start = time.perf_counter()
  seed = multihost.shared_seed() if "coordinator" in args else None
  engine = _engine(args)
  warm = _num_compiled(engine)
  if jax.process_index() == 0:
    out = _serve(engine, args)
  else:
    out = {"num_calls": multihost.follow(engine)}
  out.update(process=jax.process_index(), num_devices=jax.device_count(), seed=seed,
             compiled=[warm, _num_compiled(engine)],
             seconds=time.perf_counter() - start)
  print(json.dumps(out), flush=True)
  if "coordinator" in args:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()

"""Decode steps of a Llama-3.2-1B-shaped model (random weights, bfloat16) on the accelerator, and
each step's fraction of the chip's memory bandwidth: the bytes a step must read (every weight
once, plus each slot's K/V so far) over its time, over the chip's peak.

  python scripts/bench_device_decode.py --weights bfloat16 --kv-dtype bfloat16
  python scripts/bench_device_decode.py --weights int8      # needs EngineConfig.quantization
  python scripts/bench_device_decode.py --kv-dtype int8

Prints one JSON object; {"skipped": why} when --weights int8 has no quantized-weight support in
this tree. Used by scripts/device_check.sh; each mode in its own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.batching.plan import PrefillChunk, StepPlan
from jaxserve.config import EngineConfig, KVDtype, ModelConfig, SamplingParams
from jaxserve.engine.engine import Engine
from jaxserve.model.families import model_class
from jaxserve.planning import capacity

# meta-llama/Llama-3.2-1B's config.json: 16 layers, 32 heads, 8 KV heads of 64, tied embeddings.
LLAMA_3_2_1B = ModelConfig(vocab_size=128256, dim=2048, num_layers=16, num_heads=32,
                           num_kv_heads=8, head_dim=64, hidden_dim=8192, rope_theta=500000.0,
                           max_seq_len=131072, tie_embeddings=True, name="llama-3.2-1b-shaped")
# Peak memory bandwidth, bytes/s, by a substring of jax's device_kind (vendor datasheets).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.039e12, "L40S": 0.864e12,
                  "L4": 0.3e12, "A10": 0.6e12, "4090": 1.008e12}
CHUNK = 512  # Prefill chunk (the one prefill bucket).
GREEDY = SamplingParams(temperature=0)


def random_model(cfg: ModelConfig, weights: str):
  """The model in bfloat16, its weights random; int8: quantized per output channel (the
  quantized-weight work: loading/quantize.py), None where this tree has none."""
  model = model_class(cfg)(cfg, jnp.bfloat16, rngs=nnx.Rngs(0))
  if weights == "bfloat16":
    return model
  try:
    from jaxserve.loading import checkpoint, quantize
  except ImportError:
    return None
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), nnx.to_pure_dict(nnx.state(model)))
  return checkpoint.build_model(cfg, quantize.to_int8(params), "bfloat16")


def engine_for(model, weights: str, kv_dtype: KVDtype, slots: int, context: int, steps: int):
  page_size = capacity.default_page_size(kv_dtype)
  max_len = -(-(context + steps + 1) // page_size) * page_size
  extra = {"quantization": weights} if weights != "bfloat16" else {}
  config = EngineConfig(num_slots=slots, page_size=page_size,
                        num_pages=slots * max_len // page_size + 1, max_model_len=max_len,
                        prefill_buckets=(CHUNK,), dtype="bfloat16", kv_dtype=kv_dtype,
                        compilation_cache_dir=None, **extra)
  return Engine(model, config), max_len // page_size


def fill(engine, slots: int, context: int, width: int) -> np.ndarray:
  """Prefills every slot with `context` random tokens; returns the [slots, width] tables."""
  tables = (1 + np.arange(slots * width, dtype=np.int32)).reshape(slots, width)
  rng = np.random.default_rng(0)
  for s in range(slots):
    ids = [int(i) for i in rng.integers(10, 1000, context)]
    for start in range(0, context, CHUNK):
      last = start + CHUNK >= context
      chunk = PrefillChunk(f"r{s}", s, ids[start:start + CHUNK], start, tables[s], last, GREEDY,
                           0, ids if last else (), ())
      future = engine.step(StepPlan(prefills=(chunk,)))
    future.result()
  return tables


def bench(model, args, slots: int) -> dict:
  engine, width = engine_for(model, args.weights, KVDtype[args.kv_dtype.upper()], slots,
                             args.context, args.steps + 2)
  tables = fill(engine, slots, args.context, width)
  plan = StepPlan(decode_slots=tuple(range(slots)), page_tables=tables)
  engine.step(plan).result()  # Compiles (warm-up compiled it already; this one is the check).
  times = []
  for _ in range(args.steps):
    t = time.perf_counter()
    engine.step(plan).result()
    times.append(time.perf_counter() - t)
  step = statistics.median(times)
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
  kv = capacity.kv_bytes_per_token(model.cfg, KVDtype[args.kv_dtype.upper()], 1)
  kv_bytes = slots * (args.context + args.steps // 2) * kv
  return {"slots": slots, "step_ms": 1e3 * step, "weight_bytes": weight_bytes,
          "kv_bytes": kv_bytes, "bandwidth_fraction": (weight_bytes + kv_bytes) / step / args.peak}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--weights", choices=("bfloat16", "int8"), default="bfloat16")
  parser.add_argument("--kv-dtype", choices=("bfloat16", "int8", "float8_e4m3", "float8_e5m2"),
                      default="bfloat16")
  parser.add_argument("--slots", default="1,16,64")
  parser.add_argument("--context", type=int, default=1024, help="tokens cached per slot")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--bandwidth-gbs", type=float, default=None, help="peak, GB/s")
  parser.add_argument("--layers", type=int, default=LLAMA_3_2_1B.num_layers,
                      help="fewer for a dry run")
  args = parser.parse_args()
  fields = {f.name for f in dataclasses.fields(EngineConfig)}
  if args.weights == "int8" and "quantization" not in fields:
    print(json.dumps({"skipped": "no EngineConfig.quantization in this tree (quantized weights "
                                 "not merged)", "weights": args.weights}))
    return
  kind = jax.devices()[0].device_kind
  peak = next((bw for name, bw in PEAK_BANDWIDTH.items() if name in kind), None)
  args.peak = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else peak
  if args.peak is None:
    sys.exit(f"unknown peak bandwidth of {kind!r}: give --bandwidth-gbs")
  model = random_model(dataclasses.replace(LLAMA_3_2_1B, num_layers=args.layers), args.weights)
  if model is None:
    print(json.dumps({"skipped": "no loading/quantize.py in this tree"}))
    return
  rows = [bench(model, args, int(s)) for s in args.slots.split(",")]
  print(json.dumps({"device": kind, "peak_bytes_per_s": args.peak, "weights": args.weights,
                    "kv_dtype": args.kv_dtype, "context": args.context, "steps": rows}))


if __name__ == "__main__":
  main()

"""`python -m scripts.bench device`: decode steps and one prefill of a Llama-shaped model with
random weights on an accelerator, against ceilings measured in the same process: the chip's copy
bandwidth (an XLA elementwise pass, bytes read + written) and its bfloat16 matmul rate.

A decode step must read every weight once (the embedding's B rows aside: untied, only the head
is read whole) plus each slot's K and V so far; its floor is max(bytes / copy rate, FLOPs /
matmul rate). Each slot starts every step at the run's context (the engine reads positions from
device state), so no prefill fills the cache: its values change no step time. One engine serves
every run of a mode: its pool holds the largest run, and each step shape is compiled by its
first, untimed call; the timed steps must compile nothing (counted, engine/compiles).
"""

from __future__ import annotations

import dataclasses
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.batching.plan import PrefillChunk, StepPlan
from jaxserve.config import EngineConfig, KVDtype, ModelConfig, SamplingParams
from jaxserve.engine import compiles
from jaxserve.engine.engine import Engine
from jaxserve.loading import checkpoint
from jaxserve.model import quant
from jaxserve.model.families import model_class
from jaxserve.planning import capacity

from . import harness
from .decode import at_position, prefill_flops, step_flops

# meta-llama/Llama-3.2-1B's and Llama-3.1-8B's config.json (RoPE scaling left out: no time).
SHAPES = {
    "llama-3.2-1b": ModelConfig(vocab_size=128256, dim=2048, num_layers=16, num_heads=32,
                                num_kv_heads=8, head_dim=64, hidden_dim=8192,
                                rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True,
                                name="llama-3.2-1b-shaped"),
    "llama-3.1-8b": ModelConfig(vocab_size=128256, dim=4096, num_layers=32, num_heads=32,
                                num_kv_heads=8, head_dim=128, hidden_dim=14336,
                                rope_theta=500000.0, max_seq_len=131072, tie_embeddings=False,
                                name="llama-3.1-8b-shaped"),
}
GREEDY = SamplingParams(temperature=0)


def copy_rate(num_bytes: int = 2 << 30, repeats: int = 10) -> float:
  """Bytes/s (read + written) of the best of `repeats` elementwise passes over a bf16 array."""
  x = jnp.ones(num_bytes // 2, jnp.bfloat16)
  add = jax.jit(lambda a: a + 1)  # An op, so XLA cannot alias the buffer away.
  return 2 * num_bytes / min(harness.timed(lambda: add(x).block_until_ready(), repeats))


def matmul_rate(n: int = 8192, repeats: int = 10) -> float:
  """FLOP/s of the best of `repeats` n x n x n bfloat16 products on random data."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  mm = jax.jit(lambda x: x @ x)
  return 2 * n ** 3 / min(harness.timed(lambda: mm(a).block_until_ready(), repeats))


def random_int8_params(cfg: ModelConfig) -> dict:
  """The numpy parameters of `--quantization int8` (quant.Layout(None): a float32 scale per
  output channel), values random bytes, built without a float copy of any matrix."""
  abstract = nnx.eval_shape(lambda: model_class(cfg)(cfg, jnp.float32, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(nnx.state(abstract))
  rng = np.random.default_rng(0)
  for name, in_axes in quant.IN_AXES.items():
    holder, lead = (params["layers"], 1) if name in quant.STACKED else (params, 0)
    if name in holder:
      shape = holder[name].shape
      values = np.frombuffer(rng.bytes(int(np.prod(shape))), np.int8).reshape(shape)
      scale_shape = quant.Layout(None).scale_shape(shape, tuple(a + lead for a in in_axes))
      holder[name] = {"values": values, "scale": np.full(scale_shape, 0.02 / 127, np.float32)}
  return jax.tree.map(lambda s: np.ones(s.shape, np.float32) if hasattr(s, "shape") else s,
                      params)


def random_model(cfg: ModelConfig, weights: str):
  if weights == "bfloat16":
    return model_class(cfg)(cfg, jnp.bfloat16, rngs=nnx.Rngs(0))
  return checkpoint.build_model(cfg, random_int8_params(cfg), "bfloat16")


def engine_for(model, args) -> Engine:
  """One engine for every run: slots for the largest, a pool for the most pages any run takes."""
  page = capacity.default_page_size(args.kv)
  max_len = -(-max([c + 1 for _, c in args.runs] + [args.prefill]) // page) * page
  pages = max([s * -(-(c + 1) // page) for s, c in args.runs] + [max_len // page])
  config = EngineConfig(num_slots=max(s for s, _ in args.runs), page_size=page,
                        num_pages=pages + 1, max_model_len=max_len, prefill_buckets=(args.prefill,),
                        dtype="bfloat16", kv_dtype=args.kv, compilation_cache_dir=None,
                        window_pages=False, quantization=args.weights.replace("bfloat16", "none"))
  return Engine(model, config)


def read_bytes(model, kv: KVDtype, slots: int, context: int) -> int:
  weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
  if not model.cfg.tie_embeddings:  # The embedding's lookup reads only the slots' rows.
    weights -= sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.embed)))
  return weights + slots * context * capacity.kv_bytes_per_token(model.cfg, kv, 1)


def decode_run(engine, model, args, slots: int, context: int) -> dict:
  page = engine.config.page_size
  per = -(-(context + 1) // page)
  tables = (1 + np.arange(slots * per, dtype=np.int32)).reshape(slots, per)
  plan = StepPlan(decode_slots=tuple(range(slots)), page_tables=tables)

  def reset():
    engine.state = at_position(engine.state, context)
    jax.block_until_ready(engine.state)
  reset()
  engine.step(plan).result()  # Compiles this shape: untimed.
  before = compiles.num_compiles()
  step_s = statistics.median(harness.timed(lambda: engine.step(plan).result(), args.steps,
                                           warmup=False, setup=reset))
  nbytes, flops = read_bytes(model, args.kv, slots, context), step_flops(model, slots, context)
  floor_s = max(nbytes / args.copy_rate, flops / args.matmul_rate)
  return {"slots": slots, "context": context, "step_ms": 1e3 * step_s, "bytes": nbytes,
          "flops": flops, "copy_fraction": nbytes / step_s / args.copy_rate,
          "floor_ms": 1e3 * floor_s, "x_floor": step_s / floor_s,
          "compiles_in_timed_steps": compiles.num_compiles() - before}


def prefill_run(engine, model, args) -> dict:
  n = args.prefill
  tables = list(range(1, -(-n // engine.config.page_size) + 1))
  ids = [int(i) for i in np.random.default_rng(0).integers(10, 1000, n)]
  chunk = PrefillChunk("p", 0, ids, 0, tables, True, GREEDY, 0, ids, ())
  engine.step(StepPlan(prefills=(chunk,))).result()  # Compiles: untimed.
  best = min(harness.timed(lambda: engine.step(StepPlan(prefills=(chunk,))).result(), 3,
                           warmup=False))
  flops = prefill_flops(model.cfg, n)
  return {"tokens": n, "ms": 1e3 * best, "tokens_per_s": n / best, "flops": flops,
          "matmul_fraction": flops / best / args.matmul_rate}


def main_device(argv=None) -> None:
  """Decode steps of a Llama-shaped model (random weights) on the accelerator, and one prefill,
  against the copy bandwidth and bf16 matmul rate measured in the same process.

    python -m scripts.bench device --shape llama-3.1-8b --weights bfloat16 --kv-dtype bfloat16
    python -m scripts.bench device --shape llama-3.1-8b --weights int8 --kv-dtype int8

  --runs SLOTS:CONTEXT,...: the decode runs (every slot holding CONTEXT cached tokens).
  Prints a JSON line per run as it ends, then one JSON object of everything (scripts/device_check.sh
  keeps them)."""
  parser = harness.parser("device", main_device.__doc__)
  parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
  parser.add_argument("--weights", choices=("bfloat16", "int8"), default="bfloat16")
  parser.add_argument("--kv-dtype", choices=("bfloat16", "int8", "float8_e4m3", "float8_e5m2"),
                      default="bfloat16")
  parser.add_argument("--runs", default="1:1024,16:1024,64:1024")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--prefill", type=int, default=2048, help="prompt tokens, one chunk")
  parser.add_argument("--layers", type=int, default=None, help="fewer, for a dry run")
  parser.add_argument("--copy-gib", type=float, default=2.0, help="the copy ceiling's array")
  parser.add_argument("--matmul-n", type=int, default=8192, help="the matmul ceiling's side")
  args = parser.parse_args(argv)
  args.kv = KVDtype[args.kv_dtype.upper()]
  args.runs = [tuple(int(x) for x in r.split(":")) for r in args.runs.split(",")]
  args.copy_rate = copy_rate(int(args.copy_gib * 2**30))
  args.matmul_rate = matmul_rate(args.matmul_n)
  cfg = SHAPES[args.shape]
  cfg = dataclasses.replace(cfg, num_layers=args.layers or cfg.num_layers)
  model = random_model(cfg, args.weights)
  engine = engine_for(model, args)
  runs = []
  for slots, context in args.runs:  # Each run's line at once: a run cut short keeps the others.
    runs.append(decode_run(engine, model, args, slots, context))
    print(json.dumps({"run": runs[-1]}), flush=True)
  print(json.dumps({"device": jax.devices()[0].device_kind, "shape": cfg.name,
                    "layers": cfg.num_layers, "weights": args.weights, "kv_dtype": args.kv_dtype,
                    "copy_bytes_per_s": args.copy_rate, "matmul_flops_per_s": args.matmul_rate,
                    "runs": runs, "prefill": prefill_run(engine, model, args)}))


COMMANDS = {"device": main_device}

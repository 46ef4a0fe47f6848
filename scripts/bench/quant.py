"""`python -m scripts.bench quant`: --quantization none, gguf and int8, each in a fresh process:
decode step time and the 64-request workload; --kernel and --matmuls time the CPU kernels alone.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from . import harness

MODES = ("none", "gguf", "int8")


def _llm(mode: str, slots: int, layers: str = "scan"):
  from jaxserve.config import EngineConfig
  from jaxserve.llm import LLM

  cfg = EngineConfig(num_slots=slots, page_size=16, max_model_len=512,
                     num_pages=slots * 32 + 1, prefill_buckets=(64, 128, 256),
                     compilation_cache_dir=None, quantization=mode,
                     unroll_layers={"scan": False, "unrolled": True}[layers])
  return LLM(None, engine_config=cfg)


def _generate_s(llm, prompts, max_tokens: int) -> float:
  from jaxserve.config import SamplingParams

  params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
  t = time.perf_counter()
  llm.generate(prompts, params)
  return time.perf_counter() - t


def measure(mode: str, args) -> dict:
  out = {"mode": mode, "decode_ms": {}}
  for slots in args.slots_list:
    llm = _llm(mode, slots, args.layers)
    prompts = [[100 + i] * 8 for i in range(slots)]
    _generate_s(llm, prompts, 2)  # Compiles nothing new; warms the host path.
    short, long = (min(harness.timed(lambda: _generate_s(llm, prompts, n), 2, warmup=False))
                   for n in (args.steps, 2 * args.steps))
    out["decode_ms"][str(slots)] = 1e3 * (long - short) / args.steps
  if args.requests:
    from jaxserve.config import SamplingParams

    work = [json.loads(line) for line in harness.WORKLOAD.read_text().splitlines()]
    work = work[:args.requests]
    llm = _llm(mode, 64, args.layers)
    params = [SamplingParams(temperature=0, max_tokens=min(r["max_tokens"], args.max_tokens),
                             ignore_eos=True) for r in work]
    t = time.perf_counter()
    llm.generate([r["prompt_token_ids"] for r in work], params)
    out["workload_s"] = time.perf_counter() - t
  out["load_avg"] = os.getloadavg()[0]
  return out


def matmul_scan() -> None:
  """30 SmolLM2-shaped [M, 576] x [576, 1536] layers under one scan, weights float32, int8 per
  output channel, int8 + a float32 scale per 32 inputs, or int8 + float32 scale and minimum per
  32 (the gguf form): min of 7 runs, each form back to back in this one process."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  L, D, F, g = 30, 576, 1536, 32
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.integers(-8, 8, (L, D, F)).astype(np.int8))
  per_channel = jnp.asarray(rng.random((L, 1, F), np.float32))
  group = lambda: jnp.asarray(rng.random((L, D // g, 1, F), np.float32))
  weights = {
      "float32": (lambda h, w: h @ w, jnp.asarray(rng.standard_normal((L, D, F), np.float32))),
      "int8": (lambda h, w: h @ (w[0].astype(h.dtype) * w[1]), (q, per_channel)),
      "int8 per 32": (lambda h, w: h @ (w[0].reshape(D // g, g, F).astype(h.dtype) * w[1])
                      .reshape(D, F), (q, group())),
      "gguf": (lambda h, w: h @ (w[0].reshape(D // g, g, F).astype(h.dtype) * w[1] + w[2])
               .reshape(D, F), (q, group(), group())),
  }
  for m in (1, 16, 64):
    x, times = jnp.asarray(rng.standard_normal((m, D), np.float32)), {}
    for name, (dot, w) in weights.items():
      body = lambda h, wl, dot=dot: (jnp.tanh(dot(h, wl)[:, :D]), None)
      run = jax.jit(lambda x, w, body=body: jax.lax.scan(body, x, w)[0])
      times[name] = min(harness.timed(lambda: run(x, w).block_until_ready(), 7))
    print(f"M={m}: " + ", ".join(f"{k} {1e3 * v:.1f} ms ({v / times['float32']:.2f}x)"
                                 for k, v in times.items()), flush=True)


FORMS = ("as stored", "tiled")  # kernel_forms.tiled's order, or each row of [K, N] as it lies.
# A side of --kernel: a form, with float activations or (" int8") int8 ones.
SIDES = (*FORMS, *(f"{f} int8" for f in FORMS))


def kernel_scan(rows: list[int], side: str) -> dict:
  """kernels_cpu's matmuls alone at the default model's shapes: 30 layers of Q4_1 (packed) q/k/v,
  o, gate, up and down under one scan, their arrays `form` (random values of that type), then
  the Q8_0 tied head [49152, 576] (tiled: read as [576, 49152]'s tiles, as the engine does):
  the median of 200 runs at each M, the layers' bytes read a second, and this process's copy
  bandwidth (decode.copy_bandwidth) to hold them against. A side ending " int8": the matmuls
  with int8 activations (--cpu-activations int8)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import kernels_cpu
  from kernels_cpu.reference import packed, tiled

  from .decode import copy_bandwidth

  L, D, F, V, G = 30, 576, 1536, 49152, 32
  form, int8 = side.removesuffix(" int8"), side.endswith(" int8")
  rng = np.random.default_rng(0)
  as_form = tiled if form == "tiled" else (lambda a: a)

  def q4_1(K, N):
    values = packed(rng.integers(0, 16, (L, K, N), dtype=np.int8), 1)
    return tuple(jnp.asarray(as_form(a)) for a in (
        values, rng.random((L, K // G, N), np.float32) / 100,
        -rng.random((L, K // G, N), np.float32) / 100))

  layers = q4_1(D, D), q4_1(D, 192), q4_1(D, 192), q4_1(D, D), q4_1(D, F), q4_1(D, F), q4_1(F, D)
  q, k, v, o, gate, up, down = layers
  head = (rng.integers(-127, 128, (V, D), dtype=np.int8), rng.random((V, D // G), np.float32) / 100)
  if form == "tiled":  # The tied embedding as the engine stores it: the head's [D, V] in tiles.
    head = tuple(tiled(np.ascontiguousarray(a.T)).reshape(a.shape) for a in head)
  head = tuple(map(jnp.asarray, head))
  read_head = lambda h: (
      kernels_cpu.qmatmul(h, *(a.reshape(a.shape[1], -1) for a in head), tiled=True,
                          int8_activations=int8)
      if form == "tiled" else kernels_cpu.qmatmul(h, *head, nk=True, int8_activations=int8))

  def layer(h, i):
    mm = lambda x, w: kernels_cpu.qmatmul(x, *w, layer=i, tiled=form == "tiled",
                                          int8_activations=int8)
    h = h + mm(mm(h, q) + jnp.tile(mm(h, k) + mm(h, v), 3), o)
    return h + mm(mm(h, gate) * mm(h, up), down) / 1000, None

  scan = jax.jit(lambda h: jax.lax.scan(layer, h, jnp.arange(L))[0])
  step = jax.jit(lambda h: read_head(scan(h)))
  layer_bytes = sum(a.nbytes for w in layers for a in w)
  out = {"form": side, "copy_gb_s": copy_bandwidth() / 1e9, "layers_gb_s": {}, "step_ms": {}}
  for m in rows:
    x = jnp.asarray(rng.standard_normal((m, D), np.float32))
    t = float(np.median(harness.timed(lambda: scan(x).block_until_ready(), 200)))
    out["layers_gb_s"][m] = layer_bytes / t / 1e9
    out["step_ms"][m] = 1e3 * float(np.median(harness.timed(
        lambda: step(x).block_until_ready(), 200)))
  return out


def compare_forms(rows: list[int], rounds: int, sides=FORMS) -> None:
  """kernel_scan of each side in its own fresh process, interleaved over `rounds`: medians; then
  each side's step time at each M over its time at the first M, and over the first side's."""
  flags = ["--kernel", ",".join(map(str, rows)), "--kernel-form"]
  runs = harness.interleaved(sides, rounds, lambda f: harness.fresh("quant", [*flags, f]))
  print(f"{'M':>3} " + " ".join(f"{f + ' GB/s':>20} {'of copy':>8} {'step ms':>8}" for f in sides))
  step = {(f, m): np.median([r["step_ms"][m] for r in runs[f]]) for f in sides
          for m in map(str, rows)}
  for m in map(str, rows):
    cells = []
    for f in sides:
      gb = np.median([r["layers_gb_s"][m] for r in runs[f]])
      copy = np.median([r["copy_gb_s"] for r in runs[f]])
      cells.append(f"{gb:>20.1f} {gb / copy:>8.0%} {step[f, m]:>8.2f}")
    print(f"{m:>3} " + " ".join(cells), flush=True)
  first = str(rows[0])
  for f in sides:
    print(f"{f}: step at M over M={first}: " + ", ".join(
        f"M={m} {step[f, m] / step[f, first]:.2f}x" for m in map(str, rows)) + "; over "
        f"{sides[0]}'s: " + ", ".join(f"M={m} {step[f, m] / step[sides[0], m]:.2f}x"
                                      for m in map(str, rows)), flush=True)


def main_quant(argv=None) -> None:
  """Weight quantization on CPU: decode step time at 1, 16 and 64 slots and the 64-request
  workload, for --quantization none, gguf and int8 on the default model, each mode in its own
  fresh process; prints each mode's figures and its ratios to none.

    python -m scripts.bench quant [--slots-list 1,16,64] [--steps 32] [--requests 64]
        [--layers scan|unrolled]
    python -m scripts.bench quant --matmul   # the layer scan behind `auto`'s choice
    python -m scripts.bench quant --kernel 1,4,7 [--rounds 3]   # kernels_cpu's matmuls alone,
        M rows, the layers' arrays as stored and in tiles, each form in its own process
    python -m scripts.bench quant --kernel 1,7 --activations   # the same, tiled, with float
        and with int8 activations (--cpu-activations)

  A decode step's time is the difference of two runs through the offline API that differ only in
  output length (max_tokens `steps` and 2 * `steps`, ignore_eos, 8-token prompts), divided by
  `steps`: prefill, warm-up and host set-up cancel out. On a loaded machine only the ratios mean
  much: the load average is printed with them.
  """
  p = harness.parser("quant", main_quant.__doc__)
  p.add_argument("--mode", choices=MODES, default=None, help="(internal) measure one mode here")
  p.add_argument("--slots-list", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--max-tokens", type=int, default=128)
  p.add_argument("--matmul", action="store_true", help="only the layer scan, in this process")
  p.add_argument("--kernel", type=lambda s: [int(x) for x in s.split(",")], default=None,
                 metavar="M,...", help="only kernels_cpu's matmuls at these rows")
  p.add_argument("--kernel-form", choices=SIDES, default=None,
                 help="(internal, with --kernel) measure one form here")
  p.add_argument("--activations", action="store_true",
                 help="with --kernel: tiled arrays, float against int8 activations")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--layers", choices=("scan", "unrolled"), default="scan",
                 help="EngineConfig.unroll_layers False (the default) or True")
  args = p.parse_args(argv)
  if args.matmul:
    matmul_scan()
    return
  if args.kernel and args.kernel_form:
    print(json.dumps(kernel_scan(args.kernel, args.kernel_form)))
    return
  if args.kernel:
    compare_forms(args.kernel, args.rounds,
                  ("tiled", "tiled int8") if args.activations else FORMS)
    return
  if args.mode:
    print(json.dumps(measure(args.mode, args)))
    return
  results = {}
  for mode in MODES:
    results[mode] = harness.fresh("quant", [
        "--mode", mode, "--steps", str(args.steps),
        "--slots-list", ",".join(map(str, args.slots_list)), "--requests", str(args.requests),
        "--max-tokens", str(args.max_tokens), "--layers", args.layers],
        env={"JAX_PLATFORMS": "cpu"})
    print(json.dumps(results[mode]), flush=True)
  base = results["none"]
  for mode in ("gguf", "int8"):
    r = results[mode]
    ratios = {s: base["decode_ms"][s] / r["decode_ms"][s] for s in r["decode_ms"]}
    line = f"{mode}: decode speed-up over none " + ", ".join(
        f"{s} slots {x:.2f}x" for s, x in ratios.items())
    if "workload_s" in r:
      speedup = base["workload_s"] / r["workload_s"]
      line += f"; {args.requests}-request workload {speedup:.2f}x"
    print(line)


COMMANDS = {"quant": main_quant}

"""`python -m scripts.bench lora`: the 64-request workload with 0, 1 and 8 LoRA adapters (rank 16),
and one merged into the weights; --delta times the delta formulations alone.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

from . import harness

LORA_CONFIGS = ("base", "lora-0", "lora-1", "lora-8", "merged")
RANK, NUM_ADAPTERS = 16, 8
PEFT_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
              "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
              "w_down": "mlp.down_proj"}


def write_adapters(cfg, root: pathlib.Path) -> list[pathlib.Path]:
  """NUM_ADAPTERS random PEFT adapters for `cfg` (rank RANK, every target), under `root`."""
  import numpy as np
  from safetensors.numpy import save_file

  from jaxserve.config.lora import target_dims

  paths = []
  for k in range(NUM_ADAPTERS):
    rng = np.random.default_rng(k)
    tensors = {}
    for i in range(cfg.num_layers):
      for target, (I, O) in target_dims(cfg).items():
        key = f"base_model.model.model.layers.{i}.{PEFT_NAMES[target]}"
        tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((RANK, I)) / np.sqrt(I)).astype(
            np.float32)
        tensors[f"{key}.lora_B.weight"] = (0.02 * rng.standard_normal((O, RANK))).astype(
            np.float32)
    path = root / f"adapter-{k}"
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": RANK,
         "target_modules": [n.split(".")[1] for n in PEFT_NAMES.values()]}))
    paths.append(path)
  return paths


def merged(params: dict, adapter) -> dict:
  """The numpy weights (weights.to_params' layout) with `adapter`'s A B added in."""
  layers = dict(params["layers"])
  for target, (a, b) in adapter.weights.items():
    w = layers[target]
    layers[target] = (w.reshape(a.shape[0], a.shape[1], b.shape[2]) + a @ b).reshape(
        w.shape).astype(w.dtype)
  return {**params, "layers": layers}


def run_lora(name: str, slots: int, num_requests: int) -> dict:
  """One configuration's pass over the workload, in this process."""
  import dataclasses

  from jaxserve.batching.runner import Runner
  from jaxserve.config import EngineConfig, LoRARequest, SamplingParams
  from jaxserve.engine.engine import Engine
  from jaxserve.llm import lora_reader
  from jaxserve.loading import checkpoint

  cfg, params, tokenizer = checkpoint.read_source(checkpoint.resolve(None))
  config = EngineConfig(num_slots=slots, page_size=16, max_model_len=1024, num_pages=513,
                        prefill_buckets=(64, 128, 256))  # As `peers` runs jaxserve.
  lora_on = name.startswith("lora")
  if lora_on:
    config = dataclasses.replace(config, max_loras=NUM_ADAPTERS, max_lora_rank=RANK)
  with tempfile.TemporaryDirectory() as tmp:
    paths = write_adapters(cfg, pathlib.Path(tmp))
    read = lora_reader(cfg, config if lora_on else dataclasses.replace(config, max_lora_rank=RANK))
    if name == "merged":
      params = merged(params, read(paths[0]))
    engine = Engine(checkpoint.build_model(cfg, params), config, stop_ids=tokenizer.stop_ids)
    engine.warmup()
    runner = Runner(engine, tokenizer)
    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(paths)]
    if lora_on:
      for lora, path in zip(loras, paths):
        runner.add_lora(lora, read(path))
  work = [json.loads(line) for line in harness.WORKLOAD.read_text().splitlines() if line.strip()]
  work = work[:num_requests]
  per = {"base": None, "merged": None, "lora-0": None}
  use = lambda i: per.get(name, loras[0] if name == "lora-1" else loras[i % NUM_ADAPTERS])
  jobs = [(r["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                 ignore_eos=True), use(i))
          for i, r in enumerate(work)]
  steps = [0]
  step = engine.step
  engine.step = lambda *a, **k: (steps.__setitem__(0, steps[0] + 1), step(*a, **k))[1]
  start = time.perf_counter()
  done = runner.generate(jobs)
  wall = time.perf_counter() - start
  tokens = sum(len(c.token_ids) for c in done)
  return {"config": name, "wall_s": wall, "steps": steps[0], "step_ms": 1e3 * wall / steps[0],
          "tokens": tokens, "tokens_per_s": tokens / wall, "loadavg": os.getloadavg()[0]}


def lora_delta() -> int:
  """The delta x A B of SmolLM2's up projection (I 576, O 1536) for T tokens spread over 8
  adapters and the base, rank 16, three ways; median of 20 calls each, in this one process
  (the three are one program each: the comparison is within a process, not between engines)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxserve.model.lora import LoraRows, LoraWeights

  I, O, R, S = 576, 1536, RANK, NUM_ADAPTERS + 1
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal((S, I, R)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((S, R, O)), jnp.float32)

  def onehot(x, slots):
    layer = LoraWeights({"w": a}, {"w": b})  # One layer's slots: [Sl, ...].
    stacked = LoraWeights({"w": a[None]}, {"w": b[None]})
    return LoraRows.of(stacked, slots).at_layer(layer).delta("w", x)

  def gather(x, slots):
    return jnp.einsum("tr,tro->to", jnp.einsum("ti,tir->tr", x, a[slots]), b[slots])

  def ragged(x, slots):
    order = jnp.argsort(slots)
    sizes = jnp.bincount(slots, length=S).astype(jnp.int32)
    xa = jax.lax.ragged_dot(x[order], a, sizes)
    out = jax.lax.ragged_dot(xa, b, sizes)
    return jnp.zeros_like(out).at[order].set(out)

  print("| tokens | one-hot ms | gather ms | ragged_dot ms |")
  print("|---|---|---|---|")
  for T in (1, 16, 64, 512):
    x = jnp.asarray(rng.standard_normal((T, I)), jnp.float32)
    slots = jnp.asarray(np.arange(T) % S, jnp.int32)
    ref = onehot(x, slots)
    cells = []
    for fn in (onehot, gather, ragged):
      f = jax.jit(fn)
      assert np.allclose(f(x, slots), ref, rtol=1e-4, atol=1e-3), fn.__name__
      cells.append(statistics.median(harness.timed(lambda: f(x, slots).block_until_ready(), 20)))
    print(f"| {T} | " + " | ".join(f"{1e3 * c:.3f}" for c in cells) + " |")
  return 0


def main_lora(argv=None) -> int:
  """LoRA's cost (issue 37): the 64-request workload (scripts/workloads/peers_64.jsonl) on the
  default model, 16 slots, greedy, each configuration in its own fresh process, rounds
  interleaved:

    python -m scripts.bench lora --rounds 2
    python -m scripts.bench lora --requests 2 --configs base,lora-8   # proves it runs

  base     no LoRA (max_loras 0)
  lora-0   max_loras 8, rank 16, every request on the base model (slot 0's zeros)
  lora-1   every request under one adapter
  lora-8   the requests under 8 distinct adapters, round robin
  merged   adapter 1 merged into the weights (W + A B), no LoRA: what lora-1 computes, at the
           base model's cost

  Adapters are random, rank 16 on all seven projections, written as PEFT writes them. Reported:
  the workload's wall time, its engine steps and the mean step time, each against base's.
  """
  p = harness.parser("lora", main_lora.__doc__)
  p.add_argument("--delta", action="store_true",
                 help="instead: the delta of one projection alone, three ways (one-hot over the "
                 "slots, as model/lora.py; a gather of each token's A and B; jax.lax.ragged_dot "
                 "over the tokens sorted by slot), at 1 to 512 tokens")
  p.add_argument("--rounds", type=int, default=1)
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--configs", default=",".join(LORA_CONFIGS))
  p.add_argument("--requests", type=int, default=64, help="the workload's first N (smoke runs)")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # One configuration, here.
  args = p.parse_args(argv)
  if args.delta:
    return lora_delta()
  if args.child:
    print(json.dumps(run_lora(args.child, args.slots, args.requests)), flush=True)
    return 0
  flags = ["--slots", str(args.slots), "--requests", str(args.requests)]
  def one(name):
    run = harness.fresh("lora", ["--child", name, *flags])
    print(json.dumps(run), file=sys.stderr, flush=True)
    return run
  runs = harness.interleaved(args.configs.split(","), args.rounds, one, reverse_odd=True)
  pick = {name: harness.median_item(rs, lambda r: r["step_ms"]) for name, rs in runs.items()}
  base = pick.get("base")
  print(f"{args.rounds} rounds (the median round of each), {args.slots} slots, "
        f"{args.requests} requests")
  print("| config | wall s | steps | step ms | step vs base | tokens/s |")
  print("|---|---|---|---|---|---|")
  for name, r in pick.items():
    ratio = f"{r['step_ms'] / base['step_ms']:.2f}x" if base else "-"
    print(f"| {name} | {r['wall_s']:.1f} | {r['steps']} | {r['step_ms']:.1f} | {ratio} | "
          f"{r['tokens_per_s']:.0f} |")
  return 0


COMMANDS = {"lora": main_lora}

"""`python -m scripts.bench training`: what an RL loop pays the engine between its steps (issue
49): `update_weights`' seconds per GB of the engine's weights, float and int8, and the seconds
of `sleep(1)`, `sleep(2)` and `wake_up()` with the bytes they free (main_training's docstring)."""

from __future__ import annotations

import json
import statistics
import time

from . import harness

MODES = ("none", "int8")


def measure(model: str | None, mode: str, repeats: int) -> dict:
  """One mode's figures, in this process: the default model's engine with `mode` weights, a
  trainer's float32 weights (the checkpoint's, placed on the device as a trainer holds them)."""
  import jax
  import numpy as np

  from jaxserve.config import EngineConfig
  from jaxserve.llm import LLM
  from jaxserve.loading import checkpoint, quantize

  llm = LLM(model, engine_config=EngineConfig(quantization=mode), warmup=False)
  source = quantize.to_float(checkpoint.read_source(checkpoint.resolve(model))[1])
  source = jax.device_put(jax.tree.map(lambda x: np.asarray(x, np.float32), source))
  engine = llm.engine
  weights = lambda: engine.params[0] if engine.spec.draft else engine.params
  gb = sum(x.nbytes for x in jax.tree.leaves(weights())) / 1e9
  src_gb = sum(x.nbytes for x in jax.tree.leaves(source)) / 1e9

  def update():
    llm.update_weights(source)
    jax.block_until_ready(weights())
  update_s = harness.timed(update, repeats)
  out = {"mode": mode, "engine_gb": gb, "source_gb": src_gb,
         "update_s": statistics.median(update_s)}
  for level in (1, 2):
    sleeps, wakes = [], []
    for _ in range(repeats):
      start = time.perf_counter()
      freed = llm.sleep(level)
      sleeps.append(time.perf_counter() - start)
      start = time.perf_counter()
      llm.wake_up()
      jax.block_until_ready(weights())
      wakes.append(time.perf_counter() - start)
    out[f"sleep{level}"] = {"freed_gb": freed / 1e9, "sleep_s": statistics.median(sleeps),
                            "wake_s": statistics.median(wakes)}
  return out


def main_training(argv=None) -> None:
  """An update's and sleep mode's cost on the default model (or --model), each weight mode in
  its own fresh process, rounds interleaved, the median round kept:

    python -m scripts.bench training [--modes none,int8] [--repeats 5] [--rounds 3]

  update_weights takes the checkpoint's float32 weights as a trainer holds them (device arrays)
  and writes them in the engine's form (float32 as is; int8 quantized again with the loader's
  numbers): seconds per GB of the engine's weights. sleep(1) frees the KV cache, sleep(2) the
  weights too (a host copy kept); wake_up puts them back. Each figure is the median of
  `repeats` calls after one untimed update.
  """
  p = harness.parser("training", main_training.__doc__)
  p.add_argument("--model", default=None)
  p.add_argument("--mode", choices=MODES, default=None, help="(internal) measure one mode here")
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--rounds", type=int, default=3)
  args = p.parse_args(argv)
  if args.mode:
    print(json.dumps(measure(args.model, args.mode, args.repeats)))
    return
  model = ["--model", args.model] if args.model else []
  rounds = harness.interleaved(args.modes.split(","), args.rounds, lambda mode: harness.fresh(
      "training", ["--mode", mode, "--repeats", str(args.repeats), *model]))
  print(f"{'mode':>5} {'engine GB':>9} {'update s':>9} {'s/GB':>6} {'sleep1 s':>9} "
        f"{'wake1 s':>8} {'freed1 GB':>9} {'sleep2 s':>9} {'wake2 s':>8} {'freed2 GB':>9}")
  for mode, items in rounds.items():
    r = harness.median_item(items, key=lambda r: r["update_s"])
    s1, s2 = r["sleep1"], r["sleep2"]
    print(f"{mode:>5} {r['engine_gb']:>9.3f} {r['update_s']:>9.3f} "
          f"{r['update_s'] / r['engine_gb']:>6.2f} {s1['sleep_s']:>9.4f} {s1['wake_s']:>8.4f} "
          f"{s1['freed_gb']:>9.3f} {s2['sleep_s']:>9.4f} {s2['wake_s']:>8.4f} "
          f"{s2['freed_gb']:>9.3f}")
  print(json.dumps(rounds))


COMMANDS = {"training": main_training}

"""Runs greedy generation under several mesh layouts in a fresh process; prints one JSON line.

The sharding tests launch this script because fake CPU devices
(`--xla_force_host_platform_device_count`) must be set before jax is imported, while the rest of
the suite runs on one device. Arguments: a JSON object (see `main`).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _setup(args: dict) -> None:
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args['devices']}"
  if "coordinator" in args:
    import jax
    jax.distributed.initialize(coordinator_address=args["coordinator"],
                               num_processes=args["num_processes"],
                               process_id=args["process_id"], initialization_timeout=60)


def _model(args: dict, tp: int, dp: int, ep: int = 1):
  from jaxserve.config import ModelConfig, Quantization
  from jaxserve.engine import placement
  from jaxserve.loading import checkpoint, pull, quantize, weights

  mode = Quantization(args.get("quantization", "none"))
  if args["model"] == "default" and mode is Quantization.GGUF:  # The GGUF's own blocks.
    cfg, params, _, _ = checkpoint.read_quantized(pull.gguf_path(), mode, "cpu")
  elif args["model"] == "default":
    cfg, params, _ = checkpoint.read_source(checkpoint.resolve(None))
  elif "hf_dir" in args["model"]:  # A Hugging Face directory the test saved (tiny MoE models).
    cfg, params = weights.load_hf_dir(args["model"]["hf_dir"])
  else:
    cfg = ModelConfig(**args["model"])
    params = random_params(cfg, seed=0)
  if mode is Quantization.INT8:
    params = quantize.to_int8(params)
  if tp * dp * ep == 1:
    return checkpoint.build_model(cfg, params)
  return checkpoint.build_model(cfg, params, "float32", placement.make_mesh(tp, dp, ep=ep))


def random_params(cfg, seed: int) -> dict:
  """Numpy weights in the layout of `weights.to_params`. The embedding is small beside the
  layers' output, so greedy decoding does not just repeat its input token."""
  import numpy as np

  rng = np.random.default_rng(seed)
  L, D, N, K, H, F = (cfg.num_layers, cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.hidden_dim)
  w = lambda *shape, fan_in: (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
  norm = lambda *shape: (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
  layers = dict(attn_norm=norm(L, D), mlp_norm=norm(L, D), wq=w(L, D, N, H, fan_in=D),
                wk=w(L, D, K, H, fan_in=D), wv=w(L, D, K, H, fan_in=D),
                wo=w(L, N, H, D, fan_in=N * H),
                w_gate=w(L, D, F, fan_in=D), w_up=w(L, D, F, fan_in=D), w_down=w(L, F, D, fan_in=F))
  return dict(embed=0.1 * w(cfg.vocab_size, D, fan_in=1), final_norm=norm(D), layers=layers)


def _greedy(engine, prompts, steps: int) -> dict:
  """Each prompt prefilled into its own slot, then `steps` decode steps of all of them."""
  import numpy as np

  from jaxserve.batching.plan import PrefillChunk
  from jaxserve.config import SamplingParams
  from support.engine_calls import decode, prefill

  width = -(-(max(map(len, prompts)) + steps + 1) // engine.page_size)
  tables = np.arange(1, 1 + len(prompts) * width, dtype=np.int32).reshape(len(prompts), width)
  greedy = SamplingParams(temperature=0, logprobs=1)
  tokens, logprobs = [], []
  for slot, ids in enumerate(prompts):
    chunk = PrefillChunk(str(slot), slot, ids, 0, list(tables[slot]), True, greedy, 0, ids, ())
    tokens.append([int(prefill(engine, chunk).result()[0])])
  for _ in range(steps):
    future = decode(engine, range(len(prompts)), tables)
    out, lp = future.result(), future.logprobs()[0]
    for slot in range(len(prompts)):
      tokens[slot].append(int(out[slot]))
      logprobs.append(float(lp[slot]))
  return {"tokens": tokens, "logprobs": logprobs, "tables": tables.tolist()}


def _device0_param_bytes(params) -> int:
  import jax
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards
             if s.device == dev)


def _collectives(engine, tables) -> dict:
  import numpy as np

  from jaxserve.batching.plan import StepKind, StepPlan

  plan = StepPlan(decode_slots=tuple(range(engine.num_slots)),
                  page_tables=np.asarray(tables, np.int32))
  args, _ = engine.step_args(plan)
  hlo = engine._steps[StepKind.PLAIN].lower(engine.params, engine.cache, engine.state, args,
                           engine.stop_ids).compile().as_text()
  ops = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
  return {op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(") for op in ops}


def run_layout(args: dict, tp: int, dp: int, kv_layout: str = "paged_token_major",
               backend: str = "reference", ep: int = 1) -> dict:
  from jaxserve.config import AttentionBackend, EngineConfig, KVLayout
  from jaxserve.engine.engine import Engine

  # One decode width (max_model_len / page_size = 8 pages) and one prefill bucket: 2 compilations.
  # The persistent cache makes the HLO dump (a second compile of decode) a cache hit.
  config = EngineConfig(num_slots=args.get("slots", 4), page_size=8, num_pages=64, max_model_len=64,
                        prefill_buckets=(32,), compilation_cache_dir=args.get("cache_dir"), tp=tp,
                        dp=dp, ep=ep, kv_layout=KVLayout(kv_layout),
                        attention_backend=AttentionBackend(backend))
  engine = Engine(_model(args, tp, dp, ep), config)
  result = _greedy(engine, args["prompts"], args["steps"])
  result["param_bytes_device0"] = _device0_param_bytes(engine.params)
  result["cache_bytes_device0"] = _device0_param_bytes(engine.cache)
  if args.get("hlo"):
    result["collectives"] = _collectives(engine, result["tables"])
  return result


def run_lora(spec: dict) -> dict:
  """LoRA adapters under tensor parallelism: spec's jobs ([prompt, adapter name or None]) run
  together by a Runner on an engine of tp spec["tp"], two adapter slots, the adapters of
  spec["adapters"] ([name, id, PEFT folder]) added; their greedy tokens and logprobs."""
  from jaxserve.batching.runner import Runner
  from jaxserve.config import (
    AttentionBackend,
    EngineConfig,
    LoRARequest,
    SamplingParams,
    SchedulerConfig,
  )
  from jaxserve.engine import placement
  from jaxserve.engine.engine import Engine
  from jaxserve.loading import checkpoint, weights
  from jaxserve.loading.lora import load_adapter
  from support.mock_engine import MockTokenizer

  cfg, params = weights.load_hf_dir(spec["base"])
  tp = spec["tp"]
  config = EngineConfig(num_slots=4, page_size=4, num_pages=64, max_model_len=64,
                        prefill_buckets=(16,), compilation_cache_dir=None, tp=tp,
                        attention_backend=AttentionBackend.REFERENCE, max_loras=2)
  mesh = placement.make_mesh(tp, 1) if tp > 1 else None
  engine = Engine(checkpoint.build_model(cfg, params, "float32", mesh), config)
  engine.warmup()
  runner = Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=16))
  loras = {}
  for name, lora_id, path in spec["adapters"]:
    loras[name] = LoRARequest(name, lora_id, path)
    runner.add_lora(loras[name], load_adapter(path, cfg, config.max_lora_rank))
  greedy = SamplingParams(temperature=0, max_tokens=spec["steps"], logprobs=1)
  outs = runner.generate([(p, greedy, loras.get(name)) for p, name in spec["jobs"]])
  a = engine.loras.weights.a["wo"]  # Row-parallel: A split by its input rows.
  return {"tokens": [list(o.token_ids) for o in outs],
          "logprobs": [[lp.logprob for lp in o.logprobs] for o in outs],
          "wo_a_shard_rows": [s.data.shape[2] for s in a.addressable_shards],
          "num_evictions": runner.scheduler.loras.num_evictions}


def run_update(spec: dict) -> dict:
  """Engine.update_weights under tp spec["tp"] (float or spec["quantization"] int8): an engine of
  seed 0's weights takes seed 1's (numpy, twice: the second compiles nothing); the greedy
  logprobs after, the compiles of the second update and of the generation after it, the prefix
  tokens found before and after, whether the old arrays were donated; and a fresh engine's
  logprobs on seed 1's weights."""
  import jax

  from jaxserve.batching.runner import Runner
  from jaxserve.config import (
    AttentionBackend,
    EngineConfig,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
  )
  from jaxserve.engine import placement
  from jaxserve.engine.engine import Engine
  from jaxserve.loading import checkpoint, quantize
  from support.mock_engine import MockTokenizer
  from support.tiny import count_compiles

  cfg, tp = ModelConfig(**spec["model"]), spec["tp"]
  config = EngineConfig(num_slots=4, page_size=8, num_pages=64, max_model_len=64,
                        prefill_buckets=(16,), compilation_cache_dir=None, tp=tp,
                        attention_backend=AttentionBackend.REFERENCE)
  stored = quantize.to_int8 if spec.get("quantization") == "int8" else (lambda p: p)

  def runner(seed: int) -> Runner:
    model = checkpoint.build_model(cfg, stored(random_params(cfg, seed)), "float32",
                                   placement.make_mesh(tp, 1))
    engine = Engine(model, config)
    engine.warmup()
    return Runner(engine, MockTokenizer(), SchedulerConfig(max_num_batched_tokens=16))

  greedy = SamplingParams(temperature=0, max_tokens=4, logprobs=1, ignore_eos=True)
  logprobs = lambda r: [[lp.logprob for lp in c.logprobs]
                        for c in r.generate([(p, greedy) for p in spec["prompts"]])]
  updated = runner(0)
  logprobs(updated)  # Its pages cached, computed with seed 0's weights: found again.
  cached = updated.scheduler.pages.num_hit_tokens
  logprobs(updated)
  cached = updated.scheduler.pages.num_hit_tokens - cached
  updated.update_weights(random_params(cfg, 1))
  old = jax.tree.leaves(updated.engine.params)
  hits = updated.scheduler.pages.num_hit_tokens
  with count_compiles() as counts:
    updated.update_weights(random_params(cfg, 1))
    after = logprobs(updated)
  return {"logprobs": after, "fresh": logprobs(runner(1)), "compiles": counts,
          "hit_tokens": updated.scheduler.pages.num_hit_tokens - hits, "cached_tokens": cached,
          "donated": all(x.is_deleted() for x in old)}


def main() -> None:
  args = json.loads(sys.argv[1])
  _setup(args)
  import jax
  if "lora" in args:
    print(json.dumps(run_lora(args["lora"])), flush=True)
    return
  if "update" in args:
    print(json.dumps(run_update(args["update"])), flush=True)
    return
  out = {"process": jax.process_index(), "num_devices": jax.device_count(), "layouts": {}}
  # [tp, dp], [tp, dp, KVLayout value] or [tp, dp, KVLayout value, AttentionBackend value],
  # or [tp, dp, {"ep": n}] (named "tpxdp-epn")
  for tp, dp, *kv_layout in args["layouts"]:
    start = time.perf_counter()
    extra = kv_layout.pop() if kv_layout and isinstance(kv_layout[-1], dict) else {}
    name = "-".join([f"{tp}x{dp}", *kv_layout, *(f"{k}{v}" for k, v in extra.items())])
    out["layouts"][name] = run_layout(args, tp, dp, *kv_layout, **extra)
    out["layouts"][name]["seconds"] = time.perf_counter() - start
  print(json.dumps(out), flush=True)
  if "coordinator" in args:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()

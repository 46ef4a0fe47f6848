"""Every benchmark, one entry point, run from the repository's root:

  python -m scripts.bench COMMAND [flags]        # python -m scripts.bench COMMAND --help

  decode       decode step time against its bandwidth / FLOPs floor, prefill tokens/s, sample()
               alone, cold vs warm start-up; --compare models, each in a fresh process
  prefill      long prompts against short ones, as LLM() chunks them, against the FLOPs floor
  moe          a small mixture of experts' decode step beside a dense model of the same active size
  device       decode steps and a prefill of a Llama-3.2-1B- or 3.1-8B-shaped model on an
               accelerator, against its copy bandwidth and matmul rate measured in the same run
               (scripts/device_check.sh)
  quant        --quantization none, gguf and int8, each in a fresh process
  speculative  speculative decoding on vs off, each side in a fresh process, interleaved rounds
  step         this tree's engine against another source tree's (--old), each in a fresh process
  lora         the 64-request workload with 0, 1 and 8 LoRA adapters (rank 16), and one merged
  offload      a multi-turn chat whose prefixes need 4x the device KV pool, with and without the
               prefix cache's host tier (--kv-offload-gib), each in a fresh process
  peers        the 64-request workload on jaxserve, transformers and llama.cpp, side by side
  serving      load against a running `jaxserve serve` over gRPC: TTFT, TPOT, ITL, end-to-end
  structured   64 requests, half of them JSON-schema constrained, against none
  host         the Runner and Scheduler's host time per step at 64 busy slots, a zero-cost engine
  training     update_weights' seconds per GB (float, int8), sleep(1|2) and wake_up's seconds
  embed        embeddings/s of 64 inputs of 16-512 tokens, jaxserve beside transformers on the
               same weights, each in a fresh process
  images       the vision encoder's seconds per image, and an image chat's TTFT beside a text
               chat's of as many tokens (Gemma 3, Qwen2.5-VL), each side in a fresh process

All of them time things one way (scripts/bench/harness.py): each side of a comparison in a fresh
process, sides interleaved over rounds, the median kept, and the machine (CPU model, cores, jax
version, load average) as the first line of the output.
"""

from __future__ import annotations

import importlib
import sys

from . import harness

# Command -> the module of this package that holds it. A module is imported only when one of its
# commands runs: `serving` never imports jax, and `step` puts another tree's jaxserve first on
# sys.path before anything imports jaxserve.
MODULES = {"decode": "decode", "prefill": "decode", "moe": "moe", "device": "device",
           "quant": "quant", "speculative": "speculative", "step": "step", "lora": "lora",
           "offload": "offload", "embed": "embed", "images": "images",
           "peers": "peers",
           "serving": "serving", "structured": "serving", "host": "serving",
           "training": "training"}


def main(argv: list[str]) -> int:
  if not argv or argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0 if argv else 2
  command, flags = argv[0], argv[1:]
  if command not in MODULES:
    print(f"unknown command {command!r}; the commands:\n{__doc__}", file=sys.stderr)
    return 2
  if not {"-h", "--help"} & set(flags):
    print(harness.machine_line(), flush=True)
  module = importlib.import_module(f".{MODULES[command]}", __package__)
  return module.COMMANDS[command](flags) or 0

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

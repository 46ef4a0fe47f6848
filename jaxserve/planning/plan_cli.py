"""`jaxserve plan`: the capacity planner's plan (capacity.py) for a model, printed."""

from __future__ import annotations

import argparse
import sys

from jaxserve.config import Quantization
from jaxserve.planning.capacity import (
  DEFAULT_OVERHEAD_BYTES,
  DEFAULT_PREFILL_TOKENS,
  GIB,
  KV_DTYPES,
  WEIGHT_DTYPES,
  CapacityPlan,
  WeightDtype,
  default_page_size,
  load_model_config,
  pages_per_conversation,
  plan_capacity,
  window_pages,
)
from jaxserve.planning.capacity import format_bytes as _fmt
from jaxserve.planning.known_models import KNOWN_MODELS


def format_plan(p: CapacityPlan) -> str:
  m = p.model
  # A mixture of experts runs only its top-k experts a token: its active parameters.
  active = (f" ({m.num_active_params / 1e9:.2f}B active: {m.experts_per_token} of "
            f"{m.num_experts} experts a token)" if m.num_experts else "")
  lines = [
      f"model               {m.name}: {m.num_params / 1e9:.2f}B params{active}, "
      f"{m.num_layers} layers, {m.num_kv_heads} KV heads x {m.head_dim}",
      f"accelerator memory  {_fmt(p.memory_bytes)}",
      f"weights             {_fmt(p.weight_bytes)} ({p.weight_dtype.label}"
      + (f"; LoRA adapter slots {_fmt(p.adapter_bytes)})" if p.adapter_bytes else ")"),
      f"KV per token        {_fmt(p.kv_bytes_per_token)} ({p.kv_dtype.label})",
      f"KV per conversation {_fmt(p.kv_bytes_per_conversation)} ({p.context} tokens in "
      f"{pages_per_conversation(p.context, p.page_size)} pages of {p.page_size})",
      f"minimum reserve     {_fmt(p.min_reserve_bytes)} (activations of a prefill chunk + "
      "overhead)",
      f"conversations       {p.max_conversations} at {p.context} tokens",
      f"reserve left        {_fmt(p.reserve_bytes)} for activations and overhead",
      f"sleep frees         {_fmt(p.sleep_bytes(1))} at level 1 (the KV cache), "
      f"{_fmt(p.sleep_bytes(2))} at level 2 (the weights too)",
  ]
  if p.context > m.max_seq_len:
    lines.append(f"note: {p.context} tokens is beyond the model's trained context "
                 f"({m.max_seq_len})")
  if p.max_conversations == 0:
    need = p.weight_bytes + p.kv_bytes_per_conversation + p.min_reserve_bytes
    lines.append(f"no full-length conversation fits: weights + one conversation + minimum reserve "
                 f"= {_fmt(need)} > {_fmt(p.memory_bytes)}; use more memory, a shorter context, "
                 "smaller dtypes or a smaller --prefill-tokens / --overhead-gib")
  return "\n".join(lines)


def format_window_gain(today: CapacityPlan, windowed: CapacityPlan) -> str:
  """The lines that set the window-only plan (what the engine holds by default) beside `today`'s,
  every layer keeping every page (window_pages=False)."""
  m, z = windowed.model, windowed.page_size
  num_local = sum(m.local_layers)
  kept = min(window_pages(m, z), pages_per_conversation(windowed.context, z))
  gain = (f"{windowed.max_conversations / today.max_conversations:.2f}x"
          if today.max_conversations else "none fit without")
  return "\n".join([
      f"window-only pages   {num_local} of {m.num_layers} layers are local "
      f"({m.sliding_window}-token "
      f"window): each keeps {kept} pages, the {m.num_layers - num_local} global layers every page",
      f"  KV per conversation {_fmt(windowed.kv_bytes_per_conversation)} (every layer every page: "
      f"{_fmt(today.kv_bytes_per_conversation)})",
      f"  conversations       {windowed.max_conversations} at {windowed.context} tokens ({gain}); "
      "what the engine holds (window_pages=False: every page)",
  ])


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
  parser = subparsers.add_parser(
      "plan", help="how many full-length conversations fit on one accelerator",
      description="How many full-length conversations fit on one accelerator.")
  parser.add_argument("--model", default="smollm2-135m",
                      help=f"a known name ({', '.join(KNOWN_MODELS)}), a config.json, or a "
                      "checkpoint directory holding model_config.json")
  parser.add_argument("--memory-gib", type=float, default=80.0,
                      help="accelerator memory, GiB (default 80)")
  parser.add_argument("--context", type=int, default=None,
                      help="tokens per conversation (default: the model's max context)")
  parser.add_argument("--weight-dtype", choices=list(WEIGHT_DTYPES), default="bfloat16",
                      help="int8, int4, q4_1: GGUF Q8_0, Q4_0, Q4_1 pages of 32")
  parser.add_argument("--quantization", choices=[q.value for q in Quantization], default="none",
                      help="weights as the engine stores them: int8 (per output channel), gguf "
                      "(4-bit blocks unpacked to int8 + float32 scale and minimum per 32); none "
                      "and auto (a config has no blocks): --weight-dtype")
  parser.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="bfloat16",
                      help="int8 adds a 1-byte scale exponent per token and KV head")
  parser.add_argument("--page-size", type=int, default=None,
                      help="tokens per KV page (default 16; 32 for int8 and float8 KV)")
  parser.add_argument("--prefill-tokens", type=int, default=DEFAULT_PREFILL_TOKENS,
                      help="largest prefill chunk, for the activation estimate")
  parser.add_argument("--overhead-gib", type=float, default=DEFAULT_OVERHEAD_BYTES / GIB,
                      help="runtime overhead kept free beside the activations, GiB")
  parser.add_argument("--max-loras", type=int, default=0,
                      help="LoRA adapter slots on the device (serve --enable-lora --max-loras)")
  parser.add_argument("--max-lora-rank", type=int, default=16,
                      help="the rank every adapter slot is padded to")
  return parser


def stored_weight_dtype(mode: Quantization, weight_dtype: str) -> WeightDtype:
  """The bytes per weight the engine holds in `mode` (none, auto: the float `weight_dtype`)."""
  stored = {Quantization.INT8: WeightDtype.INT8_CHANNEL, Quantization.GGUF: WeightDtype.GGUF_STORED}
  return stored.get(mode, WEIGHT_DTYPES[weight_dtype])


def run_plan(args: argparse.Namespace) -> int:
  """Prints the plan; returns 1 when no full-length conversation fits (or the input is bad)."""
  try:
    cfg = load_model_config(args.model)
    spec = getattr(args, "speculative_config", None)
    draft = load_model_config(spec.draft_model) if spec and spec.method == "draft" else None
    plan = lambda window_only: plan_capacity(
        cfg, round(args.memory_gib * GIB), args.context or cfg.max_seq_len,
        weight_dtype=stored_weight_dtype(Quantization(args.quantization), args.weight_dtype),
        kv_dtype=KV_DTYPES[args.kv_dtype],
        page_size=args.page_size or default_page_size(KV_DTYPES[args.kv_dtype]),
        prefill_tokens=args.prefill_tokens,
        overhead_bytes=round(args.overhead_gib * GIB), window_only=window_only, draft=draft,
        max_loras=getattr(args, "max_loras", 0), max_lora_rank=getattr(args, "max_lora_rank", 16))
    today = plan(False)
  except ValueError as e:
    print(f"jaxserve plan: {e}", file=sys.stderr)
    return 1
  print(format_plan(today))
  if any(cfg.local_layers):
    print(format_window_gain(today, plan(True)))
  return 0 if today.max_conversations else 1

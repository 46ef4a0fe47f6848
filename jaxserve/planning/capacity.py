"""How many full-length conversations fit on one accelerator: the capacity planner.

Device memory holds the weights, the KV cache, and a reserve for everything else (activations
of the running step, XLA's programs and scratch, the runtime). The KV cache is allocated in
whole pages of `page_size` tokens, so

  conversations = floor((memory - weights - min_reserve) / kv_per_conversation)
  reserve       = memory - weights - conversations * kv_per_conversation  (>= min_reserve)

`min_reserve` is one prefill chunk's activations (`activation_bytes`) plus a fixed overhead.
The published worked example, a Llama-2-7B-class model at 8,192 tokens in 16-bit on 80 GiB:
  weights       6,738,415,616 params * 2 B                   = 12.55 GiB
  KV per token  2 (K, V) * 32 layers * 32 heads * 128 * 2 B  = 512 KiB
  conversation  8,192 tokens * 512 KiB                       =  4.00 GiB
  16 of them: 80 - 12.55 - 64 = 3.45 GiB left for activations and overhead; a 17th needs 4.

Window-only pages (Gemma 3, and any model with sliding-window layers): a local layer attends to
its last `sliding_window` positions only, so it need keep only the pages those can touch,
1 + ceil((window - 1) / page_size) (a window that straddles a page boundary spans one more page
than it fills), while a global layer keeps the whole context. Per conversation, in pages of
one layer:  global_layers * ceil(context / page_size) + local_layers * window_pages.
Gemma 3 270M at 32,768 tokens, pages of 16: 3 * 2,048 + 15 * 33 = 6,639 instead of
18 * 2,048 = 36,864 (5.6x less). The engine does this by default (EngineConfig.window_pages): its
local layers' pages are a pool of their own, num_slots * window_pages_per_seq(window, Z, chunk)
pages, enough for every slot's window plus the T - 1 more positions a prefill chunk of T tokens
briefly needs; the rest of the memory is the global layers' pool (`num_kv_pages`).
The engine sizes its page pool with the same arithmetic (`num_kv_pages`); `jaxserve plan`
prints a plan (`add_plan_parser`, `run_plan`).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import pathlib
import sys
import types

from jaxserve.config import KVDtype, ModelConfig, Quantization, readers
from jaxserve.config.engine import window_pages_per_seq
from jaxserve.planning.known_models import KNOWN_MODELS

GIB = 2**30


class WeightDtype(enum.Enum):
  """How the weights are stored: (label, bytes per weight as numerator / denominator).

  The quantized formats are GGUF's page formats: 32 weights share an f16 scale (and a min).
  Every parameter is counted in the format, norms included (they are < 0.01% of a model).
  """

  FLOAT32 = ("float32", 4, 1)
  BFLOAT16 = ("bfloat16", 2, 1)
  FLOAT16 = ("float16", 2, 1)
  INT8 = ("int8", 34, 32)  # Q8_0: 32 int8 + one f16 scale = 34 bytes per 32 weights.
  # What the engine stores (model/quant.py): int8 per output channel, a float32 scale per row of
  # at least 1,024 inputs on the models planned for (less than 1/256 more), and GGUF 4-bit blocks
  # unpacked to int8 values with a float32 scale and minimum per 32 (a Q6_K layer's 16: 48/32).
  INT8_CHANNEL = ("int8-channel", 257, 256)
  GGUF_STORED = ("gguf-stored", 40, 32)
  INT4 = ("int4", 18, 32)  # Q4_0: 32 nibbles + one f16 scale = 18 bytes per 32 weights.
  Q4_1 = ("q4_1", 20, 32)  # Q4_1: 32 nibbles + f16 scale + f16 min = 20 bytes per 32 weights.

  def __init__(self, label: str, numerator: int, denominator: int):
    self.label = label
    self.numerator = numerator
    self.denominator = denominator

  @property
  def activation_bytes(self) -> int:
    # Quantized weights are dequantized to bfloat16 for the matmuls; only float32 runs in float32.
    return 4 if self is WeightDtype.FLOAT32 else 2


# For the command line: label -> member, read-only.
WEIGHT_DTYPES = types.MappingProxyType({d.label: d for d in WeightDtype})
KV_DTYPES = types.MappingProxyType({d.label: d for d in KVDtype})

DEFAULT_PREFILL_TOKENS = 512  # SchedulerConfig.max_num_batched_tokens: the largest chunk.
DEFAULT_OVERHEAD_BYTES = GIB // 2  # Compiled programs, XLA scratch, the runtime's own buffers.


def weight_bytes(cfg: ModelConfig, dtype: WeightDtype) -> int:
  return -(-cfg.num_params * dtype.numerator // dtype.denominator)  # Integer ceil: exact.


def kv_bytes_per_token(cfg: ModelConfig, dtype: KVDtype, lane_groups: int = 0) -> int:
  """K and V of one token in every layer, int8's scale exponents included. lane_groups 0: the
  token-major layouts, exactly; g >= 1: the ragged kernels' layout (TPU/GPU), whose page row of
  a layer is g groups (tp) of 2 * K / g * H values (+ int8's 2 * K / g exponent lanes, in whole
  head-width groups), each rounded up to 128 lanes (kernels_pallas/ragged_layout.py)."""
  if not lane_groups:
    per_head = cfg.head_dim * dtype.value_bytes + dtype.scale_bytes
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head  # 2: K and V.
  heads, h = cfg.num_kv_heads // lane_groups, cfg.head_dim
  scale_lanes = h * -(-2 * heads * dtype.scale_bytes // h)  # One lane per 1-byte exponent.
  lanes = -(-(2 * heads * h + scale_lanes) // 128) * 128
  return cfg.num_layers * lane_groups * lanes * dtype.value_bytes


def default_page_size(kv_dtype: KVDtype | None) -> int:
  """Tokens per KV page when none is given: 16, or 32 for 1-byte KV (int8, float8), which TPUs
  tile by 32 rows (a smaller page would be padded to 32 in memory, and the kernel refuses it)."""
  return 32 if kv_dtype is not None and kv_dtype.value_bytes == 1 else 16


def pages_per_conversation(context: int, page_size: int) -> int:
  return -(-context // page_size)  # The last page is allocated whole, used or not.


def window_pages(cfg: ModelConfig, page_size: int) -> int:
  """Pages a local layer's window can touch at once: `sliding_window` consecutive positions
  start anywhere in a page, so they span up to one page more than they fill."""
  return window_pages_per_seq(cfg.sliding_window, page_size)


def layer_pages_per_conversation(cfg: ModelConfig, context: int, page_size: int,
                                 window_only: bool = False) -> int:
  """Pages, summed over the layers, one conversation of `context` tokens holds between its
  steps. `window_only` (the engine's default, EngineConfig.window_pages): local layers keep
  only their window's pages; otherwise every layer keeps the whole context."""
  full = pages_per_conversation(context, page_size)
  num_local = sum(cfg.local_layers) if window_only else 0
  local = min(full, window_pages(cfg, page_size)) if num_local else 0
  return (cfg.num_layers - num_local) * full + num_local * local


def kv_bytes_per_conversation(cfg: ModelConfig, context: int, page_size: int,
                              dtype: KVDtype, window_only: bool = False) -> int:
  per_layer_token = kv_bytes_per_token(cfg, dtype) // cfg.num_layers  # Exact: L is a factor.
  return (layer_pages_per_conversation(cfg, context, page_size, window_only) * page_size
          * per_layer_token)


def activation_bytes(cfg: ModelConfig, num_tokens: int, context: int, dtype: WeightDtype) -> int:
  """Peak activations of one prefill chunk of `num_tokens` attending to `context` positions.

  Layers run one after another, so one layer's tensors are live at a time, plus the logits.
  An upper bound: the scores are what the reference attention materializes (Pallas tiles them),
  and the logits are counted for every token of the chunk.
  """
  per_token = (2 * cfg.dim  # Residual and its normed copy.
               + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim  # Q, K, V.
               + cfg.num_heads * cfg.head_dim  # Attention output.
               + 3 * cfg.hidden_dim)  # Gate, up, and their product.
  layer = num_tokens * per_token * dtype.activation_bytes
  scores = cfg.num_heads * num_tokens * context * 4  # [N, T, S] float32 softmax.
  logits = num_tokens * cfg.vocab_size * 4  # [T, V] float32.
  return layer + scores + logits


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
  model: ModelConfig
  memory_bytes: int
  context: int
  page_size: int
  weight_dtype: WeightDtype
  kv_dtype: KVDtype
  weight_bytes: int
  kv_bytes_per_token: int
  kv_bytes_per_conversation: int
  min_reserve_bytes: int  # Must fit beside the weights and the conversations.
  max_conversations: int
  reserve_bytes: int  # What is left for activations and overhead with max_conversations.
  window_only: bool = False  # Local layers keep only their window's pages.


def plan_capacity(cfg: ModelConfig, memory_bytes: int, context: int, *,
                  weight_dtype: WeightDtype = WeightDtype.BFLOAT16,
                  kv_dtype: KVDtype = KVDtype.BFLOAT16, page_size: int = 16,
                  prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
                  overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
                  window_only: bool = False) -> CapacityPlan:
  if memory_bytes <= 0 or context <= 0 or page_size <= 0:
    raise ValueError(f"memory ({memory_bytes}), context ({context}) and page size "
                     f"({page_size}) must be positive")
  if prefill_tokens < 0 or overhead_bytes < 0:
    raise ValueError("prefill_tokens and overhead_bytes must be >= 0")
  weights = weight_bytes(cfg, weight_dtype)
  conversation = kv_bytes_per_conversation(cfg, context, page_size, kv_dtype, window_only)
  min_reserve = activation_bytes(cfg, min(prefill_tokens, context), context,
                                 weight_dtype) + overhead_bytes
  fits = max(0, (memory_bytes - weights - min_reserve) // conversation)
  return CapacityPlan(
      model=cfg, memory_bytes=memory_bytes, context=context, page_size=page_size,
      weight_dtype=weight_dtype, kv_dtype=kv_dtype, weight_bytes=weights,
      kv_bytes_per_token=kv_bytes_per_token(cfg, kv_dtype), kv_bytes_per_conversation=conversation,
      min_reserve_bytes=min_reserve, max_conversations=fits,
      reserve_bytes=memory_bytes - weights - fits * conversation, window_only=window_only)


def num_kv_pages(model_cfg: ModelConfig, memory_bytes: int, memory_fraction: float,
                 page_size: int, kv_dtype: KVDtype, weight_bytes: int,
                 num_window_pages: int = 0, lane_groups: int = 0) -> int:
  """Pages in the engine's KV pool (scratch page 0 included) on `memory_bytes` of device memory.

  The engine may use `memory_fraction` of the memory for weights and KV cache; the rest is the
  reserve for activations and overhead. `weight_bytes` is what the loaded parameters really take.
  `num_window_pages`: the local layers keep their KV in a window pool of that many pages
  (model/kv_cache.py), so the pool's pages hold the global layers' KV only. `lane_groups`: see
  kv_bytes_per_token (the ragged layout's lane groups, 0 for the token-major ones).
  """
  if not 0 < memory_fraction <= 1:
    raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
  per_layer = (page_size * kv_bytes_per_token(model_cfg, kv_dtype, lane_groups)
               // model_cfg.num_layers)
  num_local = sum(model_cfg.local_layers) if num_window_pages else 0
  page = per_layer * (model_cfg.num_layers - num_local)
  budget = (int(memory_bytes * memory_fraction) - weight_bytes
            - num_window_pages * num_local * per_layer)
  # Every layer local (Mistral): the full pool's pages hold no KV, they only number positions;
  # as many as one layer's pages would fill the memory left.
  pages = max(0, budget) // (page or per_layer)
  if pages < 2:
    raise ValueError(
        f"KV cache does not fit: {memory_fraction:.0%} of {_fmt(memory_bytes)} minus weights of "
        f"{_fmt(weight_bytes)} leaves {_fmt(budget)}, but the pool needs two pages of "
        f"{_fmt(page)} (one is the scratch page); raise the memory fraction or shrink the model")
  return pages


def load_model_config(spec: str) -> ModelConfig:
  """A known name, a config.json (Hugging Face or ours), or a checkpoint directory."""
  if spec.lower() in KNOWN_MODELS:
    return KNOWN_MODELS[spec.lower()]
  path = pathlib.Path(spec).expanduser()
  if path.is_dir():
    candidates = [path / "model_config.json", path / "config.json"]
    path = next((p for p in candidates if p.is_file()), candidates[0])
  if not path.is_file():
    raise ValueError(f"{spec!r} is neither a known model ({', '.join(KNOWN_MODELS)}) nor a "
                     "config.json or a checkpoint directory holding model_config.json")
  d = json.loads(path.read_text())
  # Hugging Face configs name the width `hidden_size` (a multimodal one under `text_config`);
  # ours (ModelConfig.to_dict) call it `dim`.
  if "hidden_size" in d or "text_config" in d:
    return readers.from_hf(d, name=path.parent.name or spec)
  return ModelConfig.from_dict(d)


def _fmt(num_bytes: int) -> str:
  for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(num_bytes) >= size:
      return f"{num_bytes / size:.2f} {unit}"
  return f"{num_bytes} B"


def format_plan(p: CapacityPlan) -> str:
  m = p.model
  # A mixture of experts runs only its top-k experts a token: its active parameters.
  active = (f" ({m.num_active_params / 1e9:.2f}B active: {m.experts_per_token} of "
            f"{m.num_experts} experts a token)" if m.num_experts else "")
  lines = [
      f"model               {m.name}: {m.num_params / 1e9:.2f}B params{active}, "
      f"{m.num_layers} layers, {m.num_kv_heads} KV heads x {m.head_dim}",
      f"accelerator memory  {_fmt(p.memory_bytes)}",
      f"weights             {_fmt(p.weight_bytes)} ({p.weight_dtype.label})",
      f"KV per token        {_fmt(p.kv_bytes_per_token)} ({p.kv_dtype.label})",
      f"KV per conversation {_fmt(p.kv_bytes_per_conversation)} ({p.context} tokens in "
      f"{pages_per_conversation(p.context, p.page_size)} pages of {p.page_size})",
      f"minimum reserve     {_fmt(p.min_reserve_bytes)} (activations of a prefill chunk + "
      "overhead)",
      f"conversations       {p.max_conversations} at {p.context} tokens",
      f"reserve left        {_fmt(p.reserve_bytes)} for activations and overhead",
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
  every layer keeping every page (EngineConfig.window_pages=False)."""
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
      description=__doc__.split("\n\n")[0])
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
  return parser


def stored_weight_dtype(mode: Quantization, weight_dtype: str) -> WeightDtype:
  """The bytes per weight the engine holds in `mode` (none, auto: the float `weight_dtype`)."""
  stored = {Quantization.INT8: WeightDtype.INT8_CHANNEL, Quantization.GGUF: WeightDtype.GGUF_STORED}
  return stored.get(mode, WEIGHT_DTYPES[weight_dtype])


def run_plan(args: argparse.Namespace) -> int:
  """Prints the plan; returns 1 when no full-length conversation fits (or the input is bad)."""
  try:
    cfg = load_model_config(args.model)
    plan = lambda window_only: plan_capacity(
        cfg, round(args.memory_gib * GIB), args.context or cfg.max_seq_len,
        weight_dtype=stored_weight_dtype(Quantization(args.quantization), args.weight_dtype),
        kv_dtype=KV_DTYPES[args.kv_dtype],
        page_size=args.page_size or default_page_size(KV_DTYPES[args.kv_dtype]),
        prefill_tokens=args.prefill_tokens,
        overhead_bytes=round(args.overhead_gib * GIB), window_only=window_only)
    today = plan(False)
  except ValueError as e:
    print(f"jaxserve plan: {e}", file=sys.stderr)
    return 1
  print(format_plan(today))
  if any(cfg.local_layers):
    print(format_window_gain(today, plan(True)))
  return 0 if today.max_conversations else 1

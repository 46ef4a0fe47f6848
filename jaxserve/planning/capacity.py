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
18 * 2,048 = 36,864 (5.6x less). The engine does this by default (its window_pages): its
local layers' pages are a pool of their own, num_slots * window_pages_per_seq(window, Z, chunk)
pages, enough for every slot's window plus the T - 1 more positions a prefill chunk of T tokens
briefly needs; the rest of the memory is the global layers' pool (`num_kv_pages`).
The engine sizes its page pool with the same arithmetic (`num_kv_pages`); `jaxserve plan`
prints a plan (plan_cli.py).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib
import types

from jaxserve.config import KVDtype, ModelConfig, readers
from jaxserve.config.engine import window_pages_per_seq
from jaxserve.config.lora import target_dims
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


def lora_bytes(cfg: ModelConfig, max_loras: int, rank: int, dtype_bytes: int) -> int:
  """The LoRA adapter slots' bytes (engine/adapters.py): A [I, R] and B [R, O] of every target
  in every layer, for max_loras slots and the base model's (zeros); 0 without LoRA."""
  if not max_loras:
    return 0
  per_layer = sum(i + o for i, o in target_dims(cfg).values()) * rank
  return cfg.num_layers * (max_loras + 1) * per_layer * dtype_bytes


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
  steps. `window_only` (the engine's default, the window_pages setting): local layers keep
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
  adapter_bytes: int = 0  # LoRA adapter slots, counted in weight_bytes.

  def sleep_bytes(self, level: int) -> int:
    """What the engine's sleep(level) frees (Engine.sleep): level 1 the KV cache (the
    conversations' pages), level 2 the model's and a draft's weights too; the adapter slots
    stay."""
    kv = self.max_conversations * self.kv_bytes_per_conversation
    return kv if level == 1 else kv + self.weight_bytes - self.adapter_bytes


def plan_capacity(cfg: ModelConfig, memory_bytes: int, context: int, *,
                  weight_dtype: WeightDtype = WeightDtype.BFLOAT16,
                  kv_dtype: KVDtype = KVDtype.BFLOAT16, page_size: int = 16,
                  prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
                  overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
                  window_only: bool = False, draft: ModelConfig | None = None,
                  max_loras: int = 0, max_lora_rank: int = 16) -> CapacityPlan:
  """`draft`: a speculative draft model beside `cfg`: its weights, and its KV of every token
  (engine/draft.py), count too; so do `max_loras` LoRA adapter slots of `max_lora_rank`, in the
  activations' dtype (`lora_bytes`)."""
  if memory_bytes <= 0 or context <= 0 or page_size <= 0:
    raise ValueError(f"memory ({memory_bytes}), context ({context}) and page size "
                     f"({page_size}) must be positive")
  if prefill_tokens < 0 or overhead_bytes < 0:
    raise ValueError("prefill_tokens and overhead_bytes must be >= 0")
  adapters = lora_bytes(cfg, max_loras, max_lora_rank, weight_dtype.activation_bytes)
  weights = weight_bytes(cfg, weight_dtype) + adapters
  conversation = kv_bytes_per_conversation(cfg, context, page_size, kv_dtype, window_only)
  per_token = kv_bytes_per_token(cfg, kv_dtype)
  if draft is not None:
    weights += weight_bytes(draft, weight_dtype)
    conversation += kv_bytes_per_conversation(draft, context, page_size, kv_dtype)
    per_token += kv_bytes_per_token(draft, kv_dtype)
  min_reserve = activation_bytes(cfg, min(prefill_tokens, context), context,
                                 weight_dtype) + overhead_bytes
  fits = max(0, (memory_bytes - weights - min_reserve) // conversation)
  return CapacityPlan(
      model=cfg, memory_bytes=memory_bytes, context=context, page_size=page_size,
      weight_dtype=weight_dtype, kv_dtype=kv_dtype, weight_bytes=weights,
      kv_bytes_per_token=per_token, kv_bytes_per_conversation=conversation,
      min_reserve_bytes=min_reserve, max_conversations=fits,
      reserve_bytes=memory_bytes - weights - fits * conversation, window_only=window_only,
      adapter_bytes=adapters)


def num_kv_pages(model_cfg: ModelConfig, memory_bytes: int, memory_fraction: float,
                 page_size: int, kv_dtype: KVDtype, weight_bytes: int,
                 num_window_pages: int = 0, lane_groups: int = 0,
                 draft: ModelConfig | None = None) -> int:
  """Pages in the engine's KV pool (scratch page 0 included) on `memory_bytes` of device memory.

  The engine may use `memory_fraction` of the memory for weights and KV cache; the rest is the
  reserve for activations and overhead. `weight_bytes` is what the loaded parameters really take.
  `num_window_pages`: the local layers keep their KV in a window pool of that many pages
  (model/kv_cache.py), so the pool's pages hold the global layers' KV only. `lane_groups`: see
  kv_bytes_per_token (the ragged layout's lane groups, 0 for the token-major ones). `draft`:
  a speculative draft model whose KV sits in arrays of its own indexed by the same page tables
  (engine/draft.py), so each page also holds the draft's KV of its tokens (its weights are in
  `weight_bytes`).
  """
  if not 0 < memory_fraction <= 1:
    raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
  per_layer = (page_size * kv_bytes_per_token(model_cfg, kv_dtype, lane_groups)
               // model_cfg.num_layers)
  num_local = sum(model_cfg.local_layers) if num_window_pages else 0
  page = per_layer * (model_cfg.num_layers - num_local)
  if draft is not None:
    page += page_size * kv_bytes_per_token(draft, kv_dtype, lane_groups)
  budget = (int(memory_bytes * memory_fraction) - weight_bytes
            - num_window_pages * num_local * per_layer)
  # Every layer local (Mistral): the full pool's pages hold no KV, they only number positions;
  # as many as one layer's pages would fill the memory left.
  pages = max(0, budget) // (page or per_layer)
  if pages < 2:
    fmt = format_bytes
    raise ValueError(
        f"KV cache does not fit: {memory_fraction:.0%} of {fmt(memory_bytes)} minus weights of "
        f"{fmt(weight_bytes)} leaves {fmt(budget)}, but the pool needs two pages of "
        f"{fmt(page)} (one is the scratch page); raise the memory fraction or shrink the model")
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


def format_bytes(num_bytes: int) -> str:
  for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(num_bytes) >= size:
      return f"{num_bytes / size:.2f} {unit}"
  return f"{num_bytes} B"

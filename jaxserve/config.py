"""The three configs of jaxserve: the model, the engine and one request's sampling.

Each is a frozen dataclass, validated once in `__post_init__`, and handed whole to its one owner:
`ModelConfig` to the model, `EngineConfig` to the engine, `SamplingParams` to a request.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Mapping, Sequence


def is_int(x: Any) -> bool:
  """An int, and not a bool: JSON's true is no number."""
  return isinstance(x, int) and not isinstance(x, bool)


def short(value: Any, limit: int = 80) -> str:
  """repr(value), cut to `limit` characters: an error message quotes a bad value, not 10 MB."""
  shown = repr(value)
  return shown if len(shown) <= limit else shown[:limit] + "..."


class KVLayout(enum.Enum):
  """How the KV cache is laid out in device memory."""

  # [layers, blocks, block_size, kv_heads, head_dim], K and V in separate arrays.
  PAGED_TOKEN_MAJOR = "paged_token_major"
  # [layers, kv_heads, blocks, block_size, head_dim]: one head's positions are adjacent.
  PAGED_HEAD_MAJOR = "paged_head_major"
  # [layers, blocks, 2, block_size, kv_heads, head_dim]: one array, each page holds its K then its V.
  PAGED_KV_INTERLEAVED = "paged_kv_interleaved"
  # [layers, slots, max_len / block_size, block_size, kv_heads, head_dim] (JetStream/MaxText):
  # each slot owns max_len adjacent positions; the engine hands slot s the identity block table
  # of its own region, so the scheduler must run it without prefix caching.
  CONTIGUOUS = "contiguous"


class KVDtype(enum.Enum):
  """How the KV cache stores one value: (label, bytes per value, bytes of scale per token-head)."""

  FLOAT32 = ("float32", 4, 0)
  BFLOAT16 = ("bfloat16", 2, 0)
  FLOAT16 = ("float16", 2, 0)
  INT8 = ("int8", 1, 4)  # One float32 scale per token, per KV head, for K and for V.
  FLOAT8_E4M3 = ("float8_e4m3", 1, 0)

  def __init__(self, label: str, value_bytes: int, scale_bytes: int):
    self.label = label
    self.value_bytes = value_bytes
    self.scale_bytes = scale_bytes


class ModelFamily(enum.Enum):
  """Which decoder a ModelConfig describes, and so which module builds it."""

  LLAMA = "llama"  # SmolLM2, Llama 2/3, Mistral, Qwen2: model.py.
  GEMMA3 = "gemma3"  # Gemma 3 text models: gemma3.py (configs read by gemma3_config.py).


class AttentionBackend(enum.Enum):
  REFERENCE = "reference"  # Plain jnp: gather pages, masked softmax. The fast path on CPU.
  PALLAS = "pallas"  # The kernels of kernels_pallas/ for the running platform (interpret on CPU).
  # The kernels for a named platform, whatever runs the tracing: for `jax.export` to TPU or GPU
  # from a machine without one.
  PALLAS_TPU = "pallas_tpu"
  PALLAS_GPU = "pallas_gpu"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder of one of the `ModelFamily`s. The fields after `name` are Gemma 3's only."""

  vocab_size: int
  dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  hidden_dim: int
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  max_seq_len: int = 2048
  tie_embeddings: bool = True
  qkv_bias: bool = False
  name: str = "model"
  family: ModelFamily = ModelFamily.LLAMA
  sliding_window: int | None = None  # Positions a local layer sees, its own included.
  local_layers: tuple[bool, ...] = ()  # Per layer: True for a sliding-window (local) layer.
  rope_local_theta: float | None = None  # Local layers' RoPE base; rope_theta is the global one.
  rope_linear_factor: float | None = None  # Global layers' positions are divided by this.
  query_pre_attn_scalar: float | None = None  # Attention scores are scaled by its -1/2 power.
  final_logit_softcapping: float | None = None  # Logits become cap * tanh(logit / cap).

  def __post_init__(self):
    for field in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "hidden_dim", "max_seq_len"):
      if getattr(self, field) <= 0:
        raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(self, field)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                       f"num_kv_heads ({self.num_kv_heads})")
    if self.local_layers and len(self.local_layers) != self.num_layers:
      raise ValueError(f"ModelConfig.local_layers has {len(self.local_layers)} entries for "
                       f"{self.num_layers} layers")
    if any(self.local_layers) and not (self.sliding_window or 0) > 0:
      raise ValueError("ModelConfig.local_layers needs a positive sliding_window, got "
                       f"{self.sliding_window}")

  @property
  def num_params(self) -> int:
    d, h = self.dim, self.head_dim
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += (self.num_heads + 2 * self.num_kv_heads) * h
    layer = attn + 3 * d * self.hidden_dim + 2 * d
    if self.family is ModelFamily.GEMMA3:  # Norms after attention and the MLP, and on q and k.
      layer += 2 * d + 2 * h
    embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * layer + embed + d

  def to_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "family": self.family.value}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
    d = dict(d)
    if d.get("rope_scaling"):
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["family"] = ModelFamily(d.get("family", ModelFamily.LLAMA.value))
    d["local_layers"] = tuple(d.get("local_layers", ()))  # JSON gives a list; jit wants hashable.
    return cls(**d)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], name: str = "model") -> ModelConfig:
    """Builds a config from a Hugging Face `config.json` dict."""
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch == "Gemma3ForCausalLM" or hf.get("model_type") == "gemma3_text":
      from jaxserve import gemma3_config
      return gemma3_config.from_hf(hf, name)
    if arch not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
      raise ValueError(f"unsupported architecture {arch!r}: jaxserve runs Llama-family models")
    num_heads = hf["num_attention_heads"]
    # transformers >= 5 writes `rope_parameters` (theta included) instead of rope_theta/rope_scaling.
    rope = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
      scaling = RopeScaling(scaling["factor"], scaling["low_freq_factor"],
                            scaling["high_freq_factor"],
                            scaling["original_max_position_embeddings"])
    elif scaling:
      raise ValueError(f"unsupported rope_scaling {scaling!r}")
    return cls(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads", num_heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        hidden_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=arch == "Qwen2ForCausalLM" or hf.get("attention_bias", False),
        name=name,
    )

  @classmethod
  def from_gguf(cls, meta: Mapping[str, Any], has_output: bool, name: str = "model") -> ModelConfig:
    """Builds a config from GGUF metadata (`meta` maps key -> python value)."""
    arch = meta["general.architecture"]
    if arch == "gemma3":
      from jaxserve import gemma3_config
      return gemma3_config.from_gguf(meta, has_output, name)
    if arch not in ("llama", "mistral", "qwen2"):
      raise ValueError(f"unsupported GGUF architecture {arch!r}: jaxserve runs Llama-family models")
    p = arch + "."
    num_heads = meta[p + "attention.head_count"]
    dim = meta[p + "embedding_length"]
    scaling = None
    if meta.get(p + "rope.scaling.type") == "llama3" or (p + "rope.scaling.low_freq_factor") in meta:
      scaling = RopeScaling(meta[p + "rope.scaling.factor"], meta[p + "rope.scaling.low_freq_factor"],
                            meta[p + "rope.scaling.high_freq_factor"],
                            meta[p + "rope.scaling.original_context_length"])
    vocab = meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return cls(
        vocab_size=vocab,
        dim=dim,
        num_layers=meta[p + "block_count"],
        num_heads=num_heads,
        num_kv_heads=meta.get(p + "attention.head_count_kv", num_heads),
        head_dim=meta.get(p + "attention.key_length", dim // num_heads),
        hidden_dim=meta[p + "feed_forward_length"],
        norm_eps=meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta.get(p + "rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_seq_len=meta.get(p + "context_length", 2048),
        tie_embeddings=not has_output,
        qkv_bias=arch == "qwen2",
        name=name,
    )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """The shapes the engine compiles for and the memory it holds.

  Every value here sets a shape (or picks code), so every one of them is compiled at warm-up;
  nothing a request carries is.
  """

  num_slots: int = 8  # Sequences decoding at once (a step runs a batch bucket of them).
  block_size: int = 16  # Tokens per KV page.
  num_blocks: int | None = 512  # Pages in the pool, scratch page 0 included. None: sized at
  # start-up to fill `memory_fraction` of the device's memory, weights included.
  memory_fraction: float = 0.9
  max_model_len: int = 2048  # Longest sequence (prompt + output) a slot can hold.
  prefill_buckets: tuple[int, ...] = (32, 64, 128, 256, 512)  # Padded prefill chunk lengths.
  dtype: str = "float32"  # Parameters, activations and KV cache.
  kv_layout: KVLayout = KVLayout.PAGED_TOKEN_MAJOR
  kv_dtype: KVDtype | None = None  # None: the same as `dtype`.
  attention_backend: AttentionBackend | None = None  # None: picked from the platform.
  compilation_cache_dir: str | None = "~/.cache/jaxserve/xla"  # None turns it off.
  tp: int = 1  # Tensor parallel: devices the weights and KV heads are split over (mesh axis `model`).
  dp: int = 1  # Data parallel: groups the decode slots are split over (mesh axis `data`).

  def __post_init__(self):
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"EngineConfig.dtype must be float32 or bfloat16, got {self.dtype!r}")
    for field in ("num_slots", "block_size", "max_model_len", "tp", "dp"):
      if getattr(self, field) <= 0:
        raise ValueError(f"EngineConfig.{field} must be positive, got {getattr(self, field)}")
    if not 0 < self.memory_fraction <= 1:
      raise ValueError(f"EngineConfig.memory_fraction must be in (0, 1], got {self.memory_fraction}")
    if not self.prefill_buckets or list(self.prefill_buckets) != sorted(set(self.prefill_buckets)):
      raise ValueError(f"EngineConfig.prefill_buckets must be increasing, got {self.prefill_buckets}")
    if self.num_blocks is not None and self.num_blocks < 2:
      raise ValueError("EngineConfig.num_blocks must be >= 2 (page 0 is the scratch page)")
    if self.num_slots % self.dp:
      raise ValueError(f"EngineConfig.dp ({self.dp}) must divide num_slots ({self.num_slots})")

  @property
  def max_blocks_per_seq(self) -> int:
    return math.ceil(self.max_model_len / self.block_size)

  @property
  def decode_batch_buckets(self) -> tuple[int, ...]:
    """Batch sizes decode is compiled for: the running slots, rounded up to a power of 4 (so a
    lone request costs a batch of 1, not num_slots). Under dp the slots are split over devices
    by position, so every step runs them all."""
    if self.dp > 1:
      return (self.num_slots,)
    sizes, b = [], 1
    while b < self.num_slots:
      sizes.append(b)
      b *= 4
    return tuple(sizes) + (self.num_slots,)

  @property
  def decode_block_buckets(self) -> tuple[int, ...]:
    """Block-table widths decode is compiled for: attention reads only as many pages as the
    longest running sequence needs, rounded up to a power of two (8 pages at least)."""
    widths, w = [], 8
    while w < self.max_blocks_per_seq:
      widths.append(w)
      w *= 2
    return tuple(widths) + (self.max_blocks_per_seq,)


class QueuePolicy(enum.Enum):
  FCFS = "fcfs"  # First come, first served.
  PRIORITY = "priority"  # Lower number first; FCFS within a priority.


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """How the host packs requests into the engine's slots. None of it is a device shape."""

  policy: QueuePolicy = QueuePolicy.FCFS
  max_num_batched_tokens: int = 512  # Prefill token budget per step (chunked prefill).
  reserve_blocks: int = 0  # Free blocks an admission must leave behind, headroom for decode.
  enable_prefix_caching: bool = True
  static_batching: bool = False  # For comparison: admit a group, wait for its longest member.
  max_queue_len: int = 10_000  # Waiting requests beyond this are refused.

  def __post_init__(self):
    if self.max_num_batched_tokens <= 0:
      raise ValueError("SchedulerConfig.max_num_batched_tokens must be positive, got "
                       f"{self.max_num_batched_tokens}")
    if self.reserve_blocks < 0:
      raise ValueError(f"SchedulerConfig.reserve_blocks must be >= 0, got {self.reserve_blocks}")
    if self.max_queue_len <= 0:
      raise ValueError(f"SchedulerConfig.max_queue_len must be positive, got {self.max_queue_len}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request picks its tokens and when it stops. Every field is a value, never a shape."""

  temperature: float = 1.0  # 0 means greedy.
  top_k: int = 0  # 0 means off.
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0  # Hugging Face style, over prompt and output tokens.
  presence_penalty: float = 0.0  # OpenAI style, over output tokens.
  frequency_penalty: float = 0.0
  seed: int | None = None
  max_tokens: int = 16
  stop: Sequence[str] = ()
  stop_token_ids: Sequence[int] = ()
  ignore_eos: bool = False
  logprobs: int = 0  # How many top logprobs to report per token (0: only the chosen token's).

  # Every stop string is searched for after every token, and the text that could still become
  # one is held back from the stream: both bounds keep that work and that delay small.
  MAX_STOP_STRINGS = 64
  MAX_STOP_CHARS = 256
  MAX_STOP_TOKEN_IDS = 256
  FLOAT32_MAX = 3.4028234663852886e38  # The largest float the device's sampling state holds.

  def __post_init__(self):
    check, finite = self._check, self._is_finite
    check(finite(self.temperature) and self.temperature >= 0, "temperature",
          "must be >= 0 and finite (at most 3.4e38)")
    check(is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an int >= 0")
    check(finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
    check(finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
    check(finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
          "must be > 0 and finite (at most 3.4e38)")
    check(finite(self.presence_penalty) and abs(self.presence_penalty) <= 2, "presence_penalty",
          "must be in [-2, 2]")
    check(finite(self.frequency_penalty) and abs(self.frequency_penalty) <= 2, "frequency_penalty",
          "must be in [-2, 2]")
    check(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
          "must be None or an int in [0, 2**63)")
    check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an int >= 1")
    check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false")
    check(is_int(self.logprobs) and 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
    self._check_stops()
    object.__setattr__(self, "stop", tuple(self.stop))
    object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

  def _check_stops(self) -> None:
    check, n_str, n_chars, n_ids = (self._check, self.MAX_STOP_STRINGS, self.MAX_STOP_CHARS,
                                    self.MAX_STOP_TOKEN_IDS)
    check(isinstance(self.stop, (list, tuple)), "stop", "must be a list of strings")
    check(len(self.stop) <= n_str, "stop", f"must hold at most {n_str} strings, not {len(self.stop)}")
    for n, s in enumerate(self.stop):
      check(isinstance(s, str) and 0 < len(s) <= n_chars, f"stop[{n}]",
            f"must be a non-empty string of at most {n_chars} characters", s)
    ids = self.stop_token_ids
    check(isinstance(ids, (list, tuple)), "stop_token_ids", "must be a list of ints")
    check(len(ids) <= n_ids, "stop_token_ids", f"must hold at most {n_ids} ids, not {len(ids)}")
    for n, i in enumerate(ids):
      check(is_int(i) and i >= 0, f"stop_token_ids[{n}]", "must be an int >= 0", i)

  @classmethod
  def _is_finite(cls, x: Any) -> bool:
    # Finite as the device's float32 will hold it: 1e300 would turn into inf there. (A plain
    # comparison, unlike math.isfinite, takes a 400-digit int without an OverflowError.)
    return (isinstance(x, (int, float)) and not isinstance(x, bool)
            and -cls.FLOAT32_MAX <= x <= cls.FLOAT32_MAX)

  def _check(self, ok: bool, field: str, rule: str, value: Any = dataclasses.MISSING) -> None:
    """Raises ValueError naming `field` (a field, or one item of a list field) and its value."""
    if not ok:
      shown = short(getattr(self, field) if value is dataclasses.MISSING else value)
      raise ValueError(f"SamplingParams.{field} {rule}, got {shown}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

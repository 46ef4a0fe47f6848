"""The engine (every value a compiled shape or a code path) and the scheduler (none of it a
shape)."""

from __future__ import annotations

import dataclasses
import enum
import math

from jaxserve.config.pooling import PoolingConfig
from jaxserve.config.sampling import LogprobsMode
from jaxserve.config.speculative import SpeculativeConfig


class Dtype(enum.Enum):
  """The engine's parameters, activations and KV cache (unless `kv_dtype` says otherwise)."""

  FLOAT32 = "float32"
  BFLOAT16 = "bfloat16"


class KVLayout(enum.Enum):
  """How the KV cache is laid out in device memory."""

  # [layers, pages, page_size, kv_heads, head_dim], K and V in separate arrays.
  PAGED_TOKEN_MAJOR = "paged_token_major"
  # [layers, slots, max_len / page_size, page_size, kv_heads, head_dim] (JetStream/MaxText):
  # each slot owns max_len adjacent positions; the engine hands slot s the identity page table
  # of its own region, so the scheduler must run it without prefix caching.
  CONTIGUOUS = "contiguous"
  # [layers, pages, page_size, lanes]: one lane-dense row per token, its K heads then its V heads,
  # padded to a multiple of 128 lanes (kernels_pallas/ragged_layout.py): what the ragged kernel
  # reads and writes in place, and what TPUs tile without padding. int8 rows hold their scale
  # exponents after the V heads. Every KVDtype but float16.
  RAGGED = "ragged"


class KVDtype(enum.Enum):
  """How the KV cache stores one value: (label, bytes per value, bytes of scale per token-head)."""

  FLOAT32 = ("float32", 4, 0)
  BFLOAT16 = ("bfloat16", 2, 0)
  FLOAT16 = ("float16", 2, 0)
  # A power-of-two scale per token and KV head, for K and for V: its int8 exponent
  # (kernels_pallas/kv_quant.py).
  INT8 = ("int8", 1, 1)
  FLOAT8_E4M3 = ("float8_e4m3", 1, 0)  # float8_e4m3fn, one scale per tensor (1.0).
  FLOAT8_E5M2 = ("float8_e5m2", 1, 0)

  def __init__(self, label: str, value_bytes: int, scale_bytes: int):
    self.label = label
    self.value_bytes = value_bytes
    self.scale_bytes = scale_bytes


class Quantization(enum.Enum):
  """How the weights are stored on the device (model/quant.py)."""

  NONE = "none"  # Float, in the engine's dtype.
  INT8 = "int8"  # Weight-only int8, one float32 scale per output channel, from any source.
  GGUF = "gguf"  # A GGUF file's own blocks (or a checkpoint that stores quantized weights).
  # GGUF for a source that holds blocks where that was measured at least as fast as float, else
  # NONE: `pick_quantization`.
  AUTO = "auto"


def pick_quantization(mode: Quantization, has_blocks: bool, blocks_are_faster: bool
                      ) -> Quantization:
  """What `mode` means for a source (`has_blocks`: it stores quantized weights): AUTO is GGUF
  where the step reads the blocks faster than float (`blocks_are_faster`: on one CPU with
  kernels_cpu built, loading/checkpoint.py asks), else NONE; GGUF refused for a float source.

  Measured (BENCHMARKS.md, "CPU kernels", 2026-12-04): with the kernels the default model's
  decode step takes 0.34x / 0.73x / 0.74x float32's at 1 / 16 / 64 slots, and prefill 1.00x.
  Without them XLA:CPU's dot reads float only (each layer's weights dequantized into a float32
  copy first: 1.5x float's step at 1 slot); TPU and GPU are not measured yet."""
  if mode is Quantization.AUTO:
    return Quantization.GGUF if has_blocks and blocks_are_faster else Quantization.NONE
  if mode is Quantization.GGUF and not has_blocks:
    raise ValueError("--quantization gguf needs a source that stores quantized blocks (a .gguf "
                     "file, a packaged model, or a checkpoint converted with --quantization "
                     "gguf); this one stores float weights: use int8 or none")
  return mode


class CpuActivations(enum.Enum):
  """What the CPU kernel (kernels_cpu) multiplies quantized weights with: the float activations
  (their float32 products, the default), or the activations quantized per row in blocks of 32 to
  int8 with a float scale a block and multiplied as integers (VNNI's vpdpbusd where CPUID shows
  it, else AVX2's vpmaddubsw): an approximation of the float model, like a quantized weight,
  measured in BENCHMARKS.md ("Quantized weights"). Every quantized matmul of every step runs in
  the mode, and a row's result does not depend on the other rows of the step (the mode attends
  with kernels_cpu's ragged kernel by default: default_attention_backend), so speculation's
  output equals the same mode's without it."""

  FLOAT = "float"
  INT8 = "int8"


class AttentionBackend(enum.Enum):
  REFERENCE = "reference"  # Plain jnp: gather pages, masked softmax. The fast path on CPU.
  PALLAS = "pallas"  # The kernels of kernels_pallas/ for the running platform (interpret on CPU).
  # The kernels for a named platform, whatever runs the tracing: for `jax.export` to TPU or GPU
  # from a machine without one.
  PALLAS_TPU = "pallas_tpu"
  PALLAS_GPU = "pallas_gpu"
  # kernels_cpu's ragged kernel through jax.ffi (C++): the Pallas kernels' op and layout, on CPU.
  CPU = "cpu"

  @property
  def is_pallas(self) -> bool:
    """Whether it runs a ragged kernel (Pallas, or kernels_cpu's) over the ragged layout."""
    return self is not AttentionBackend.REFERENCE


class Platform(enum.Enum):
  """A JAX backend, by its name in jax.default_backend() and jax.Device.platform: the chip a
  compile target is (planning/chips.py), and which kernel variant runs (kernels_pallas)."""

  TPU = "tpu"
  GPU = "gpu"  # NVIDIA, through CUDA.
  CPU = "cpu"  # No kernel compiler: the TPU kernels run in Pallas interpret mode.
  # GPU's old name in planning/chips.py (the same member), while compiling/targets.py and
  # compiling/programs.py still spell it so.
  CUDA = "gpu"


def default_attention_backend(platform: str,
                              activations: CpuActivations = CpuActivations.FLOAT
                              ) -> AttentionBackend:
  """Plain jnp on CPU (Pallas there is interpret mode only), but kernels_cpu's ragged kernel
  with int8 activations; the kernels on TPU and GPU. platform: jax.default_backend()'s name.

  Why the ragged kernel with int8 activations: jnp's attention sums a row in an order that
  depends on how many rows the step has (a row's logits 9e-5 apart alone and in a chunk), and
  rounding x to int8 turns those last bits into other tokens (1.07 apart, the argmax moved), so
  a verifying chunk would change speculation's output. The kernel attends each row alone: the
  same bits in a step of 1 row or of 32, in either mode (measured on the default model)."""
  if platform != "cpu":
    return AttentionBackend.PALLAS
  return AttentionBackend.CPU if activations is CpuActivations.INT8 else AttentionBackend.REFERENCE


# What the Pallas backend's ragged KV layout (KVLayout.RAGGED) can store.
RAGGED_KV_DTYPES = (KVDtype.FLOAT32, KVDtype.BFLOAT16, KVDtype.INT8, KVDtype.FLOAT8_E4M3,
                    KVDtype.FLOAT8_E5M2)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """The shapes the engine compiles for and the memory it holds.

  Every value here sets a shape (or picks code), so every one of them is compiled at warm-up;
  nothing a request carries is.
  """

  num_slots: int = 8  # Sequences decoding at once (a step runs a batch bucket of them).
  page_size: int = 16  # Tokens per KV page.
  num_pages: int | None = 512  # Pages in the pool, scratch page 0 included. None: sized at
  # start-up to fill `memory_fraction` of the device's memory, weights included.
  memory_fraction: float = 0.9
  max_model_len: int = 2048  # Longest sequence (prompt + output) a slot can hold.
  prefill_buckets: tuple[int, ...] = (32, 64, 128, 256, 512)  # Padded prefill chunk lengths.
  # Prompts one step prefills at most (its sequence axis): each costs the step a query block of
  # attention and a sampled row, used or not.
  max_prefill_seqs: int = 4
  dtype: Dtype = Dtype.FLOAT32  # Parameters, activations and KV cache (a name is taken too).
  # None: picked with the backend (the kernels need RAGGED; the jnp path reads every layout).
  kv_layout: KVLayout | None = None
  kv_dtype: KVDtype | None = None  # None: the same as `dtype`.
  attention_backend: AttentionBackend | None = None  # None: picked from the platform.
  compilation_cache_dir: str | None = "~/.cache/jaxserve/xla"  # None turns it off.
  # Sliding-window (local) layers keep only the pages their window can still touch, in a pool of
  # their own (model/kv_cache.py KVCache's window pool); False: every layer keeps every page.
  window_pages: bool = True
  # Tensor parallel: devices the weights and KV heads are split over (mesh axis `model`).
  tp: int = 1
  dp: int = 1  # Data parallel: groups the decode slots are split over (mesh axis `data`).
  ep: int = 1  # Expert parallel: devices a mixture of experts' experts are split over (`expert`).
  # Speculative decoding (None: off); its k sets the verify steps' shapes (config/speculative.py).
  speculative: SpeculativeConfig | None = None
  # How the weights are stored (a name is taken too): `pick_quantization` resolves AUTO.
  quantization: Quantization = Quantization.AUTO
  # The layers unrolled, each reading its own weight arrays (True), or one scan over the stacked
  # [L, ...] weights (False). On CPU with float weights True made SmolLM2's 1-slot step 0.74x
  # and its 16- and 64-slot steps 0.99x and 0.94x, at 2.1x the warm-up (BENCHMARKS.md, "Tried and
  # not adopted"); quantized weights unrolled are far slower.
  unroll_layers: bool = False
  # LoRA adapters (config/lora.py): device slots for adapters at once (0: LoRA off, the programs
  # and arrays as without it), the rank every slot is padded to, and how many adapters may be
  # added at once, each with its host copy (vLLM's --max-cpu-loras; None: no limit).
  max_loras: int = 0
  max_lora_rank: int = 16
  max_cpu_loras: int | None = None
  # The prefix cache's host tier (engine/host_kv.py): GiB of host memory that keeps evicted KV
  # pages for prefix hits to copy back (vLLM's --kv-offloading-size). 0: evicted pages are
  # dropped. It sets the host pool's shape.
  kv_offload_gib: float = 0.0
  # What sampled tokens' logprobs report (config/sampling.py LogprobsMode, vLLM's
  # --logprobs-mode; a name is taken too): it picks the sampler's code, so it is compiled in.
  logprobs_mode: LogprobsMode = LogprobsMode.RAW_LOGPROBS
  # A pooling engine (--task embed|rerank): the prefill-only pooling steps are compiled too.
  pooling: PoolingConfig | None = None
  # The CPU kernel's products with quantized weights (a name is taken too): float, or int8
  # activations; it picks the kernel's code, so it is compiled in.
  cpu_activations: CpuActivations = CpuActivations.FLOAT

  def __post_init__(self):
    for field, cls in (("quantization", Quantization), ("dtype", Dtype),
                       ("logprobs_mode", LogprobsMode), ("cpu_activations", CpuActivations)):
      self._as_enum(field, cls)
    if self.max_prefill_seqs < 1:
      raise ValueError(f"EngineConfig.max_prefill_seqs must be >= 1, got {self.max_prefill_seqs}")
    for field in ("num_slots", "page_size", "max_model_len", "tp", "dp", "ep"):
      if getattr(self, field) <= 0:
        raise ValueError(f"EngineConfig.{field} must be positive, got {getattr(self, field)}")
    if not 0 < self.memory_fraction <= 1:
      raise ValueError(
          f"EngineConfig.memory_fraction must be in (0, 1], got {self.memory_fraction}")
    if not self.prefill_buckets or list(self.prefill_buckets) != sorted(set(self.prefill_buckets)):
      raise ValueError(
          f"EngineConfig.prefill_buckets must be increasing, got {self.prefill_buckets}")
    if self.num_pages is not None and self.num_pages < 2:
      raise ValueError("EngineConfig.num_pages must be >= 2 (page 0 is the scratch page)")
    if self.num_slots % self.dp:
      raise ValueError(f"EngineConfig.dp ({self.dp}) must divide num_slots ({self.num_slots})")
    if self.attention_backend is not None:
      self.check_backend(self.attention_backend)
    self._check_lora()
    if self.kv_offload_gib < 0:
      raise ValueError(f"EngineConfig.kv_offload_gib must be >= 0, got {self.kv_offload_gib}")
    if self.kv_offload_gib and self.kv_layout is KVLayout.CONTIGUOUS:
      raise ValueError("kv_offload_gib needs a paged KV layout: the contiguous one shares no "
                       "pages, so it has no prefix cache to offload")
    if self.kv_offload_gib and self.speculative is not None and self.speculative.method == "draft":
      raise ValueError("kv_offload_gib does not run with a draft model yet (its cache's pages "
                       "would need copying too)")

  def _as_enum(self, field: str, cls: type[enum.Enum]) -> None:
    """A field given by its enum's value (a name, from a flag or a user) becomes the member; any
    other value is a ValueError naming it and the choices."""
    value = getattr(self, field)
    if not isinstance(value, cls):
      if value not in {x.value for x in cls}:
        raise ValueError(f"EngineConfig.{field} must be one of {[x.value for x in cls]}, got "
                         f"{value!r}")
      object.__setattr__(self, field, cls(value))

  def _check_lora(self) -> None:
    if self.max_loras < 0 or self.max_lora_rank < 1:
      raise ValueError(f"EngineConfig.max_loras must be >= 0 and max_lora_rank >= 1, got "
                       f"{self.max_loras} and {self.max_lora_rank}")
    if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
      raise ValueError(f"EngineConfig.max_cpu_loras ({self.max_cpu_loras}) must be >= "
                       f"max_loras ({self.max_loras})")
    if self.max_loras and self.speculative is not None and self.speculative.method != "ngram":
      raise ValueError(f"LoRA (max_loras > 0) runs with n-gram speculation only, not "
                       f"{self.speculative.method!r} (a draft model proposes without adapters)")
    if self.max_loras and self.dp * self.ep > 1:
      raise ValueError("LoRA (max_loras > 0) runs with tp, not with dp or ep > 1 yet")

  def check_backend(self, backend: AttentionBackend) -> None:
    """Raises ValueError naming the problem when `backend` cannot run this config: the Pallas
    kernel's ragged KV layout holds RAGGED_KV_DTYPES (not float16)."""
    if backend.is_pallas and self.kv_dtype is not None and self.kv_dtype not in RAGGED_KV_DTYPES:
      stores = ", ".join(d.label for d in RAGGED_KV_DTYPES)
      raise ValueError(f"kv_dtype {self.kv_dtype.label} does not run on the Pallas attention "
                       f"backend ({backend.value}): its ragged KV layout stores {stores}, not "
                       f"{self.kv_dtype.label}; use --attention reference "
                       "(attention_backend=AttentionBackend.REFERENCE)")

  @property
  def max_pages_per_seq(self) -> int:
    return math.ceil(self.max_model_len / self.page_size)

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


def window_pages_per_seq(window: int, page_size: int, chunk: int = 1) -> int:
  """Pages a local layer's window can touch in one step of `chunk` new tokens: their keys span
  window - 1 + chunk consecutive positions, one page more than they fill when they straddle a
  boundary. chunk 1 (decode): 1 + ceil((window - 1) / page_size)."""
  return 1 + -(-(window + chunk - 2) // page_size)


class QueuePolicy(enum.Enum):
  FCFS = "fcfs"  # First come, first served.
  PRIORITY = "priority"  # Lower number first; FCFS within a priority.


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """How the host packs requests into the engine's slots. None of it is a device shape."""

  policy: QueuePolicy = QueuePolicy.FCFS
  max_num_batched_tokens: int = 512  # Prefill token budget per step (chunked prefill).
  reserve_pages: int = 0  # Free pages an admission must leave behind, headroom for decode.
  enable_prefix_caching: bool = True
  static_batching: bool = False  # For comparison: admit a group, wait for its longest member.
  max_queue_len: int = 10_000  # Waiting requests beyond this are refused.

  def __post_init__(self):
    if self.max_num_batched_tokens <= 0:
      raise ValueError("SchedulerConfig.max_num_batched_tokens must be positive, got "
                       f"{self.max_num_batched_tokens}")
    if self.reserve_pages < 0:
      raise ValueError(f"SchedulerConfig.reserve_pages must be >= 0, got {self.reserve_pages}")
    if self.max_queue_len <= 0:
      raise ValueError(f"SchedulerConfig.max_queue_len must be positive, got {self.max_queue_len}")

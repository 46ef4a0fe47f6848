"""Tensor and data parallelism on fake CPU devices: same greedy tokens as one device, the expected
collectives in the compiled step, and per-device memory divided by tp.

The sharded runs happen in a subprocess (`sharding_worker.py`) with
`--xla_force_host_platform_device_count`, which must be set before jax is imported; this process
stays on one device like the rest of the suite.
"""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig, KVLayout, ModelConfig
from jaxserve.model import axes
from jaxserve.model.kv_cache import ragged_lanes
from jaxserve.planning.capacity import KNOWN_MODELS
from support.workers import PROMPTS, TINY8, run_worker

LAYOUTS = [[1, 1], [2, 1], [4, 1], [1, 2], [2, 2]]  # [tp, dp]
HAS_CONTIGUOUS = hasattr(KVLayout, "CONTIGUOUS")


@pytest.fixture(scope="module")
def tiny_worker(tmp_path_factory):
  cache = tmp_path_factory.mktemp("xla")
  layouts = LAYOUTS + ([[2, 2, "contiguous"]] if HAS_CONTIGUOUS else [])
  return run_worker(dict(devices=8, model=TINY8, prompts=PROMPTS, steps=6, layouts=layouts,
                         hlo=True, cache_dir=str(cache)))


@pytest.fixture(scope="module")
def tiny_runs(tiny_worker):
  return tiny_worker["layouts"]


@pytest.mark.parametrize("layout", ["2x1", "4x1", "1x2", "2x2"])
def test_greedy_tokens_match_one_device(tiny_runs, layout):
  one, many = tiny_runs["1x1"], tiny_runs[layout]
  assert many["tokens"] == one["tokens"]
  np.testing.assert_allclose(many["logprobs"], one["logprobs"], atol=1e-4)


def test_tiny_model_output_is_not_degenerate(tiny_runs):
  """Equal outputs prove little if every run just repeats one token."""
  assert len({t for row in tiny_runs["1x1"]["tokens"] for t in row}) >= 4


def test_collectives_in_compiled_decode(tiny_runs):
  # One device: nothing to communicate.
  assert not any(tiny_runs["1x1"]["collectives"].values())
  # Megatron split: attention output and MLP down-projection are partial sums over `model`;
  # each needs an all-reduce (inside the layer scan's body: counted once, run per layer).
  for layout in ("2x1", "4x1", "2x2"):
    assert tiny_runs[layout]["collectives"]["all-reduce"] >= 2, layout
  # Data parallel: each step reads the decoding slots' tokens and positions (split by slot over
  # `data`) into its replicated rows, and every process reads the sampled tokens: collectives.
  assert sum(tiny_runs["1x2"]["collectives"].values()) >= 1, tiny_runs["1x2"]["collectives"]


def test_pallas_backend_splits_the_ragged_pages_by_kv_head(tmp_path):
  """The ragged layout keeps one lane group per device's KV heads, so the kernel (interpret mode
  here) runs per shard on its own heads' pages: tp=2 gives one device's greedy tokens, and each
  device holds half the cache."""
  out = run_worker(dict(devices=2, model=TINY8, prompts=PROMPTS, steps=4, cache_dir=str(tmp_path),
                        layouts=[[1, 1, "ragged", "pallas"], [2, 1, "ragged", "pallas"]]))
  one, two = out["layouts"]["1x1-ragged-pallas"], out["layouts"]["2x1-ragged-pallas"]
  assert two["tokens"] == one["tokens"]
  np.testing.assert_allclose(two["logprobs"], one["logprobs"], atol=1e-4)
  # Per device: a page row of its 2 heads' K and V (2 * 2 * 16 = 64 lanes) padded to 128 lanes,
  # the row one device holds for all 4 heads at tp=1 (128 lanes, no padding).
  lanes = lambda tp: ragged_lanes(TINY8["num_kv_heads"], TINY8["head_dim"], tp) // tp
  assert two["cache_bytes_device0"] * lanes(1) == one["cache_bytes_device0"] * lanes(2)


def _param_bytes_per_device(cfg: ModelConfig, tp: int) -> int:
  """Worked by hand: the RMSNorm scales are replicated, every other weight splits tp ways."""
  norms = (2 * cfg.num_layers + 1) * cfg.dim
  return 4 * (norms + (cfg.num_params - norms) // tp)


@pytest.mark.parametrize("layout, tp", [("1x1", 1), ("2x1", 2), ("4x1", 4), ("1x2", 1), ("2x2", 2)])
def test_per_device_memory_shrinks_by_tp(tiny_runs, layout, tp):
  cfg = ModelConfig(**TINY8)
  run = tiny_runs[layout]
  assert run["param_bytes_device0"] == _param_bytes_per_device(cfg, tp)
  # K, V: [L, P, Z, K, H] f32
  full_cache = 2 * cfg.num_layers * 64 * 8 * cfg.num_kv_heads * cfg.head_dim * 4
  assert run["cache_bytes_device0"] == full_cache // tp


@pytest.mark.skipif(not HAS_CONTIGUOUS, reason="no contiguous KV layout")
def test_contiguous_cache_splits_by_slot_over_data(tiny_runs):
  """The contiguous layout's cache has a slot axis: dp=2 halves it again, on top of tp=2."""
  run, one = tiny_runs["2x2-contiguous"], tiny_runs["1x1"]
  assert run["tokens"] == one["tokens"]
  np.testing.assert_allclose(run["logprobs"], one["logprobs"], atol=1e-4)
  cfg = ModelConfig(**TINY8)
  # [L, S, max_len, K, H] float32 for K and for V; max_len = 64 tokens.
  full = 2 * cfg.num_layers * 4 * 64 * cfg.num_kv_heads * cfg.head_dim * 4
  assert run["cache_bytes_device0"] == full // 4


def test_int8_weights_split_with_their_scales(tmp_path):
  """int8 weights under tp 2 and 4: each device holds its heads' and MLP columns' values and
  scales (per output channel), and greedy tokens equal one device's."""
  runs = run_worker(dict(devices=4, model=TINY8, prompts=PROMPTS, steps=6, quantization="int8",
                         layouts=[[1, 1], [2, 1], [4, 1]], cache_dir=str(tmp_path)))["layouts"]
  for layout in ("2x1", "4x1"):
    assert runs[layout]["tokens"] == runs["1x1"]["tokens"]
    np.testing.assert_allclose(runs[layout]["logprobs"], runs["1x1"]["logprobs"], atol=1e-4)
  assert runs["4x1"]["param_bytes_device0"] < runs["2x1"]["param_bytes_device0"] / 1.8


@pytest.mark.real_model
def test_default_model_gguf_blocks_under_tp3_match_one_device(tmp_path):
  """The GGUF's Q4_1/Q8_0 blocks at tp=3: group scales and minima split with their heads, MLP
  columns and vocabulary rows; greedy tokens equal one device's."""
  prompts = [[1, 504, 3458, 282, 4649, 314], [1, 1072, 28560, 30, 94, 33]]
  runs = run_worker(dict(devices=3, model="default", prompts=prompts, steps=8,
                         quantization="gguf", layouts=[[1, 1], [3, 1]],
                         cache_dir=str(tmp_path)))["layouts"]
  assert runs["3x1"]["tokens"] == runs["1x1"]["tokens"]
  np.testing.assert_allclose(runs["3x1"]["logprobs"], runs["1x1"]["logprobs"], atol=1e-3)
  assert runs["3x1"]["param_bytes_device0"] < runs["1x1"]["param_bytes_device0"] / 2.5


@pytest.mark.real_model
def test_default_model_tp3_dp2_matches_one_device(tmp_path):
  """SmolLM2-135M (9 heads, 3 KV heads): tp=3 splits one KV head per device; dp=2 on top."""
  from jaxserve.loading import checkpoint
  from jaxserve.text.tokenizer import Tokenizer

  tokenizer = Tokenizer.from_hf_dir(checkpoint.resolve(None) / "tokenizer")  # Not the weights.
  prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                            "Once upon a time", "1, 2, 3, 4,")]
  runs = run_worker(dict(devices=6, model="default", prompts=prompts, steps=8,
                         layouts=[[1, 1], [3, 2]], cache_dir=str(tmp_path)))["layouts"]
  assert runs["3x2"]["tokens"] == runs["1x1"]["tokens"]
  np.testing.assert_allclose(runs["3x2"]["logprobs"], runs["1x1"]["logprobs"], atol=1e-3)
  assert runs["3x2"]["param_bytes_device0"] == _param_bytes_per_device(
      KNOWN_MODELS["smollm2-135m"], 3)


def test_non_dividing_tp_is_rejected_with_the_valid_choices():
  smollm2 = KNOWN_MODELS["smollm2-135m"]  # 9 heads, 3 KV heads, MLP 1536.
  with pytest.raises(ValueError, match=r"--tp 2 does not divide .*3 kv_heads.*\[1, 3\]"):
    axes.check_divisible(smollm2, tp=2, dp=1, num_slots=8)
  axes.check_divisible(smollm2, tp=3, dp=2, num_slots=8)
  with pytest.raises(ValueError, match="--dp 3 does not divide the 8 decode slots"):
    axes.check_divisible(smollm2, tp=1, dp=3, num_slots=8)


def test_engine_config_validates_mesh_sizes():
  with pytest.raises(ValueError, match="tp must be positive"):
    EngineConfig(tp=0)
  with pytest.raises(ValueError, match=r"dp \(3\) must divide num_slots \(8\)"):
    EngineConfig(num_slots=8, dp=3)


def test_logical_axes_map_to_mesh_axes():
  mesh = AbstractMesh((2, 4), (axes.DATA, axes.MODEL))
  assert axes.logical_to_mesh(P("layers", "embed", "heads", "head_dim"), (2, 64, 8, 16), mesh) == \
      P(None, None, "model", None)
  assert axes.logical_to_mesh(P("layers", "mlp", "embed"), (2, 96, 64), mesh) == P(None, "model",
                                                                                   None)
  # An odd vocabulary stays whole rather than failing: 32001 tokens do not split 4 ways.
  assert axes.logical_to_mesh(P("vocab", "embed"), (32001, 64), mesh) == P(None, None)
  assert axes.logical_to_mesh(P("vocab", "embed"), (32000, 64), mesh) == P("model", None)
  with pytest.raises(ValueError, match="kv_heads"):
    axes.logical_to_mesh(P("embed", "kv_heads"), (64, 6), mesh)

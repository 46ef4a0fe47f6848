"""The int8 activation mode (`--cpu-activations int8`): kernels_cpu's qmatmul with
int8_activations against a numpy reference of the same arithmetic (reference.
qmatmul_int8_reference) over M, K, N, block types, packed and tiled layouts and every int8 path
this CPU runs (VNNI, AVX2's products, scalar); a row's result the same bit for bit alone or among
others; the wrapper's checks; the engine in the mode (the default model, with and without
n-gram speculation: the same tokens, no compile after warm-up)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels_cpu
from jaxserve.config import (
  AttentionBackend,
  CpuActivations,
  EngineConfig,
  Quantization,
  SamplingParams,
  SpeculativeConfig,
  default_attention_backend,
)
from jaxserve.loading import gguf_blocks
from kernels_cpu import library
from kernels_cpu.reference import packed, qmatmul_int8_reference, quantized_rows, tiled
from support.gguf_random import random_blocks
from support.tiny import count_compiles

built = pytest.mark.skipif(not kernels_cpu.available(), reason="kernels_cpu not built")
TOLERANCE = 1e-5  # Of the largest |y|: float32 rounding of the scales' products and sums.
# Block types whose groups are whole 32-input blocks (Q6_K's groups of 16 are not), and int8
# per output channel.
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "int8")
PACKABLE = ("Q4_1", "Q4_K")


def weight(type_name: str, K: int, N: int, rng, *, four_bits=False, as_tiles=False):
  """(values, scale, minimum) of a random kn [K, N] weight as the kernel takes it."""
  if type_name == "int8":
    arrays = (rng.integers(-127, 128, (K, N), dtype=np.int8),
              rng.random((1, N), dtype=np.float32) * 0.01, None)
  else:
    b = gguf_blocks.unpack(random_blocks(type_name, N, K, rng), type_name, (N, K))
    arrays = tuple(None if a is None else np.ascontiguousarray(a.T)
                   for a in (b.values, b.scale, b.minimum))
  if four_bits:
    arrays = (packed(arrays[0], axis=0), *arrays[1:])
  if as_tiles:
    arrays = tuple(None if a is None else tiled(a) for a in arrays)
  return tuple(None if a is None else jnp.asarray(a) for a in arrays)


def relative_error(y, ref) -> float:
  return float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / np.max(np.abs(ref)))


def test_quantized_rows_by_hand():
  x = np.zeros((1, 64), np.float32)
  x[0, :4] = [1.27, -0.5, 0.005, 0.0]  # amax 1.27: d = 0.01, q = x / 0.01 rounded.
  q, d = quantized_rows(x)
  assert d.tolist()[0] == [np.float32(1.27) / np.float32(127), 0.0]
  assert q[0, :4].tolist() == [127, -50, 0, 0]  # 0.5 rounds to even: 0.
  assert not q[0, 32:].any()


@built
@pytest.mark.parametrize("isa", library.int8_isas())
@pytest.mark.parametrize("type_name", TYPES)
def test_kernel_matches_the_reference(type_name, isa):
  """N = 200: three tiles of 64 and 8 columns past them; K = 256 and 96 (3 blocks)."""
  rng = np.random.default_rng(0)
  for K in (256, 96):
    values, scale, minimum = weight(type_name, K, 200, rng)
    for M in (*range(1, 9), 16):
      x = jnp.asarray(rng.standard_normal((M, K), dtype=np.float32))
      y = kernels_cpu.qmatmul(x, values, scale, minimum, int8_activations=True, isa=isa)
      ref = qmatmul_int8_reference(x, values, scale, minimum)
      assert y.shape == (M, 200) and relative_error(y, ref) <= TOLERANCE, (K, M)


@built
@pytest.mark.parametrize("isa", library.int8_isas())
@pytest.mark.parametrize("form", ["Q4_1 packed", "Q4_K packed", "Q8_0", "int8"])
def test_tiled_and_stacked_layouts_match_the_reference(form, isa):
  """The forms the engine reads (model/kernel_forms.py): 4-bit values packed two a byte, arrays
  in tiles of 64 columns, layer 1 of a stacked [2, ...] weight; and nk (the tied head when its
  vocabulary is not whole tiles)."""
  rng = np.random.default_rng(1)
  name, four_bits = form.split()[0], form.endswith("packed")
  layers = [weight(name, 128, 192, rng, four_bits=four_bits, as_tiles=True) for _ in range(2)]
  stack = [None if a[0] is None else jnp.stack(a) for a in zip(*layers)]
  for M in (1, 3, 7, 16):
    x = jnp.asarray(rng.standard_normal((M, 128), dtype=np.float32))
    y = kernels_cpu.qmatmul(x, *stack, layer=1, tiled=True, int8_activations=True, isa=isa)
    ref = qmatmul_int8_reference(x, *stack, layer=1, tiled=True)
    assert relative_error(y, ref) <= TOLERANCE, M
  if not four_bits:  # nk: W as [N, K].
    values, scale, minimum = weight(name, 128, 100, rng)
    nk = [None if a is None else a.T for a in (values, scale, minimum)]
    x = jnp.asarray(rng.standard_normal((5, 128), dtype=np.float32))
    y = kernels_cpu.qmatmul(x, *nk, nk=True, int8_activations=True, isa=isa)
    assert relative_error(y, qmatmul_int8_reference(x, *nk, nk=True)) <= TOLERANCE


@built
@pytest.mark.parametrize("isa", library.int8_isas())
@pytest.mark.parametrize("form", ["Q4_1 packed", "Q8_0"])
def test_a_rows_result_does_not_depend_on_the_other_rows(form, isa):
  """A row alone (the one-row decode step) and the same row inside a chunk of 7 (a verifying
  chunk) or 16: the same bits, so speculation's output equals the mode's without it."""
  rng = np.random.default_rng(2)
  name, four_bits = form.split()[0], form.endswith("packed")
  w = weight(name, 576, 200, rng, four_bits=four_bits, as_tiles=False)
  x = jnp.asarray(rng.standard_normal((16, 576), dtype=np.float32))
  alone = [kernels_cpu.qmatmul(x[i:i + 1], *w, int8_activations=True, isa=isa) for i in range(16)]
  for M in (7, 16):
    together = kernels_cpu.qmatmul(x[:M], *w, int8_activations=True, isa=isa)
    for i in range(M):
      assert (together[i] == alone[i][0]).all(), (M, i)


@built
def test_every_path_gives_the_same_bits():
  """The tiles of each instruction set and the scalar loop do the same float steps in the same
  order on exact integer sums: one result, whichever path CPUID picks."""
  rng = np.random.default_rng(3)
  w = weight("Q4_1", 256, 128, rng, four_bits=True, as_tiles=True)
  x = jnp.asarray(rng.standard_normal((3, 256), dtype=np.float32))
  ys = [kernels_cpu.qmatmul(x, *w, tiled=True, int8_activations=True, isa=isa)
        for isa in library.int8_isas()]
  assert all((y == ys[0]).all() for y in ys)


@built
def test_the_wrapper_refuses_groups_that_are_not_whole_blocks():
  rng = np.random.default_rng(4)
  values, scale, _ = weight("Q8_0", 256, 64, rng)
  x = jnp.zeros((1, 256), jnp.float32)
  with pytest.raises(ValueError, match="multiples of 32"):  # Groups of 16 (as Q6_K's).
    kernels_cpu.qmatmul(x, values, jnp.repeat(scale, 2, axis=0), int8_activations=True)
  with pytest.raises(ValueError, match="multiples of 32"):  # K = 48.
    kernels_cpu.qmatmul(x[:, :48], values[:48], scale[:1] * 0 + 1, int8_activations=True)


# The engine in the mode: the default model's GGUF blocks, n-gram speculation (k = 4: a verifying
# chunk of 5 rows beside one-row decode steps).
ENGINE = EngineConfig(num_slots=2, page_size=16, num_pages=32, max_model_len=256,
                      prefill_buckets=(64,), compilation_cache_dir=None, quantization="gguf",
                      cpu_activations="int8",
                      speculative=SpeculativeConfig(num_speculative_tokens=4))
TEXTS = ["Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes.\n"
         "List: apples, bananas,", "What is a mortgage rate?"]


@built
@pytest.mark.real_model
def test_the_engine_decodes_in_the_mode_with_speculation_changing_nothing():
  """Greedy tokens with n-gram speculation equal the same engine's without it (a row's result
  does not depend on the rows beside it), and neither compiles after warm-up."""
  from jaxserve.batching.runner import Runner
  from jaxserve.engine.engine import Engine
  from jaxserve.loading import checkpoint

  model, tokenizer = checkpoint.load_model(None, quantization=Quantization.GGUF)
  engine = Engine(model, ENGINE, stop_ids=tokenizer.stop_ids)
  assert engine.config.cpu_activations is CpuActivations.INT8
  assert engine.backend is AttentionBackend.CPU  # Each row attended alone: row-independent.
  assert not model.layers.w_up.int8_activations  # The engine's own view is in the mode.
  engine.warmup()
  prompts = [(tokenizer.encode(t), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
             for t in TEXTS]
  outputs = []
  with count_compiles() as counts:
    for speculate in (True, False):
      runner = Runner(engine, tokenizer)
      if not speculate:
        runner.scheduler.speculative = None
      outputs.append([list(c.token_ids) for c in runner.generate(prompts)])
  assert outputs[0] == outputs[1] and all(len(t) == 24 for t in outputs[0])
  assert counts == {"trace": 0, "compile": 0}


def test_the_mode_needs_weights_the_kernel_reads():
  from jaxserve.model import quant_linear
  with pytest.raises(ValueError, match="cpu-activations int8 needs quantized weights"):
    quant_linear.with_activations(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), CpuActivations.INT8)


def test_the_flag_sets_the_mode_and_float_stays_the_default():
  from jaxserve.cli import flags
  from jaxserve.cli import main as cli

  parse = lambda *extra: cli.build_parser().parse_args(["serve", *extra])
  assert flags.engine_config(parse(), "cpu").cpu_activations is CpuActivations.FLOAT
  config = flags.engine_config(parse("--cpu-activations", "int8"), "cpu")
  assert config.cpu_activations is CpuActivations.INT8
  assert EngineConfig(cpu_activations="int8").cpu_activations is CpuActivations.INT8
  # The mode attends with kernels_cpu's ragged kernel on CPU unless --attention says otherwise.
  assert default_attention_backend("cpu", CpuActivations.INT8) is AttentionBackend.CPU
  assert default_attention_backend("cpu") is AttentionBackend.REFERENCE
  assert default_attention_backend("tpu", CpuActivations.INT8) is AttentionBackend.PALLAS
  with pytest.raises(ValueError, match="cpu_activations must be one of"):
    EngineConfig(cpu_activations="int4")

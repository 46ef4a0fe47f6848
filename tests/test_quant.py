"""Quantized weights (model/quant.py): GGUF's block types unpacked exactly (loading/gguf_blocks.py),
int8 per output channel (loading/quantize.py), and both dequantized inside the step."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from jaxserve.config import Quantization, pick_quantization
from jaxserve.loading import checkpoint, gguf_blocks, pull, quantize
from jaxserve.model import quant
from support.gguf_random import random_blocks


def same_bits(a, b) -> bool:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def device_dequant(blocks: gguf_blocks.Blocks) -> np.ndarray:
  """The step's dequantization (quant.dequant, jitted) of Blocks in torch layout [out, in]."""
  w = quant.Quantized(blocks.values.shape, (None, None), quant.Layout(blocks.group,
                      blocks.minimum is not None), (1,))
  w.values[...] = jnp.asarray(blocks.values)
  w.scale[...] = jnp.asarray(blocks.scale)
  if blocks.minimum is not None:
    w.minimum[...] = jnp.asarray(blocks.minimum)
  return np.asarray(jax.jit(lambda w: quant.dequant(w, jnp.float32))(w))


@pytest.mark.parametrize("type_name", list(gguf_blocks.READERS))
def test_each_block_type_dequantizes_to_ggufs_own_numbers(type_name):
  """Random blocks of every type read here: values * scale + minimum, on the host and in the
  jitted step, is gguf.quants.dequantize bit for bit."""
  data = random_blocks(type_name, 4, 512, np.random.default_rng(0))
  ref = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
  blocks = gguf_blocks.unpack(data, type_name, (4, 512))
  assert blocks.values.dtype == np.int8 and blocks.scale.dtype == np.float32
  assert blocks.group == (16 if type_name == "Q6_K" else 32)
  assert same_bits(blocks.dequantize(), ref)
  assert same_bits(device_dequant(blocks), ref)
  # How a Q4_K layer stacks beside a Q6_K one, and a Q5_0 beside a Q4_1: the same numbers (a
  # zero minimum turns -0.0 into +0.0, equal as a number).
  regrouped = blocks.regroup(16, with_minimum=True)
  assert np.array_equal(regrouped.dequantize(), ref)


def test_real_tensors_of_both_packaged_ggufs_unpack_exactly():
  """One tensor of each quantized type in SmolLM2 (Q8_0, Q4_1) and Gemma 3 (Q5_0, Q4_K, Q6_K)."""
  seen = {}
  for model in (pull.SMOLLM2, pull.GEMMA3):
    for t in gguf.GGUFReader(str(pull.gguf_path(model))).tensors:
      if t.tensor_type.name in gguf_blocks.READERS:
        seen.setdefault(t.tensor_type.name, t)
  assert {"Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"} <= set(seen)
  for name, t in seen.items():
    shape = tuple(reversed([int(d) for d in t.shape]))
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    assert same_bits(gguf_blocks.unpack(t.data, name, shape).dequantize(), ref), name


def test_unknown_block_type_is_refused_by_name():
  with pytest.raises(ValueError, match="Q2_K is not read in gguf mode"):
    gguf_blocks.unpack(np.zeros((1, 84), np.uint8), "Q2_K", (1, 256))


def test_int8_per_output_channel():
  """Each output channel's largest weight maps to +-127; the error is at most half a step."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((6, 3, 4, 5)).astype(np.float32)  # [L, N, H, D]: wo, inputs N and H.
  q = quantize.int8(w, (1, 2))
  assert q["values"].dtype == np.int8 and q["scale"].shape == (6, 1, 1, 5)
  assert (np.abs(q["values"]).max(axis=(1, 2)) == 127).all()
  back = quantize.dequantize(q)
  assert (np.abs(back - w) <= q["scale"] / 2 + 1e-7).all()
  layouts = quant.layouts_of({"layers": {"wo": q}})
  assert layouts == {"wo": quant.Layout(None, False)}


def test_int8_groups_with_and_without_a_minimum():
  """A scale per 32 inputs: each group's largest |weight| maps to +-127 (symmetric), or its
  minimum to -128 and its maximum to 127 (with a minimum); the error is at most half a step, and
  the step dequantizes the stored form to the host's numbers (to float32 rounding)."""
  rng = np.random.default_rng(1)
  w = rng.standard_normal((2, 64, 5)).astype(np.float32)  # [L, D, F]: input axis D.
  for layout in (quant.Layout(32), quant.Layout(32, has_min=True)):
    q = quantize.int8(w, (1,), layout)
    assert q["values"].shape == w.shape and q["scale"].shape == (2, 2, 5)
    groups = q["values"].reshape(2, 2, 32, 5)
    if layout.has_min:
      assert (groups.min(2) == -128).all() and (groups.max(2) == 127).all()
    else:
      assert (np.abs(groups).max(2) == 127).all() and "minimum" not in q
    back = quantize.dequantize(q)
    step = np.repeat(q["scale"], 32, axis=1)
    assert (np.abs(back - w) <= step / 2 * (1 + 1e-5)).all()
    assert quant.layouts_of({"layers": {"w_up": q}}) == {"w_up": layout}
    blocks = gguf_blocks.Blocks(q["values"][0].T, q["scale"][0].T,
                                None if "minimum" not in q else q["minimum"][0].T)
    # Within float32 rounding: the step may fuse values * scale + minimum into one FMA.
    np.testing.assert_allclose(device_dequant(blocks), back[0].T, rtol=1e-6, atol=1e-7)


def test_auto_picks_the_blocks_where_they_were_measured_faster():
  # The CPU kernels: 0.43x-0.92x float's decode step. XLA's dot alone: 1.5x (BENCHMARKS.md).
  auto = Quantization.AUTO
  assert pick_quantization(auto, True, True) is Quantization.GGUF
  assert pick_quantization(auto, False, True) is Quantization.NONE
  assert pick_quantization(auto, True, False) is Quantization.NONE
  assert checkpoint.blocks_are_faster("cpu") is (kernels_cpu.available() and
                                                 "avx2" in kernels_cpu.supported_isas())
  assert not checkpoint.blocks_are_faster("tpu") and not checkpoint.blocks_are_faster("gpu")
  with pytest.raises(ValueError, match="needs a source that stores quantized blocks"):
    pick_quantization(Quantization.GGUF, False, True)


def test_auto_keeps_float_weights_where_the_library_runs_its_scalar_path(monkeypatch):
  """The kernels' scalar path (all a CPU without AVX2 runs) was never measured faster than
  XLA's float one: auto keeps float there. The library's report made "scalar", as such a CPU
  makes it; the decision is the real one."""
  monkeypatch.setattr(kernels_cpu.library, "dispatched_isa", lambda: "scalar")
  assert not checkpoint.blocks_are_faster("cpu")
  monkeypatch.setattr(kernels_cpu.library, "dispatched_isa", lambda: "avx2")
  assert checkpoint.blocks_are_faster("cpu") is kernels_cpu.available()

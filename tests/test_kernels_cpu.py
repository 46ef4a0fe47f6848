"""kernels_cpu's quantized matmul against its jnp reference: every GGUF block type the loader
reads and int8 per output channel, both layouts, M from 1 to the largest prefill bucket, every
instruction set this CPU runs; the reference against numbers worked out by hand; the stacked
[L] form; the wrapper's checks; the engine's use of it (CPU only); and XLA's path when the
library is hidden."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels_cpu
from jaxserve.loading import checkpoint, gguf_blocks
from jaxserve.model import kernel_forms, quant, quant_linear
from kernels_cpu import library
from kernels_cpu.reference import packed, qmatmul_reference, tiled, unpacked, untiled
from support.gguf_random import random_blocks

# Every test but the hidden-library one needs the library (that one runs without it too).
built = pytest.mark.skipif(not kernels_cpu.available(), reason="kernels_cpu not built")

TOLERANCE = 1e-4  # Of the largest |y|: float32 accumulation in another order.


def blocks_of(type_name: str, rows: int, cols: int, rng) -> gguf_blocks.Blocks:
  """A [rows, cols] matrix (torch layout: groups along each row) of `type_name`'s random blocks,
  or int8 with one scale per row ("int8")."""
  if type_name == "int8":
    values = rng.integers(-127, 128, (rows, cols), dtype=np.int8)
    return gguf_blocks.Blocks(values, rng.random((rows, 1), dtype=np.float32) * 0.01, None)
  return gguf_blocks.unpack(random_blocks(type_name, rows, cols, rng), type_name, (rows, cols))


def operands(b: gguf_blocks.Blocks, nk: bool):
  """(values, scale, minimum) as the kernel takes them: [N, K] as stored (nk) or transposed."""
  f = (lambda a: a) if nk else (lambda a: np.ascontiguousarray(a.T))
  return tuple(None if a is None else jnp.asarray(f(a)) for a in (b.values, b.scale, b.minimum))


# The block types whose values are 4 bits without a sign: packed two a byte for the kernel.
PACKABLE = ("Q4_1", "Q4_K")


def relative_error(y, ref) -> float:
  return float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))


@built
@pytest.mark.parametrize("isa", library.supported_isas())
@pytest.mark.parametrize("nk", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("type_name", [*gguf_blocks.READERS, "int8"])
def test_sweep_matches_the_reference(type_name, nk, isa):
  """N = 202 leaves kn columns past the last whole tile and, not a multiple of 4, nk rows of W
  past the last four-row tile (the one-row `NK` tile); M reaches every row tile: 1 to 8 rows
  (one row, a verifying chunk of 7, and the remainders 2-7 after blocks of 8), blocks of 8
  and a remainder."""
  rng = np.random.default_rng(0)
  values, scale, minimum = operands(blocks_of(type_name, 202, 512, rng), nk)
  for M in (1, 2, 3, 4, 5, 6, 7, 8, 17, 64):
    x = jnp.asarray(rng.standard_normal((M, 512), dtype=np.float32))
    y = kernels_cpu.qmatmul(x, values, scale, minimum, nk=nk, isa=isa)
    ref = qmatmul_reference(x, values, scale, minimum, nk=nk)
    assert y.shape == (M, 202) and relative_error(y, ref) <= TOLERANCE, (M, relative_error(y, ref))


@built
@pytest.mark.parametrize("isa", library.supported_isas())
@pytest.mark.parametrize("type_name", PACKABLE)
def test_packed_values_match_the_reference(type_name, isa):
  """kn values two a byte: the same products as the int8 values they pack."""
  rng = np.random.default_rng(2)
  values, scale, minimum = operands(blocks_of(type_name, 200, 512, rng), nk=False)
  four_bits = jnp.asarray(packed(np.asarray(values), axis=0))
  assert four_bits.shape == (256, 200) and four_bits.dtype == jnp.uint8
  for M in (1, 3, 5, 8, 17, 64):
    x = jnp.asarray(rng.standard_normal((M, 512), dtype=np.float32))
    y = kernels_cpu.qmatmul(x, four_bits, scale, minimum, isa=isa)
    ref = qmatmul_reference(x, values, scale, minimum)
    assert relative_error(y, ref) <= TOLERANCE, (M, relative_error(y, ref))


@built
@pytest.mark.parametrize("isa", library.supported_isas())
@pytest.mark.parametrize("type_name", [*gguf_blocks.READERS, "int8", "Q4_1 packed"])
def test_tiled_arrays_give_the_same_products(type_name, isa):
  """kn arrays in tiles of 64 columns (N = 192: three tiles), one matrix and layer 1 of a
  stacked [2, ...] one: the bits of the same arrays as stored, and the reference."""
  rng = np.random.default_rng(3)
  name, four_bits = type_name.split()[0], type_name.endswith("packed")
  layers = [operands(blocks_of(name, 192, 256, rng), nk=False) for _ in range(2)]
  stack = [None if a[0] is None else np.stack([np.asarray(x) for x in a]) for a in zip(*layers)]
  if four_bits:
    stack[0] = packed(stack[0], axis=1)
  as_tiles = [None if a is None else jnp.asarray(tiled(a)) for a in stack]
  stack = [None if a is None else jnp.asarray(a) for a in stack]
  for M in (1, 3, 8, 17):
    x = jnp.asarray(rng.standard_normal((M, 256), dtype=np.float32))
    y = kernels_cpu.qmatmul(x, *as_tiles, layer=1, tiled=True, isa=isa)
    assert (y == kernels_cpu.qmatmul(x, *stack, layer=1, isa=isa)).all(), M
    ref = qmatmul_reference(x, *as_tiles, layer=1, tiled=True)
    assert relative_error(y, ref) <= TOLERANCE, (M, relative_error(y, ref))


def test_tiling_by_hand():
  a = np.arange(2 * 128).reshape(2, 128)  # [R = 2, N = 128]: two tiles of 64 columns.
  t = tiled(a)
  assert t.shape == a.shape
  assert t.ravel().tolist() == [*range(64), *range(128, 192), *range(64, 128), *range(192, 256)]
  assert (np.asarray(untiled(jnp.asarray(t))) == a).all()
  with pytest.raises(ValueError, match="do not divide N = 100"):
    tiled(np.zeros((2, 100)))


def test_packing_by_hand():
  values = np.array([[1, 15], [2, 0], [3, 4], [0, 9]], np.int8)  # [K = 4, N = 2]
  assert packed(values, axis=0).tolist() == [[0x21, 0x0F], [0x03, 0x94]]
  assert unpacked(jnp.asarray(packed(values, axis=0)), axis=0).tolist() == values.tolist()
  with pytest.raises(ValueError, match="packing needs values in"):
    packed(np.array([[-1], [2]], np.int8), axis=0)


@built
def test_the_library_reports_the_isa_auto_runs():
  """dispatched_isa (the library's own CPUID check) is the widest /proc/cpuinfo names, and
  isa="auto" gives that ISA's bits exactly."""
  assert library.dispatched_isa() == library.supported_isas()[-1]
  rng = np.random.default_rng(5)
  values, scale, minimum = operands(blocks_of("Q4_1", 96, 256, rng), nk=False)
  x = jnp.asarray(rng.standard_normal((3, 256), dtype=np.float32))
  auto = kernels_cpu.qmatmul(x, values, scale, minimum)
  named = kernels_cpu.qmatmul(x, values, scale, minimum, isa=library.dispatched_isa())
  assert np.array_equal(np.asarray(auto), np.asarray(named))


@built
@pytest.mark.parametrize("nk", [False, True], ids=["kn", "nk"])
def test_the_largest_prefill_bucket(nk):
  rng = np.random.default_rng(1)
  values, scale, minimum = operands(blocks_of("Q4_1", 576, 576, rng), nk)
  x = jnp.asarray(rng.standard_normal((512, 576), dtype=np.float32))
  y = jax.jit(lambda x: kernels_cpu.qmatmul(x, values, scale, minimum, nk=nk))(x)
  assert relative_error(y, qmatmul_reference(x, values, scale, minimum, nk=nk)) <= TOLERANCE


@built
def test_the_reference_by_hand():
  """W [K=2, N=2] in groups of 2 along K: column 0 scale 0.5, minimum 1; column 1 scale 2, no
  shift. x = [1, 3]: y0 = 1 * (2 * 0.5 + 1) + 3 * (-4 * 0.5 + 1) = -1; y1 = 1 * 2 * -1 +
  3 * 2 * 3 = 16."""
  values = jnp.asarray([[2, -1], [-4, 3]], jnp.int8)
  scale = jnp.asarray([[0.5, 2.0]], jnp.float32)
  minimum = jnp.asarray([[1.0, 0.0]], jnp.float32)
  x = jnp.asarray([[1.0, 3.0]], jnp.float32)
  assert qmatmul_reference(x, values, scale, minimum).tolist() == [[-1.0, 16.0]]
  assert qmatmul_reference(x, values.T, scale.T, minimum.T, nk=True).tolist() == [[-1.0, 16.0]]
  assert kernels_cpu.qmatmul(x, values, scale, minimum, isa="scalar").tolist() == [[-1.0, 16.0]]


@built
@pytest.mark.parametrize("nk", [False, True], ids=["kn", "nk"])
def test_stacked_layers_read_by_index_inside_a_scan(nk):
  """values [L, ...] with the scan's index: each step's product is its own layer's."""
  rng = np.random.default_rng(2)
  layers = [operands(blocks_of("Q4_K", 96, 256, rng), nk) for _ in range(3)]
  values, scale, minimum = (jnp.stack(a) for a in zip(*layers))
  x = jnp.asarray(rng.standard_normal((4, 256), dtype=np.float32))

  def body(_, i):
    return None, kernels_cpu.qmatmul(x, values, scale, minimum, nk=nk, layer=i)

  _, ys = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(3)))()
  for i, (v, s, m) in enumerate(layers):
    assert relative_error(ys[i], qmatmul_reference(x, v, s, m, nk=nk)) <= TOLERANCE


@built
def test_the_wrapper_refuses_what_the_kernel_cannot_take():
  v, s = jnp.zeros((64, 8), jnp.int8), jnp.ones((2, 8), jnp.float32)
  x = jnp.zeros((1, 64), jnp.float32)
  with pytest.raises(ValueError, match="inputs"):
    kernels_cpu.qmatmul(jnp.zeros((1, 32)), v, s)
  with pytest.raises(ValueError, match="int8"):
    kernels_cpu.qmatmul(x, v.astype(jnp.float32), s)
  with pytest.raises(ValueError, match="does not group"):
    kernels_cpu.qmatmul(x, v, jnp.ones((3, 8), jnp.float32))
  with pytest.raises(ValueError, match="minimum"):
    kernels_cpu.qmatmul(x, v, s, jnp.ones((2, 4), jnp.float32))
  with pytest.raises(ValueError, match="isa"):
    kernels_cpu.qmatmul(x, v, s, isa="neon")
  with pytest.raises(ValueError, match="packed, kn only"):  # Packed values in the nk layout.
    kernels_cpu.qmatmul(x, jnp.zeros((8, 32), jnp.uint8), jnp.ones((8, 2), jnp.float32), nk=True)


def quantized(shape, blocks: gguf_blocks.Blocks, in_axes) -> quant.Quantized:
  """A Quantized weight of `shape` holding Blocks already in its layout (groups of 32)."""
  w = quant.Quantized(shape, (None,) * len(shape), quant.Layout(32, True), in_axes)
  w.values[...] = jnp.asarray(blocks.values).reshape(shape)
  w.scale[...] = jnp.asarray(blocks.scale).reshape(w.scale.shape)
  w.minimum[...] = jnp.asarray(blocks.minimum).reshape(w.scale.shape)
  return w


@built
def test_linear_runs_the_kernel_on_cpu_and_xla_elsewhere():
  """quant_linear.linear of a quantized wq [D, N, H]: the CPU program calls the kernel and gives the
  dequantized einsum's numbers; lowered for a TPU, the program has no CPU custom call."""
  rng = np.random.default_rng(3)
  D, N, H = 64, 4, 16
  raw = blocks_of("Q4_1", N * H, D, rng)  # torch [out = N * H, in = D]
  t = lambda a: np.ascontiguousarray(a.T)
  w = quantized((D, N, H), gguf_blocks.Blocks(t(raw.values), t(raw.scale), t(raw.minimum)),
                (0,))
  x = jnp.asarray(rng.standard_normal((1, 3, D), dtype=np.float32))
  f = lambda w, x: quant_linear.linear("BTD,DNH->BTNH", x, w)
  want = jnp.einsum("BTD,DNH->BTNH", x, quant.dequant(w, jnp.float32))
  assert relative_error(nnx.jit(f)(w, x), want) <= TOLERANCE
  graphdef, state = nnx.split(w)
  g = jax.jit(lambda state, x: f(nnx.merge(graphdef, state), x))
  assert "jaxserve_qmatmul" in g.lower(state, x).as_text()
  tpu = g.trace(state, x).lower(lowering_platforms=("tpu",)).as_text()
  assert "jaxserve_qmatmul" not in tpu and "dot_general" in tpu
  # Traced for a GPU from this CPU (compiling/targets.py), the program holds no kernel branch, and
  # the scan slices its layers as XLA's path has them.
  with quant_linear.lowering_for("cuda"):
    assert not quant_linear.reads_in_place()
    traced = str(jax.make_jaxpr(lambda state, x: f(nnx.merge(graphdef, state), x))(state, x))
  assert "platform_index" not in traced and "jaxserve_qmatmul" not in traced


@built
def test_packed_for_kernel_packs_4_bit_layers_only():
  """A stacked Q4_1 weight [L, D, F] is packed along D (its input axis), a signed one (Q6_K's
  -32..31) is not; layouts_of reads 4 bits back, and the packed weight's dequantized numbers
  and its linear through the kernel are the int8 weight's."""
  rng = np.random.default_rng(5)
  L, D, F = 2, 64, 48
  four = [blocks_of("Q4_1", F, D, rng) for _ in range(L)]
  t = lambda a: np.ascontiguousarray(a.T)
  stack = lambda f: np.stack([t(f(b)) for b in four])
  up = {"values": stack(lambda b: b.values), "scale": stack(lambda b: b.scale),
        "minimum": stack(lambda b: b.minimum)}
  signed = dict(up, values=up["values"] - 32)
  params = {"layers": {"w_up": up, "w_gate": signed}}
  out = kernel_forms.packed(params)["layers"]
  assert out["w_up"]["values"].dtype == np.uint8 and out["w_up"]["values"].shape == (L, D // 2, F)
  assert out["w_gate"]["values"] is signed["values"]
  layouts = quant.layouts_of({"layers": out})
  assert layouts["w_up"] == quant.Layout(32, True, bits=4)
  assert layouts["w_gate"] == quant.Layout(32, True)
  w4 = quant.Quantized((D, F), (None, None), layouts["w_up"], (0,))
  w8 = quant.Quantized((D, F), (None, None), layouts["w_gate"], (0,))
  for w, values in ((w4, out["w_up"]["values"][1]), (w8, up["values"][1])):
    w.values[...] = jnp.asarray(values)
    w.scale[...], w.minimum[...] = jnp.asarray(up["scale"][1]), jnp.asarray(up["minimum"][1])
  assert (quant.dequant(w4, jnp.float32) == quant.dequant(w8, jnp.float32)).all()
  x = jnp.asarray(rng.standard_normal((1, 1, D), dtype=np.float32))
  f = lambda w, x: quant_linear.linear("BTD,DF->BTF", x, w)
  assert relative_error(nnx.jit(f)(w4, x), nnx.jit(f)(w8, x)) <= TOLERANCE


@built
def test_layers_in_tiles_give_the_weights_numbers():
  """kernel_forms.tiled stores a stacked weight whose output columns make whole tiles of 64
  (wq [L, D, N, H] with N * H = 128, packed Q4_1) in tiles and names it, leaves one that does
  not (w_up [L, D, 48]) as it is; the tiled weight's dequantized numbers (XLA's path) and its
  linear through the kernel are the untiled weight's."""
  rng = np.random.default_rng(6)
  L, D, N, H = 2, 64, 2, 64
  t = lambda a: np.ascontiguousarray(a.T)
  four = [blocks_of("Q4_1", N * H, D, rng) for _ in range(L)]
  stack = lambda f, shape: np.stack([t(f(b)).reshape(shape) for b in four])
  wq = {"values": packed(stack(lambda b: b.values, (D, N, H)), 1),
        "scale": stack(lambda b: b.scale, (D // 32, N, H)),
        "minimum": stack(lambda b: b.minimum, (D // 32, N, H))}
  up = {k: a[..., :48].reshape(L, a.shape[1], 48) for k, a in
        (("values", wq["values"][:, :, 0]), ("scale", wq["scale"][:, :, 0]),
         ("minimum", wq["minimum"][:, :, 0]))}
  params, names = kernel_forms.tiled({"layers": {"wq": wq, "w_up": up}})
  assert names == {"wq"} and params["layers"]["w_up"] is up
  assert all(params["layers"]["wq"][k].shape == wq[k].shape for k in wq)
  assert not (params["layers"]["wq"]["values"] == wq["values"]).all()
  layouts = quant.layouts_of(params, names)
  assert layouts["wq"] == quant.Layout(32, True, bits=4, tiled=True) and not layouts["w_up"].tiled
  ws = {}
  for name, arrays, layout in (("tiled", params["layers"]["wq"], layouts["wq"]),
                               ("as stored", wq, quant.Layout(32, True, bits=4))):
    w = ws[name] = quant.Quantized((D, N, H), (None, None, None), layout, (0,))
    for k in wq:
      getattr(w, k)[...] = jnp.asarray(arrays[k][1])
  assert (quant.dequant(ws["tiled"], jnp.float32) == quant.dequant(ws["as stored"],
                                                                    jnp.float32)).all()
  x = jnp.asarray(rng.standard_normal((1, 3, D), dtype=np.float32))
  f = nnx.jit(lambda w, x: quant_linear.linear("BTD,DNH->BTNH", x, w))
  assert (f(ws["tiled"], x) == f(ws["as stored"], x)).all()


@built
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"])
def test_the_tied_embedding_in_tiles_is_one_copy_for_lookup_and_head(type_name):
  """A tied embedding [V, D] is stored as the head's [D, V] in tiles (kernel_forms.tiled; not
  when an lm_head is its own weight): the rows the lookup reads, the head's logits through the
  kernel and the dequantized numbers are the embedding's as stored."""
  rng = np.random.default_rng(7)
  V, D = 192, 64
  b = blocks_of(type_name, V, D, rng)  # [V, D], groups along D.
  embed = {"values": b.values, "scale": b.scale}
  if b.minimum is not None:
    embed["minimum"] = b.minimum
  params, names = kernel_forms.tiled({"layers": {}, "embed": embed})
  assert names == {"embed"}
  assert kernel_forms.tiled({"layers": {}, "embed": embed, "lm_head": embed})[1] == set()
  ws = {}
  for name, arrays in (("tiled", params["embed"]), ("as stored", embed)):
    layout = quant.layouts_of({"embed": arrays}, names if name == "tiled" else frozenset())
    w = ws[name] = quant.Quantized((V, D), (None, None), layout["embed"], (1,))
    for k in arrays:
      getattr(w, k)[...] = jnp.asarray(arrays[k])
  assert ws["tiled"].tiled and not ws["as stored"].tiled
  ids = jnp.asarray([[0, 5, 63, 64, 191]])
  lookup = nnx.jit(lambda w, ids: quant.embed(ids, w, jnp.float32))
  assert (lookup(ws["tiled"], ids) == lookup(ws["as stored"], ids)).all()
  assert (quant.dequant(ws["tiled"], jnp.float32) == quant.dequant(ws["as stored"],
                                                                    jnp.float32)).all()
  x = jnp.asarray(rng.standard_normal((1, 3, D), dtype=np.float32))
  head = nnx.jit(lambda w, x: quant_linear.linear("...D,VD->...V", x, w))
  assert relative_error(head(ws["tiled"], x), head(ws["as stored"], x)) <= TOLERANCE


def test_without_the_library_xla_runs_and_says_so_once(monkeypatch, tmp_path, caplog):
  """The library hidden (as on a machine that had no compiler at install): available() is False
  with one log line, `auto` keeps float weights, and quant_linear.linear gives the same numbers
  through XLA."""
  built_here = kernels_cpu.available()
  rng = np.random.default_rng(4)
  raw = blocks_of("Q8_0", 32, 64, rng)
  t = lambda a: np.ascontiguousarray(a.T)
  w = quant.Quantized((64, 32), (None, None), quant.Layout(32, False), (0,))
  w.values[...], w.scale[...] = jnp.asarray(t(raw.values)), jnp.asarray(t(raw.scale))
  x = jnp.asarray(rng.standard_normal((2, 1, 64), dtype=np.float32))
  f = lambda w, x: quant_linear.linear("BTD,DF->BTF", x, w)
  with_kernel = nnx.jit(f)(w, x)
  try:
    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="jaxserve"):
      patch.setattr(library, "library_path", lambda: None)
      library.available.cache_clear()
      assert not kernels_cpu.available() and not kernels_cpu.available()
      assert not checkpoint.blocks_are_faster("cpu")  # --quantization auto keeps float.
      graphdef, state = nnx.split(w)
      g = jax.jit(lambda state, x: f(nnx.merge(graphdef, state), x))
      assert "jaxserve_qmatmul" not in g.lower(state, x).as_text()
      assert relative_error(g(state, x), with_kernel) <= TOLERANCE
    assert sum("CPU kernels not built" in r.message for r in caplog.records) == 1
  finally:
    library.available.cache_clear()
  assert kernels_cpu.available() is built_here

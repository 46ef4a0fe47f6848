"""The model and the engine's cached prefill/decode against a full forward with no cache reuse."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.batching.plan import PrefillChunk, StepKind, StepPlan
from jaxserve.batching.request import FinishReason, RequestRejected
from jaxserve.batching.runner import Runner
from jaxserve.config import SamplingParams, SchedulerConfig
from jaxserve.engine.engine import Engine
from jaxserve.model.llama import Transformer
from support.engine_calls import decode, prefill
from support.mock_engine import MockTokenizer
from support.tiny import TINY, TINY_ENGINE, dense_forward, dense_logits

GREEDY = SamplingParams(temperature=0, logprobs=1)  # Logprobs are computed only when asked.


def chunk(slot, ids, start, table, last, prompt=()):
  return PrefillChunk("r", slot, ids, start, table, last, GREEDY, 0, prompt, ())


def log_softmax(x):
  return np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))


def test_chunked_prefill_and_decode_match_dense_forward(tiny_model):
  """Two sequences in two slots, one prefilled in two chunks: each token and its logprob equal
  those of a full forward over the sequence so far."""
  engine = Engine(tiny_model, TINY_ENGINE)
  rng = np.random.default_rng(0)
  a, b = list(rng.integers(2, 128, 21)), list(rng.integers(2, 128, 9))
  tables = np.zeros((4, 8), np.int32)
  tables[0, :4], tables[2, :3] = [5, 9, 2, 7], [11, 3, 4]
  prefill(engine, chunk(0, a[:13], 0, tables[0, :2], False))
  out_a = prefill(engine, chunk(0, a[13:], 13, tables[0, :3], True, a))
  out_b = prefill(engine, chunk(2, b, 0, tables[2, :2], True, b))
  seqs = {0: a + [int(out_a.result()[0])], 2: b + [int(out_b.result()[0])]}
  firsts = {0: out_a, 2: out_b}
  for slot, fut in firsts.items():
    ref = log_softmax(dense_logits(tiny_model, seqs[slot][:-1])[-1])
    assert seqs[slot][-1] == ref.argmax()
    np.testing.assert_allclose(fut.logprobs()[0][0], ref.max(), atol=1e-4)
  for _ in range(6):
    out = decode(engine, [0, 2], tables[:, :4])
    tokens, logprobs = out.result(), out.logprobs()[0]
    for slot in (0, 2):
      ref = log_softmax(dense_logits(tiny_model, seqs[slot])[-1])
      assert tokens[slot] == ref.argmax()
      np.testing.assert_allclose(logprobs[slot], ref.max(), atol=1e-4)
      seqs[slot].append(int(tokens[slot]))


def test_prefill_on_cached_prefix_matches_full_prefill(tiny_model):
  """A second sequence that shares the first's first page only prefills the rest."""
  engine = Engine(tiny_model, TINY_ENGINE)
  ids = list(np.random.default_rng(1).integers(2, 128, 20))
  prefill(engine, chunk(0, ids, 0, [1, 2, 3], True, ids))
  other = ids[:8] + list(np.random.default_rng(2).integers(2, 128, 7))
  out = prefill(engine, chunk(1, other[8:], 8, [1, 4], True, other))  # Page 1 holds ids[:8].
  ref = log_softmax(dense_logits(tiny_model, other)[-1])
  assert out.result()[0] == ref.argmax()
  np.testing.assert_allclose(out.logprobs()[0][0], ref.max(), atol=1e-4)


def test_parameters_carry_logical_axis_names(tiny_model):
  specs = nnx.get_partition_spec(nnx.state(tiny_model))
  assert tuple(specs["layers"]["wq"].get_value()) == ("layers", "embed", "heads", "head_dim")
  assert tuple(specs["layers"]["wk"].get_value()) == ("layers", "embed", "kv_heads", "head_dim")
  assert tuple(specs["layers"]["w_down"].get_value()) == ("layers", "mlp", "embed")
  assert tuple(specs["embed"].get_value()) == ("vocab", "embed")


def test_layers_run_under_one_scan_whatever_the_depth():
  """The traced program has the same size for 2 and 8 layers: compile time does not grow with
  depth."""

  def num_eqns(num_layers):
    model = Transformer(dataclasses.replace(TINY, num_layers=num_layers), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    forward = lambda state, ids: dense_forward(nnx.merge(graphdef, state), ids, 16)
    return len(jax.make_jaxpr(forward)(state, jnp.arange(32)).eqns)

  assert num_eqns(2) == num_eqns(8)


def test_unrolled_layers_give_the_scans_logits_from_views_of_its_weights(tiny_model):
  """unstacked: a list of layers whose logits are the scan's, each weight a view of the stacked
  array on CPU (no copy), split by the same names less the layer axis; the model is left
  stacked."""
  from jaxserve.model.llama import unstacked

  ids = list(range(3, 40))
  ref = dense_logits(tiny_model, ids)
  unrolled = unstacked(tiny_model)
  stacked = tiny_model.layers.w_up[...]
  assert isinstance(tiny_model.layers.w_up, nnx.Param) and stacked.shape[0] == 2
  for i, layer in enumerate(unrolled.layers):
    assert layer.w_up[...].unsafe_buffer_pointer() == (stacked.unsafe_buffer_pointer()
                                                        + i * stacked[0].nbytes)
  specs = nnx.get_partition_spec(nnx.state(unrolled))
  assert tuple(specs["layers"][1]["wq"].get_value()) == ("embed", "heads", "head_dim")
  np.testing.assert_array_equal(dense_logits(unrolled, ids), ref)


def test_an_unrolled_step_reads_every_weight_in_place(tiny_model):
  """With unroll_layers, every instruction of the compiled step that reads a
  layer's matmul weight (directly or through a bitcast) is a matmul: no copy of it is made."""
  import re

  engine = Engine(tiny_model, dataclasses.replace(TINY_ENGINE, unroll_layers=True))
  args, _ = engine.step_args(StepPlan(decode_slots=(0, 1), page_tables=np.zeros((2, 4), np.int32)))
  hlo = engine._steps[StepKind.PLAIN].lower(engine.params, engine.cache, engine.state, args,
                           engine.stop_ids).compile().as_text()
  line = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\((%[^)]*)\)(.*)$")
  weights = set(re.findall(r"%(params__layers_\w*?_(?:wq|wk|wv|wo|w_gate|w_up|w_down)___value"
                           r"[\w.]*) = ", hlo))
  assert weights
  readers = []
  for name, opcode, operands, rest in (m.groups() for m in map(line.match, hlo.splitlines()) if m):
    if weights & set(re.findall(r"%([\w.\-]+)", operands)):
      if opcode == "bitcast":
        weights.add(name)
      else:
        readers.append(opcode if opcode != "fusion" else re.search(r'op_name="([^"]*)"', rest)[1])
  assert readers and all(r == "dot" or r.endswith("dot_general") for r in readers), readers


def test_the_layers_scan_unless_unroll_layers_asks(tiny_model):
  """unroll_layers False (the default): one scan over the stacked [L, ...] weights; True: a list
  of per-layer weights, quantized ones too."""
  from jaxserve.config import Quantization
  from jaxserve.model import quant

  int8 = Transformer(TINY, rngs=nnx.Rngs(0), quant_layouts=quant.layouts_for(Quantization.INT8))
  unroll = dataclasses.replace(TINY_ENGINE, unroll_layers=True)
  assert "wq" in Engine(tiny_model, TINY_ENGINE).params["layers"]  # Stacked [L, ...].
  assert 0 in Engine(tiny_model, unroll).params["layers"]  # A list: layer 0's weights.
  assert 0 in Engine(int8, unroll).params["layers"]


def test_bfloat16_model_tracks_float32(tiny_model):
  from jaxserve.loading.checkpoint import build_model

  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(tiny_model)))
  bf16 = build_model(TINY, params, "bfloat16")
  assert bf16.layers.wq[...].dtype == jnp.bfloat16
  ids = list(range(3, 30))
  f32, b16 = dense_logits(tiny_model, ids), dense_logits(bf16, ids)
  assert b16.dtype == jnp.float32  # Logits always come out in float32.
  assert float(jnp.max(jnp.abs(f32 - b16))) < 0.1 * float(jnp.max(jnp.abs(f32)))


def test_a_pool_smaller_than_the_window_serves_the_window_it_holds(tiny_model, caplog):
  """Defect: the server advertised max_model_len 128 with 4 pages of 8 tokens, and every request
  without max_tokens was then refused. The engine now serves the 32 tokens the pool holds."""
  small = dataclasses.replace(TINY_ENGINE, num_pages=5)  # Page 0 is scratch: 4 x 8 tokens.
  with caplog.at_level("WARNING"):
    engine = Engine(tiny_model, small)
  assert engine.info.max_model_len == 32
  assert "serving max_model_len 32" in caplog.text
  assert Engine(tiny_model, TINY_ENGINE).info.max_model_len == 128  # 47 x 8 hold 128.


def test_a_model_with_fewer_positions_than_max_model_len_serves_its_own(checked, caplog):
  """Issue 29: a model of 1,024 positions under the default max_model_len of 2,048 crashed on its
  first decode ("cannot reshape array of size 512 into shape (8,128)"): the step was compiled for
  the config's 2,048 positions, the scheduler's page tables held the 1,024 the engine served.
  max_model_len is now clamped before any shape is set, so both are one width."""
  short = Transformer(dataclasses.replace(TINY, max_seq_len=64), rngs=nnx.Rngs(0))
  with caplog.at_level("WARNING"):
    engine = Engine(short, TINY_ENGINE)  # max_model_len 128.
  assert "more than the model's 64 positions: serving max_model_len 64" in caplog.text
  assert engine.info.max_model_len == engine.config.max_model_len == 64
  runner = checked(Runner(engine, MockTokenizer(), SchedulerConfig()))
  assert engine.packer.width == runner.scheduler.pools.tables.shape[1] == 64 // 8
  greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24)
  out, = runner.generate([(list(range(3, 43)), greedy)])  # 40 + 24: the whole window.
  assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 24
  with pytest.raises(RequestRejected, match="more than the context window of 64"):
    runner.add_request(list(range(3, 43)), dataclasses.replace(greedy, max_tokens=25))

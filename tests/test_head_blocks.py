"""The LM head kept in column blocks for a few rows on CPU (model/head_blocks.py): the same
logits as the head as stored, read only for 2..MAX_ROWS rows, and only for float heads."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import Quantization
from jaxserve.model import head_blocks, quant
from jaxserve.model.head_blocks import BLOCK, MAX_ROWS, with_head_blocks
from jaxserve.model.llama import Transformer
from support.tiny import TINY


def test_blocks_give_the_heads_logits(tiny_model):
  blocked = with_head_blocks(tiny_model)
  assert getattr(tiny_model, "head_blocks", None) is None  # The model is left as it was.
  # Tied: the embedding [128, 64] read as [64, 128], its 128 columns padded to one block.
  assert blocked.head_blocks[...].shape == (1, TINY.dim, BLOCK)
  x = jax.random.normal(jax.random.key(0), (5, TINY.dim))
  assert head_blocks.applies(blocked, x) and not head_blocks.applies(tiny_model, x)
  np.testing.assert_allclose(blocked.head(x), tiny_model.head(x), rtol=1e-5, atol=1e-5)
  x3 = x.reshape(1, 5, TINY.dim)
  np.testing.assert_allclose(blocked.head(x3), tiny_model.head(x3), rtol=1e-5, atol=1e-5)


def test_untied_head_and_more_columns_than_a_block():
  cfg = dataclasses.replace(TINY, tie_embeddings=False, vocab_size=BLOCK + 7)
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  blocked = with_head_blocks(model)
  assert blocked.head_blocks[...].shape == (2, cfg.dim, BLOCK)
  x = jax.random.normal(jax.random.key(1), (3, cfg.dim))
  got = blocked.head(x)
  assert got.shape == (3, cfg.vocab_size)
  np.testing.assert_allclose(got, model.head(x), rtol=1e-5, atol=1e-5)


def test_one_row_and_many_rows_read_the_head_as_stored(tiny_model):
  blocked = with_head_blocks(tiny_model)
  for rows in (1, MAX_ROWS + 1):
    assert not head_blocks.applies(blocked, jnp.zeros((rows, TINY.dim)))
  assert head_blocks.applies(blocked, jnp.zeros((MAX_ROWS, TINY.dim)))


def test_a_quantized_head_keeps_no_blocks():
  layouts = quant.layouts_for(Quantization.INT8)
  model = Transformer(TINY, rngs=nnx.Rngs(0), quant_layouts=layouts)
  assert with_head_blocks(model) is model


def test_an_engine_on_one_cpu_device_keeps_the_blocks(tiny_model):
  from jaxserve.engine.engine import Engine
  from support.tiny import TINY_ENGINE
  engine = Engine(tiny_model, TINY_ENGINE)
  assert engine.params["head_blocks"][...].shape == (1, TINY.dim, BLOCK)

"""The LM head kept a second time, as column blocks [Vb, D, Vk], for the steps that sample a
few rows at once on XLA:CPU: verified chunks (k + 1 rows), batched decode, prompts ending.

XLA:CPU runs the tied head [1, D] x [V, D]^T as a fast matrix-vector product, but two to sixteen
rows through its GEMM path at 2.5-3.5x that time (SmolLM2's [5, D] x [V, D]^T: 16.6 against
4.9 ms), while a scan over [D, C] blocks, the layout of the layers' own weights, takes 10-11 ms
(BENCHMARKS.md, "The LM head in column blocks"). So an engine on CPU keeps both: the head as the
model stores it for one row and for many, the blocks for 2..MAX_ROWS rows. It costs a second
copy of the head in host memory (SmolLM2 113 MB), read only by the programs that use it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

BLOCK = 2048  # Vk: columns a block (1,024 to 2,048 measured alike for SmolLM2's head).
MAX_ROWS = 32  # Up to here the blocks beat the head as stored; at 64 rows they are even.


def with_head_blocks(model):
  """A copy of `model` whose head is also kept in blocks (`head_blocks`), or `model` itself
  when its head is stored quantized (the blocks are for float weights). `model` is left as
  it is; the copy shares every other array."""
  tied = model.cfg.tie_embeddings
  weight = model.embed if tied else model.lm_head
  if type(weight) is not nnx.Param:
    return model
  model = nnx.clone(model)
  model.head_blocks = nnx.Variable(blocks_of(weight[...].T if tied else weight[...]))
  return model


def blocks_of(w_DV):
  """The head [D, V] as [Vb, D, Vk] blocks of its columns (Vb = ceil(V / Vk)), the last padded
  with 0."""
  D, V = w_DV.shape
  pad = -V % BLOCK
  blocks = jnp.pad(w_DV, ((0, 0), (0, pad))).reshape(D, (V + pad) // BLOCK, BLOCK)
  return jnp.transpose(blocks, (1, 0, 2))


def applies(model, x) -> bool:
  """Whether the head of `x` [..., D] reads the blocks: kept, and 2..MAX_ROWS rows."""
  rows = x.size // x.shape[-1]
  return getattr(model, "head_blocks", None) is not None and 1 < rows <= MAX_ROWS


def logits(x, blocks, vocab_size: int):
  """x [..., D] -> x times the head [..., V], one block of columns at a time."""
  lead, D = x.shape[:-1], x.shape[-1]
  x_BD = x.reshape(-1, D)
  _, y_VbBVk = jax.lax.scan(lambda carry, w_DVk: (carry, x_BD @ w_DVk), None, blocks)
  y_BV = jnp.transpose(y_VbBVk, (1, 0, 2)).reshape(x_BD.shape[0], -1)[:, :vocab_size]
  return y_BV.reshape(*lead, vocab_size)

"""Gemma 3's image encoder in Flax NNX: the SigLIP vision tower and the projector into the text
model, one image shape (VisionConfig.image_size), so one compiled program serves every image.

Shape letters: the key in jaxserve/model/__init__.py (Im, Pt, Dv, Nv, Hd, Fv, Mi: the vision
letters), with D the text model's width.

SigLIP: the image cut into patch_size squares (a strided convolution, here a reshape and one
matmul), a learned position per patch, then pre-norm encoder layers (LayerNorm with a bias,
multi-head attention over all patches with biases, a tanh-GeLU MLP), then a last LayerNorm.
Gemma 3's projector averages each pool x pool square of patches into one soft token, RMSNorms it
(Gemma's 1 + weight) and projects it to the text model's width. The tower's own attention-pooling
head is not used by Gemma 3, and is not loaded.

The weights are float and replicated over a mesh (their logical axis names are in no sharding
rule): the tower is a few percent of the model, and an image is encoded once per request.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.config.vision import VisionConfig


def _param(rngs: nnx.Rngs, shape, dtype, fan_in: int | None = None, value: float = 0.0):
  """A tower parameter: random (fan_in) for tests, else the constant `value`."""
  if fan_in is None:
    x = jnp.full(shape, value, dtype)
  else:
    x = (jax.random.normal(rngs.params(), shape) / jnp.sqrt(fan_in)).astype(dtype)
  return nnx.Param(x, out_sharding=("vision",) * len(shape), eager_sharding=False)


def layer_norm(x, scale, bias, eps: float):
  """LayerNorm in float32, back to x's dtype."""
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, -1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias
  return y.astype(x.dtype)


class VisionLayer(nnx.Module):
  """One SigLIP encoder layer: x + attention(norm(x)), then x + MLP(norm(x))."""

  def __init__(self, v: VisionConfig, dtype, rngs: nnx.Rngs):
    Dv, Nv, Fv = v.dim, v.num_heads, v.hidden_dim
    Hd = Dv // Nv
    self.eps = v.norm_eps
    self.norm1_w, self.norm1_b = _param(rngs, (Dv,), dtype, value=1.0), _param(rngs, (Dv,), dtype)
    self.wq, self.wk, self.wv = (_param(rngs, (Dv, Nv, Hd), dtype, Dv) for _ in range(3))
    self.bq, self.bk, self.bv = (_param(rngs, (Nv, Hd), dtype) for _ in range(3))
    self.wo, self.bo = _param(rngs, (Nv, Hd, Dv), dtype, Dv), _param(rngs, (Dv,), dtype)
    self.norm2_w, self.norm2_b = _param(rngs, (Dv,), dtype, value=1.0), _param(rngs, (Dv,), dtype)
    self.w1, self.b1 = _param(rngs, (Dv, Fv), dtype, Dv), _param(rngs, (Fv,), dtype)
    self.w2, self.b2 = _param(rngs, (Fv, Dv), dtype, Fv), _param(rngs, (Dv,), dtype)

  def __call__(self, x):
    """x [Im, Pt, Dv] -> [Im, Pt, Dv]."""
    h = layer_norm(x, self.norm1_w[...], self.norm1_b[...], self.eps)
    q = jnp.einsum("IPD,DNH->IPNH", h, self.wq[...]) + self.bq[...]  # [Im, Pt, Nv, Hd]
    k = jnp.einsum("IPD,DNH->IPNH", h, self.wk[...]) + self.bk[...]
    v = jnp.einsum("IPD,DNH->IPNH", h, self.wv[...]) + self.bv[...]
    out = attention(q, k, v)  # [Im, Pt, Nv, Hd]
    x = x + jnp.einsum("IPNH,NHD->IPD", out, self.wo[...]) + self.bo[...]
    h = layer_norm(x, self.norm2_w[...], self.norm2_b[...], self.eps)
    h = jax.nn.gelu(jnp.einsum("IPD,DF->IPF", h, self.w1[...]) + self.b1[...], approximate=True)
    return x + jnp.einsum("IPF,FD->IPD", h, self.w2[...]) + self.b2[...]


# Query patches whose scores are held at once: Gemma 3's 4,096 patches in 4 blocks, so the
# scores take [Im, Nv, 1024, Pt] (256 MiB a 16-head image), not [Im, Nv, Pt, Pt] (1 GiB).
QUERY_BLOCK = 1024


def attention(q, k, v):
  """q, k, v [Im, Pt, Nv, Hd] -> [Im, Pt, Nv, Hd]: every patch attends to every patch, the
  queries a block at a time (the softmax is each query's own: blocks change no value)."""
  Im, Pt, Nv, Hd = q.shape
  Qb = QUERY_BLOCK if Pt % QUERY_BLOCK == 0 else Pt

  def block(qb):  # [Im, Qb, Nv, Hd]
    scores = jnp.einsum("IQNH,IKNH->INQK", qb, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores * Hd ** -0.5, axis=-1).astype(v.dtype)
    return jnp.einsum("INQK,IKNH->IQNH", probs, v)

  blocks = q.reshape(Im, Pt // Qb, Qb, Nv, Hd).swapaxes(0, 1)  # [Pt / Qb, Im, Qb, Nv, Hd]
  return jax.lax.map(block, blocks).swapaxes(0, 1).reshape(Im, Pt, Nv, Hd)


class VisionTower(nnx.Module):
  """pixels [Im, 3, S, S] (the processor's, normalized) -> soft tokens [Im, Mi, D]."""

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    v = self.v = cfg.vision
    Dv, C = v.dim, 3 * v.patch_size ** 2
    self.patch_w = _param(rngs, (C, Dv), dtype, C)  # The convolution's [Dv, 3, p, p], flattened.
    self.patch_b = _param(rngs, (Dv,), dtype)
    self.position = _param(rngs, (v.num_patches, Dv), dtype, 1)
    self.layers = _stacked_layers(v, dtype, rngs)
    self.post_norm_w = _param(rngs, (Dv,), dtype, value=1.0)
    self.post_norm_b = _param(rngs, (Dv,), dtype)
    self.soft_norm = _param(rngs, (Dv,), dtype)  # Gemma's RMSNorm: zero-centred.
    self.project = _param(rngs, (Dv, cfg.dim), dtype, Dv)

  def __call__(self, pixels):
    v = self.v
    dtype = self.patch_w[...].dtype
    x = patches(pixels.astype(dtype), v.patch_size)  # [Im, Pt, 3 * p * p]
    x = x @ self.patch_w[...] + self.patch_b[...] + self.position[...]  # [Im, Pt, Dv]
    graphdef, state = nnx.split(self.layers)  # [Lv, ...]: one scan, one layer's compile.
    x = jax.lax.scan(lambda x, one: (nnx.merge(graphdef, one)(x), None), x, state)[0]
    x = layer_norm(x, self.post_norm_w[...], self.post_norm_b[...], v.norm_eps)
    return self.soft_tokens(x)

  def soft_tokens(self, x):
    """x [Im, Pt, Dv] the tower's output -> [Im, Mi, D]: pool x pool squares of patches
    averaged, RMSNormed, projected."""
    v, Im = self.v, x.shape[0]
    side, k = v.image_size // v.patch_size, v.pool
    x = x.reshape(Im, side // k, k, side // k, k, v.dim).astype(jnp.float32)
    x = x.mean(axis=(2, 4)).reshape(Im, v.mm_tokens_per_image, v.dim)  # Row-major squares.
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + v.norm_eps)
    x = x * (1.0 + self.soft_norm[...].astype(jnp.float32))
    return (x.astype(self.project[...].dtype) @ self.project[...])  # [Im, Mi, D]


def _stacked_layers(v: VisionConfig, dtype, rngs: nnx.Rngs):
  """v.num_layers VisionLayers as one module whose parameters lead with [Lv] (as
  llama.stacked_layers makes the text model's)."""
  @nnx.split_rngs(splits=v.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs: nnx.Rngs):
    return VisionLayer(v, dtype, rngs)

  return make(rngs)


def patches(pixels, p: int):
  """[Im, 3, S, S] -> [Im, Pt, 3 * p * p]: row-major patches, each flattened (channel, row,
  column), the order of a [Dv, 3, p, p] convolution kernel's flattening."""
  Im, C, S, _ = pixels.shape
  x = pixels.reshape(Im, C, S // p, p, S // p, p)
  return x.transpose(0, 2, 4, 1, 3, 5).reshape(Im, (S // p) ** 2, C * p * p)

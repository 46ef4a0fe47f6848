"""Qwen2.5-VL's vision tower in Flax NNX: one image's patches (batching/qwen_images.py's
preprocess, padded to an encoder bucket) -> its merged tokens, each of the text model's width.

Shape letters: the key in jaxserve/model/__init__.py (Pb, Cp, Dv, Nv, Hd, Fv, Mu: the vision
letters), with D the text model's width; the einsums spell Pb, Dv, Nv, Hd, Fv as P, D, N, H, F,
and Q, K for patches as queries and keys.

The patch embedding (a Conv3d whose stride is its kernel: one matmul, no bias), a 2-D rotary
per patch (a quarter of each head's dims rotate with its row, a quarter with its column, the
second half repeating the first), then pre-norm layers (RMSNorm, attention with biased q, k, v
and output, a SiLU-gated MLP with biases). The layers in config.full_layers attend over the whole
image, the others only within their window (patch_layout's window ids): transformers reorders
the patches window by window and back, which masks by window id compute without. The merger
RMSNorms each patch, concatenates each merge_unit consecutive patches (one merged token's) and
maps them through Linear, exact GELU, Linear to the text model's width.

Padding rows (window -1) are masked out of every real row's keys and attend to themselves only,
so their values stay finite and no real token sees them.

The weights are float and replicated over a mesh, as model/siglip.py's are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.config.qwen_vl import QwenVisionConfig
from jaxserve.model.siglip import _param

ROPE_THETA = 10000.0
# Query patches whose scores are held at once, for buckets of more patches than this: the scores
# take [Nv, 1024, Pb], not [Nv, Pb, Pb].
QUERY_BLOCK = 1024


def rms_norm(x, scale, eps: float):
  """RMSNorm in float32, back to x's dtype, then times scale (transformers' order)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)
  return y.astype(x.dtype) * scale


def rotary(pos, head_dim: int):
  """pos int32 [Pb, 2] (row, column) -> (cos, sin) float32 [Pb, Hd]: head_dim / 4 frequencies
  of the row, then as many of the column, the two halves of the head alike."""
  quarter = head_dim // 4
  inv_freq = 1.0 / ROPE_THETA ** (jnp.arange(quarter, dtype=jnp.float32) * 2 / (head_dim // 2))
  angles = (pos.astype(jnp.float32)[:, :, None] * inv_freq).reshape(pos.shape[0], -1)  # [Pb, Hd/2]
  angles = jnp.concatenate([angles, angles], -1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x, cos, sin):
  """x [Pb, Nv, Hd] rotated by cos, sin [Pb, Hd] (the halves paired), in float32."""
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], -1)
  return (x32 * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


def attention(q, k, v, window, full):
  """q, k, v [Pb, Nv, Hd], window int32 [Pb], full bool [] -> [Pb, Nv, Hd]: each real patch
  attends to the real patches of its window (or, `full`, of the image); padding rows to
  themselves. Queries a block at a time (the softmax is each query's own)."""
  Pb, Nv, Hd = q.shape
  Qb = QUERY_BLOCK if Pb % QUERY_BLOCK == 0 else Pb
  key_real = window >= 0

  def block(args):
    qb, win_q, index_q = args  # [Qb, Nv, Hd], [Qb], [Qb]
    same = jnp.where(full, win_q[:, None] >= 0, win_q[:, None] == window[None, :])
    mask = (same & key_real[None, :]) | (index_q[:, None] == jnp.arange(Pb)[None, :])  # [Qb, Pb]
    scores = jnp.einsum("QNH,KNH->NQK", qb, k, preferred_element_type=jnp.float32) * Hd ** -0.5
    scores = jnp.where(mask[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("NQK,KNH->QNH", probs, v)

  blocks = (q.reshape(Pb // Qb, Qb, Nv, Hd), window.reshape(Pb // Qb, Qb),
            jnp.arange(Pb).reshape(Pb // Qb, Qb))
  return jax.lax.map(block, blocks).reshape(Pb, Nv, Hd)


class QwenVisionLayer(nnx.Module):
  """One layer: x + attention(norm(x)), then x + MLP(norm(x))."""

  def __init__(self, v: QwenVisionConfig, dtype, rngs: nnx.Rngs):
    Dv, Nv, Fv = v.dim, v.num_heads, v.hidden_dim
    Hd = Dv // Nv
    self.eps = v.norm_eps
    self.norm1 = _param(rngs, (Dv,), dtype, value=1.0)
    self.wq, self.wk, self.wv = (_param(rngs, (Dv, Nv, Hd), dtype, Dv) for _ in range(3))
    self.bq, self.bk, self.bv = (_param(rngs, (Nv, Hd), dtype) for _ in range(3))
    self.wo, self.bo = _param(rngs, (Nv, Hd, Dv), dtype, Dv), _param(rngs, (Dv,), dtype)
    self.norm2 = _param(rngs, (Dv,), dtype, value=1.0)
    self.w_gate, self.b_gate = _param(rngs, (Dv, Fv), dtype, Dv), _param(rngs, (Fv,), dtype)
    self.w_up, self.b_up = _param(rngs, (Dv, Fv), dtype, Dv), _param(rngs, (Fv,), dtype)
    self.w_down, self.b_down = _param(rngs, (Fv, Dv), dtype, Fv), _param(rngs, (Dv,), dtype)

  def __call__(self, x, cos, sin, window, full):
    """x [Pb, Dv], cos, sin [Pb, Hd], window [Pb], full bool [] -> [Pb, Dv]."""
    h = rms_norm(x, self.norm1[...], self.eps)
    q = jnp.einsum("PD,DNH->PNH", h, self.wq[...]) + self.bq[...]  # [Pb, Nv, Hd]
    k = jnp.einsum("PD,DNH->PNH", h, self.wk[...]) + self.bk[...]
    v = jnp.einsum("PD,DNH->PNH", h, self.wv[...]) + self.bv[...]
    out = attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, window, full)
    x = x + jnp.einsum("PNH,NHD->PD", out, self.wo[...]) + self.bo[...]
    h = rms_norm(x, self.norm2[...], self.eps)
    gate = jax.nn.silu(h @ self.w_gate[...] + self.b_gate[...])  # [Pb, Fv]
    return x + (gate * (h @ self.w_up[...] + self.b_up[...])) @ self.w_down[...] + self.b_down[...]


class QwenVisionTower(nnx.Module):
  """patches [Pb, Cp], pos [Pb, 2], window [Pb] (batching/qwen_images.py's) -> merged tokens
  [Pb / Mu, D]; the rows of padding patches' tokens are garbage, to be dropped."""

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    v = self.v = cfg.vision
    Dv, Dm = v.dim, v.dim * v.merge_unit
    self.patch_w = _param(rngs, (v.patch_dim, Dv), dtype, v.patch_dim)  # [Dv, 3, T, p, p].T
    self.layers = _stacked_layers(v, dtype, rngs)
    self.merge_norm = _param(rngs, (Dv,), dtype, value=1.0)
    self.merge_w1, self.merge_b1 = _param(rngs, (Dm, Dm), dtype, Dm), _param(rngs, (Dm,), dtype)
    self.merge_w2 = _param(rngs, (Dm, v.out_dim), dtype, Dm)
    self.merge_b2 = _param(rngs, (v.out_dim,), dtype)

  def __call__(self, patches, pos, window):
    v = self.v
    dtype = self.patch_w[...].dtype
    x = patches.astype(dtype) @ self.patch_w[...]  # [Pb, Dv]
    cos, sin = rotary(pos, v.dim // v.num_heads)
    full = jnp.isin(jnp.arange(v.num_layers), jnp.asarray(v.full_layers, jnp.int32))  # [Lv]
    graphdef, state = nnx.split(self.layers)  # [Lv, ...]: one scan, one layer's compile.

    def layer(x, xs):
      one, is_full = xs
      return nnx.merge(graphdef, one)(x, cos, sin, window, is_full), None

    x = jax.lax.scan(layer, x, (state, full))[0]
    x = rms_norm(x, self.merge_norm[...], v.norm_eps).reshape(-1, v.dim * v.merge_unit)
    h = jax.nn.gelu(x @ self.merge_w1[...] + self.merge_b1[...], approximate=False)
    return h @ self.merge_w2[...] + self.merge_b2[...]  # [Pb / Mu, D]


def _stacked_layers(v: QwenVisionConfig, dtype, rngs: nnx.Rngs):
  """v.num_layers QwenVisionLayers as one module whose parameters lead with [Lv]."""
  @nnx.split_rngs(splits=v.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs: nnx.Rngs):
    return QwenVisionLayer(v, dtype, rngs)

  return make(rngs)

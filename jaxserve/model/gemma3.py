"""Gemma 3's text decoder in Flax NNX, over the same paged KV cache as llama.py's Transformer.

Shape letters: the key in jaxserve/model/__init__.py.

What differs from the Llama block: RMSNorm scales by (1 + weight), norms after attention and
after the MLP as well as before them, RMSNorm on each query and key head (qk-norm), a GeGLU MLP
(tanh gelu), embeddings scaled by sqrt(D), attention scaled by query_pre_attn_scalar ** -0.5,
and two kinds of layer: local ones attend to the last `sliding_window` positions with their own
RoPE base, global ones to everything. Those two differences are per-layer arrays scanned over
beside the weights, so one `lax.scan` runs every layer and compile time does not grow with depth.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model import attention, quant, quant_linear
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.llama import _weight, rms_norm, run_layers, stacked_layers
from jaxserve.model.rope import apply_rope
from jaxserve.model.siglip import VisionTower

NO_WINDOW = np.iinfo(np.int32).max  # A global layer's window: every position is inside it.


def norm(x, weight, eps: float):
  """Gemma's RMSNorm: the weight is stored zero-centred (as Hugging Face does) and scales by
  1 + weight in float32, so a bfloat16 weight near 0 keeps its precision."""
  return rms_norm(x, 1.0 + weight.astype(jnp.float32), eps)


def layer_rope(cfg: ModelConfig) -> np.ndarray:
  """[L, H/2] inverse frequencies: local layers at their own base, global layers at rope_theta
  divided by the linear factor (Hugging Face and llama.cpp scale only the global layers)."""
  exponents = np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim  # [H/2]
  local = 1.0 / (np.float32(cfg.rope_local_theta or cfg.rope_theta) ** exponents)
  full = 1.0 / (np.float32(cfg.rope_theta) ** exponents) / np.float32(cfg.rope_linear_factor or 1.0)
  return np.stack([local if is_local else full for is_local in _local_layers(cfg)])


def layer_windows(cfg: ModelConfig) -> np.ndarray:
  """[L] int32: each layer's attention window (NO_WINDOW for a global layer)."""
  windows = [cfg.sliding_window if is_local else NO_WINDOW for is_local in _local_layers(cfg)]
  return np.array(windows, np.int32)


def _local_layers(cfg: ModelConfig) -> tuple[bool, ...]:
  return cfg.local_layers or (False,) * cfg.num_layers


def _norm_param(shape, names, dtype) -> nnx.Param:
  # Zero-centred: 0 is the identity scale.
  return nnx.Param(jnp.zeros(shape, dtype), out_sharding=names, eager_sharding=False)


class Gemma3Block(nnx.Module):
  """One decoder layer: normed attention with qk-norm, then a normed GeGLU MLP."""

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quant_layouts=None):
    D, N, K, H, F = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_dim
    self.cfg = cfg
    w = lambda name, shape, names, fan_in: _weight(name, quant_layouts, rngs, shape, names, dtype,
                                                   fan_in)
    self.attn_norm = _norm_param((D,), ("embed",), dtype)
    self.wq = w("wq", (D, N, H), ("embed", "heads", "head_dim"), D)
    self.wk = w("wk", (D, K, H), ("embed", "kv_heads", "head_dim"), D)
    self.wv = w("wv", (D, K, H), ("embed", "kv_heads", "head_dim"), D)
    self.wo = w("wo", (N, H, D), ("heads", "head_dim", "embed"), N * H)
    self.q_norm = _norm_param((H,), ("head_dim",), dtype)
    self.k_norm = _norm_param((H,), ("head_dim",), dtype)
    self.post_attn_norm = _norm_param((D,), ("embed",), dtype)
    self.mlp_norm = _norm_param((D,), ("embed",), dtype)
    self.w_gate = w("w_gate", (D, F), ("embed", "mlp"), D)
    self.w_up = w("w_up", (D, F), ("embed", "mlp"), D)
    self.w_down = w("w_down", (F, D), ("mlp", "embed"), F)
    self.post_mlp_norm = _norm_param((D,), ("embed",), dtype)

  def __call__(self, x, layer, cache: KVCache, meta: attention.AttentionMetadata, inv_freq, window,
               attn: attention.AttentionSpec):
    """x [B, T, D] -> [B, T, D], with this layer's K/V written into `cache`. inv_freq [H/2] and
    window (a scalar) are this layer's."""
    cfg, eps = self.cfg, self.cfg.norm_eps
    h = norm(x, self.attn_norm[...], eps)
    q = norm(quant_linear.linear("BTD,DNH->BTNH", h, self.wq), self.q_norm[...], eps)
    k = norm(quant_linear.linear("BTD,DKH->BTKH", h, self.wk), self.k_norm[...], eps)
    v = quant_linear.linear("BTD,DKH->BTKH", h, self.wv)
    q = apply_rope(q, meta.positions, inv_freq)
    k = apply_rope(k, meta.positions, inv_freq)
    # The attention scales scores by H ** -0.5; Gemma wants query_pre_attn_scalar ** -0.5
    # (the same number for every Gemma 3 but 27B), so the queries carry the ratio.
    ratio = math.sqrt(cfg.head_dim / (cfg.query_pre_attn_scalar or cfg.head_dim))
    if ratio != 1.0:
      q = q * jnp.asarray(ratio, q.dtype)
    out, cache = attention.attend(q, k, v, cache, layer, meta, attn, window=window,
                                  local_window=cfg.sliding_window)  # [B, T, N, H]
    out = out.astype(x.dtype)
    x = x + norm(quant_linear.linear("BTNH,NHD->BTD", out, self.wo), self.post_attn_norm[...], eps)
    h = norm(x, self.mlp_norm[...], eps)
    gate = jax.nn.gelu(quant_linear.linear("BTD,DF->BTF", h, self.w_gate), approximate=True)
    up = quant_linear.linear("BTD,DF->BTF", h, self.w_up)
    down = quant_linear.linear("BTF,FD->BTD", gate * up, self.w_down)
    return x + norm(down, self.post_mlp_norm[...], eps), cache


class Gemma3(nnx.Module):
  """Called like llama.Transformer: (tokens, cache, meta, attn) -> (logits, cache)."""

  def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs,
               quant_layouts: quant.Layouts | None = None):
    self.cfg = cfg
    self.embed = _weight("embed", quant_layouts, rngs, (cfg.vocab_size, cfg.dim),
                         ("vocab", "embed"), dtype, 1)
    self.layers = stacked_layers(cfg, lambda rngs: Gemma3Block(cfg, dtype, rngs, quant_layouts),
                                 rngs)
    self.final_norm = _norm_param((cfg.dim,), ("embed",), dtype)
    if not cfg.tie_embeddings:
      self.lm_head = _weight("lm_head", quant_layouts, rngs, (cfg.dim, cfg.vocab_size),
                             ("embed", "vocab"), dtype, cfg.dim)
    if cfg.vision is not None:  # The multimodal models: images in (model/siglip.py).
      self.vision = VisionTower(cfg, dtype, rngs)

  def __call__(self, tokens, cache: KVCache, meta: attention.AttentionMetadata,
               attn: attention.AttentionSpec = attention.AttentionSpec(), last_only: bool = True,
               hidden: bool = False, images=None):
    """tokens [1, T] -> logits [B, V] at each sequence's last new token (meta.sample_rows), or
    [1, T, V] at every token, or (`hidden`) the last layer's output [1, T, D] for `head`; and
    the cache. `images`: (rows [T, D], is_image [T]): the soft tokens (VisionTower's) that take
    the place of the image tokens' embeddings."""
    cfg = self.cfg
    dtype = self.final_norm[...].dtype
    # sqrt(D) rounded to the model dtype first, as Hugging Face does (in bfloat16 it is 25.25,
    # not 25.3, for D = 640): the checkpoints were trained with that rounding.
    x = quant.embed(tokens, self.embed, dtype) * jnp.asarray(math.sqrt(cfg.dim), dtype)  # [B, T, D]
    if images is not None:  # Soft tokens go in unscaled, as transformers scatters them.
      rows, is_image = images
      x = jnp.where(is_image[None, :, None], rows[None].astype(dtype), x)

    def body(layer, carry, xs):
      (x, cache), (i, inv_freq, window) = carry, xs
      return layer(x, i, cache, meta, inv_freq, window, attn)

    xs = (jnp.arange(cfg.num_layers), jnp.asarray(layer_rope(cfg)),
          jnp.asarray(layer_windows(cfg)))
    x, cache = run_layers(self.layers, (x, cache), xs, body)
    if hidden:
      return x, cache
    return self.head(x[0, meta.sample_rows] if last_only else x), cache  # [B, D] or [1, T, D]

  def normed(self, x):
    """The last layer's output [..., D] through the final norm: the hidden state a pooling
    model's vector is made of (Hugging Face's last_hidden_state)."""
    return norm(x, self.final_norm[...], self.cfg.norm_eps)

  def head(self, x):
    """The last layer's output [..., D] -> logits [..., V] float32 (soft-capped if set)."""
    cfg = self.cfg
    x = self.normed(x)
    if cfg.tie_embeddings:  # One copy: the embedding [V, D] read as the head.
      logits = quant_linear.linear("...D,VD->...V", x, self.embed).astype(jnp.float32)
    else:
      logits = quant_linear.linear("...D,DV->...V", x, self.lm_head).astype(jnp.float32)
    if cfg.final_logit_softcapping is not None:
      cap = cfg.final_logit_softcapping
      logits = cap * jnp.tanh(logits / cap)
    return logits

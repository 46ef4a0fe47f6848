"""The Llama block's variants in Flax NNX, over the same paged KV cache as llama.py's Transformer:
Qwen3 (RMSNorm on each query and key head), Mistral (a sliding window on every layer), and the
mixtures of experts Qwen3-MoE (Qwen3's attention) and Mixtral (Llama's), whose MLP is moe.py's.

Shape letters: the key in jaxserve/model/__init__.py.

Which variant a layer is follows from the config alone (static): `cfg.qk_norm`, a window on
every layer (`cfg.local_layers`), `cfg.num_experts`. Every layer is alike, so one `lax.scan`
runs them all, as in llama.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model import attention, moe, quant
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.llama import (
    Transformer,
    _param,
    _weight,
    apply_rope,
    rms_norm,
    rope_scale,
    stacked_layers,
)


class Block(nnx.Module):
  """One decoder layer: pre-norm attention (qk-norm, window as the config says), then a pre-norm
  SwiGLU MLP or mixture of experts."""

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, quant_layouts=None):
    D, N, K, H = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg = cfg
    w = lambda name, shape, names, fan_in: _weight(name, quant_layouts, rngs, shape, names, dtype,
                                                   fan_in)
    self.attn_norm = _param(rngs, (D,), ("embed",), dtype)
    self.wq = w("wq", (D, N, H), ("embed", "heads", "head_dim"), D)
    self.wk = w("wk", (D, K, H), ("embed", "kv_heads", "head_dim"), D)
    self.wv = w("wv", (D, K, H), ("embed", "kv_heads", "head_dim"), D)
    self.wo = w("wo", (N, H, D), ("heads", "head_dim", "embed"), N * H)
    if cfg.qkv_bias:
      self.bq = _param(rngs, (N, H), ("heads", "head_dim"), dtype, fan_in=D)
      self.bk = _param(rngs, (K, H), ("kv_heads", "head_dim"), dtype, fan_in=D)
      self.bv = _param(rngs, (K, H), ("kv_heads", "head_dim"), dtype, fan_in=D)
    if cfg.qk_norm:
      self.q_norm = _param(rngs, (H,), ("head_dim",), dtype)
      self.k_norm = _param(rngs, (H,), ("head_dim",), dtype)
    self.mlp_norm = _param(rngs, (D,), ("embed",), dtype)
    if cfg.num_experts:
      Ex, Fe = cfg.num_experts, cfg.expert_hidden_dim
      self.router = _param(rngs, (D, Ex), ("embed", None), dtype, fan_in=D)
      self.we_gate = _param(rngs, (Ex, D, Fe), ("expert", "embed", "expert_mlp"), dtype, fan_in=D)
      self.we_up = _param(rngs, (Ex, D, Fe), ("expert", "embed", "expert_mlp"), dtype, fan_in=D)
      self.we_down = _param(rngs, (Ex, Fe, D), ("expert", "expert_mlp", "embed"), dtype,
                            fan_in=Fe)
    else:
      F = cfg.hidden_dim
      self.w_gate = w("w_gate", (D, F), ("embed", "mlp"), D)
      self.w_up = w("w_up", (D, F), ("embed", "mlp"), D)
      self.w_down = w("w_down", (F, D), ("mlp", "embed"), F)

  def __call__(self, x, layer, cache: KVCache, meta: attention.AttentionMetadata, inv_freq,
               attn: attention.AttentionSpec):
    """x [B, T, D] -> [B, T, D], with this layer's K/V written into `cache`."""
    cfg = self.cfg
    h = rms_norm(x, self.attn_norm[...], cfg.norm_eps)
    q = quant.linear("BTD,DNH->BTNH", h, self.wq)
    k = quant.linear("BTD,DKH->BTKH", h, self.wk)
    v = quant.linear("BTD,DKH->BTKH", h, self.wv)
    if cfg.qkv_bias:
      q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
    if cfg.qk_norm:  # Per head, before RoPE (Qwen3).
      q = rms_norm(q, self.q_norm[...], cfg.norm_eps)
      k = rms_norm(k, self.k_norm[...], cfg.norm_eps)
    q = apply_rope(q, meta.positions, inv_freq, rope_scale(cfg))
    k = apply_rope(k, meta.positions, inv_freq, rope_scale(cfg))
    # Every layer local (Mistral) or none: the window is static, one value for all layers.
    window = cfg.sliding_window if any(cfg.local_layers) else None
    out, cache = attention.attend(q, k, v, cache, layer, meta, attn, window=window,
                                  local_window=window)  # [B, T, N, H]
    x = x + quant.linear("BTNH,NHD->BTD", out.astype(x.dtype), self.wo)
    h = rms_norm(x, self.mlp_norm[...], cfg.norm_eps)
    return x + self._mlp(h, attn), cache

  def _mlp(self, h_BTD, attn: attention.AttentionSpec):
    cfg = self.cfg
    if not cfg.num_experts:
      gate = jax.nn.silu(quant.linear("BTD,DF->BTF", h_BTD, self.w_gate))
      up = quant.linear("BTD,DF->BTF", h_BTD, self.w_up)
      return quant.linear("BTF,FD->BTD", gate * up, self.w_down)
    B, T, D = h_BTD.shape
    h_TD = h_BTD.reshape(B * T, D)
    weights, experts = moe.route(h_TD, self.router[...], cfg.experts_per_token, cfg.norm_topk)
    out = moe.experts_mlp(h_TD, weights, experts, self.we_gate[...], self.we_up[...],
                          self.we_down[...], attn.mesh)
    return out.reshape(B, T, D)


class Decoder(Transformer):
  """Called like llama.Transformer: (tokens, cache, meta, attn) -> (logits, cache); its forward
  and head are the Transformer's, over `Block`s. The experts and the router stay float under
  every `quantization` (loading/quantize.py quantizes the named matrices only)."""

  def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs,
               quant_layouts: quant.Layouts | None = None):
    self.cfg = cfg
    self.embed = _weight("embed", quant_layouts, rngs, (cfg.vocab_size, cfg.dim),
                         ("vocab", "embed"), dtype, 1)
    self.layers = stacked_layers(cfg, lambda rngs: Block(cfg, dtype, rngs, quant_layouts), rngs)
    self.final_norm = _param(rngs, (cfg.dim,), ("embed",), dtype)
    if not cfg.tie_embeddings:
      self.lm_head = _weight("lm_head", quant_layouts, rngs, (cfg.dim, cfg.vocab_size),
                             ("embed", "vocab"), dtype, cfg.dim)

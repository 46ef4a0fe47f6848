"""A Llama-family decoder in Flax NNX, reading and writing a paged KV cache: Llama, Qwen2, and the
Llama block's variants, each a switch of the config (DecoderLayer): Qwen3 (RMSNorm on each query
and key head), Mistral and Phi-3 (a sliding window on every layer), and the mixtures of experts
Qwen3-MoE and Mixtral (moe.py's MLP).

Shape letters: the key in jaxserve/model/__init__.py.

One forward serves a whole engine step: every prefill chunk and decode token packed on one token
axis (B=1, T=the step's tokens); where each token sits is the `AttentionMetadata` it is handed,
never a flag read from a global.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model import attention, moe, quant, quant_linear
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.lora import LoraRows
from jaxserve.model.qwen_vision import QwenVisionTower
from jaxserve.model.rope import apply_rope, rope_frequencies, rope_positions, rope_scale


def _param(rngs: nnx.Rngs, shape, names, dtype, fan_in: int | None = None) -> nnx.Param:
  """A parameter with logical axis names, for sharding over a mesh later."""
  if fan_in is None:
    value = jnp.ones(shape, dtype)
  else:
    value = (jax.random.normal(rngs.params(), shape) / jnp.sqrt(fan_in)).astype(dtype)
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _weight(name: str, layouts: quant.Layouts | None, rngs: nnx.Rngs, shape, names, dtype,
            fan_in: int):
  """A matrix: float (random, for tests), or quantized when `layouts` names it (model/quant.py)."""
  return quant.weight(name, layouts, lambda: _param(rngs, shape, names, dtype, fan_in), shape,
                      names)


def rms_norm(x, scale, eps: float):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def stacked_layers(cfg: ModelConfig, make_layer, rngs: nnx.Rngs):
  """cfg.num_layers layers as one module whose parameters carry a leading [L] axis: the model
  runs them under a scan, so compile time does not grow with depth (`unstacked` makes the
  unrolled copy an engine runs with unroll_layers). `make_layer(rngs)` builds
  one."""
  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make_layers(rngs: nnx.Rngs):
    return make_layer(rngs)

  return make_layers(rngs)


def unstacked(model):
  """A copy of `model` whose layers are a list of L layers, each with its own arrays, in place of
  stacked [L, ...] parameters: it runs them unrolled (`run_layers`), and a matmul then reads its
  weight where it lies (XLA:CPU copies a layer's weights out of the stack before its dots, every
  step of a scan). `model` is left as it is. On one CPU device each layer's array is a view of
  the stacked one (no copy is made); elsewhere a slice."""
  model = nnx.clone(model)
  if isinstance(model.layers, nnx.List):
    return model
  graphdef, state = nnx.split(model.layers)
  is_var = lambda x: isinstance(x, nnx.Variable)
  layers = []
  for i in range(model.cfg.num_layers):
    one = jax.tree.map(lambda v: v.replace(_layer_of(v[...], i)), state, is_leaf=is_var)
    one = nnx.spmd.remove_axis(one, 0, {nnx.PARTITION_NAME: "layers"})  # Sharded without [L].
    layers.append(nnx.merge(graphdef, one))
  model.layers = nnx.List(layers)
  return model


def _layer_of(stacked: jax.Array, i: int) -> jax.Array:
  """stacked[i]: a view on one CPU device (device_put aliases an aligned host buffer there)."""
  devices = stacked.sharding.device_set
  if len(devices) == 1 and next(iter(devices)).platform == "cpu":
    return jax.device_put(np.asarray(stacked)[i], stacked.sharding)
  return stacked[i]


def run_layers(layers, carry, xs, body):
  """`body(layer, carry, xs_i) -> carry` over every layer (xs: arrays [L, ...], one row per layer):
  a scan over stacked layers, or a Python loop over a list of them (`unstacked`). Where the CPU
  kernel reads quantized weights (quant_linear.reads_in_place), the scan hands them over whole
  with the layer's index, as a scan's own slice of them would be a copy of every layer's
  weights, every step."""
  if isinstance(layers, nnx.List):
    for i, layer in enumerate(layers):
      carry = body(layer, carry, jax.tree.map(lambda a: a[i], xs))
    return carry
  quantized = any(isinstance(getattr(layers, n, None), quant.Quantized) for n in quant.STACKED)
  if not (quantized and quant_linear.reads_in_place()):
    graphdef, state = nnx.split(layers)

    def scan_body(carry, state_xs):
      state, x = state_xs
      return body(nnx.merge(graphdef, state), carry, x), None

    return jax.lax.scan(scan_body, carry, (state, xs))[0]
  graphdef, whole, state = nnx.split(layers, quant.is_stored, ...)

  def scan_whole(carry, state_xs):
    state, x, i = state_xs
    layer = nnx.merge(graphdef, whole, state)
    quant.read_layer(layer, i)
    return body(layer, carry, x), None

  L = jax.tree.leaves(xs)[0].shape[0]
  return jax.lax.scan(scan_whole, carry, (state, xs, jnp.arange(L)))[0]


class DecoderLayer(nnx.Module):
  """One decoder layer: pre-norm attention, then a pre-norm SwiGLU MLP or mixture of experts.

  What each family adds to the Llama block is a switch of its config, static, so every layer is
  alike and one scan runs them all: RMSNorm on each query and key head (`cfg.qk_norm`: Qwen3,
  Qwen3-MoE), a sliding window on every layer (`cfg.local_layers`: Mistral, and Phi-3 or
  Mixtral when their config sets one), and experts for the MLP (`cfg.num_experts`: Qwen3-MoE,
  Mixtral; moe.py)."""

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
               attn: attention.AttentionSpec, lora: LoraRows | None = None):
    """x [B, T, D] -> [B, T, D], with this layer's K/V written into `cache`. `lora`: this
    layer's adapters and each token's slot (model/lora.py), whose deltas join each projection."""
    cfg = self.cfg
    proj = lambda spec, x, w, target: _with_lora(quant_linear.linear(spec, x, w), x, lora, target)
    h = rms_norm(x, self.attn_norm[...], cfg.norm_eps)
    q = proj("BTD,DNH->BTNH", h, self.wq, "wq")
    k = proj("BTD,DKH->BTKH", h, self.wk, "wk")
    v = proj("BTD,DKH->BTKH", h, self.wv, "wv")
    if cfg.qkv_bias:
      q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
    if cfg.qk_norm:  # Per head, before RoPE (Qwen3).
      q = rms_norm(q, self.q_norm[...], cfg.norm_eps)
      k = rms_norm(k, self.k_norm[...], cfg.norm_eps)
    positions = rope_positions(cfg, meta)
    q = apply_rope(q, positions, inv_freq, rope_scale(cfg), cfg.mrope_section)
    k = apply_rope(k, positions, inv_freq, rope_scale(cfg), cfg.mrope_section)
    # Every layer local (Mistral) or none: the window is static, one value for all layers.
    window = cfg.sliding_window if any(cfg.local_layers) else None
    out, cache = attention.attend(q, k, v, cache, layer, meta, attn, window=window,
                                  local_window=window)  # [B, T, N, H]
    out = out.astype(x.dtype)
    x = x + _with_lora(quant_linear.linear_heads(out, self.wo), out, lora, "wo")
    h = rms_norm(x, self.mlp_norm[...], cfg.norm_eps)
    return x + self._mlp(h, attn, lora), cache

  def _mlp(self, h_BTD, attn: attention.AttentionSpec, lora: LoraRows | None):
    cfg = self.cfg
    if not cfg.num_experts:
      proj = lambda spec, x, w, target: _with_lora(quant_linear.linear(spec, x, w), x, lora, target)
      gate = jax.nn.silu(proj("BTD,DF->BTF", h_BTD, self.w_gate, "w_gate"))
      up = proj("BTD,DF->BTF", h_BTD, self.w_up, "w_up")
      return proj("BTF,FD->BTD", gate * up, self.w_down, "w_down")
    B, T, D = h_BTD.shape
    h_TD = h_BTD.reshape(B * T, D)
    weights, experts = moe.route(h_TD, self.router[...], cfg.experts_per_token, cfg.norm_topk)
    out = moe.experts_mlp(h_TD, weights, experts, self.we_gate[...], self.we_up[...],
                          self.we_down[...], attn.mesh)
    return out.reshape(B, T, D)


def _with_lora(y, x, lora: LoraRows | None, target: str):
  """y = x's base projection, plus its tokens' adapters' deltas when there are adapters."""
  return y if lora is None else lora.add(target, x, y)


class Transformer(nnx.Module):
  """`quant_layouts` (quant.layouts_of a parameter pytree): the weights stored quantized. The
  experts and the router stay float under every `quantization` (loading/quantize.py quantizes
  the named matrices only)."""

  def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs,
               quant_layouts: quant.Layouts | None = None):
    self.cfg = cfg
    self.embed = _weight("embed", quant_layouts, rngs, (cfg.vocab_size, cfg.dim),
                         ("vocab", "embed"), dtype, 1)
    self.layers = stacked_layers(cfg, lambda rngs: DecoderLayer(cfg, dtype, rngs, quant_layouts),
                                 rngs)
    self.final_norm = _param(rngs, (cfg.dim,), ("embed",), dtype)
    if not cfg.tie_embeddings:
      self.lm_head = _weight("lm_head", quant_layouts, rngs, (cfg.dim, cfg.vocab_size),
                             ("embed", "vocab"), dtype, cfg.dim)
    if cfg.vision is not None:  # Qwen2.5-VL: images in (model/qwen_vision.py).
      self.vision = QwenVisionTower(cfg, dtype, rngs)

  def __call__(self, tokens, cache: KVCache, meta: attention.AttentionMetadata,
               attn: attention.AttentionSpec = attention.AttentionSpec(), last_only: bool = True,
               hidden: bool = False, lora: LoraRows | None = None, images=None):
    """tokens [1, T] -> logits [B, V] at each sequence's last new token (meta.sample_rows), or
    [1, T, V] at every token, or (`hidden`) the last layer's output [1, T, D] for `head`; and
    the cache. `lora`: each token's adapter slot and the stacked adapters (model/lora.py).
    `images`: (rows [T, D], is_image [T]), the encoder's soft tokens in place of the image
    tokens' embeddings."""
    x = quant.embed(tokens, self.embed, self.final_norm[...].dtype)  # [B, T, D]
    if images is not None:
      rows, is_image = images
      x = jnp.where(is_image[None, :, None], rows[None].astype(x.dtype), x)
    inv_freq = rope_frequencies(self.cfg, meta)
    def body(layer, carry, xs):
      x, cache = carry
      i, weights = xs
      rows = None if lora is None else lora.at_layer(weights)
      return layer(x, i, cache, meta, inv_freq, attn, rows)

    xs = (jnp.arange(self.cfg.num_layers), None if lora is None else lora.weights)
    x, cache = run_layers(self.layers, (x, cache), xs, body)
    if hidden:
      return x, cache
    return self.head(x[0, meta.sample_rows] if last_only else x), cache  # [B, D] or [1, T, D]

  def normed(self, x):
    """The last layer's output [..., D] through the final norm: the hidden state a pooling
    model's vector is made of (Hugging Face's last_hidden_state)."""
    return rms_norm(x, self.final_norm[...], self.cfg.norm_eps)

  def head(self, x):
    """The last layer's output [..., D] -> logits [..., V] float32."""
    x = self.normed(x)
    if self.cfg.tie_embeddings:  # One copy: the embedding [V, D] read as the head.
      return quant_linear.linear("...D,VD->...V", x, self.embed).astype(jnp.float32)
    return quant_linear.linear("...D,DV->...V", x, self.lm_head).astype(jnp.float32)

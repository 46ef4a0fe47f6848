"""A Qwen2.5-VL checkpoint's vision tower (vision_weights.split_names puts its `visual.*` or
`model.visual.*` weights in `tower`, by their own names) mapped onto model/qwen_vision.py's
QwenVisionTower."""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig


def qwen_vision_params(cfg: ModelConfig, tower: dict) -> dict:
  """The tower's torch-layout arrays -> QwenVisionTower's params (float32)."""
  v = cfg.vision
  f32 = lambda name: np.asarray(tower[name], np.float32)
  layers = [_layer(f32, f"blocks.{i}.", v.num_heads, v.dim) for i in range(v.num_layers)]
  return {
      "patch_w": f32("patch_embed.proj.weight").reshape(v.dim, -1).T,  # [3 * T * p * p, Dv]
      "layers": {key: np.stack([layer[key] for layer in layers]) for key in layers[0]},
      "merge_norm": f32("merger.ln_q.weight"),
      "merge_w1": f32("merger.mlp.0.weight").T, "merge_b1": f32("merger.mlp.0.bias"),
      "merge_w2": f32("merger.mlp.2.weight").T, "merge_b2": f32("merger.mlp.2.bias"),
  }


def _layer(f32, p: str, Nv: int, Dv: int) -> dict:
  """One block's arrays; the fused qkv [3 * Dv, Dv] split into q, k, v by heads."""
  qkv = f32(p + "attn.qkv.weight").reshape(3, Dv, Dv)  # [3, out, in]
  qkv_b = f32(p + "attn.qkv.bias").reshape(3, Nv, Dv // Nv)
  heads_in = lambda m: m.T.reshape(Dv, Nv, Dv // Nv)  # [out, in] -> [Dv, Nv, Hd]
  mlp = lambda name: f32(f"{p}mlp.{name}_proj.weight").T
  mlp_b = lambda name: f32(f"{p}mlp.{name}_proj.bias")
  return {
      "norm1": f32(p + "norm1.weight"),
      "wq": heads_in(qkv[0]), "wk": heads_in(qkv[1]), "wv": heads_in(qkv[2]),
      "bq": qkv_b[0], "bk": qkv_b[1], "bv": qkv_b[2],
      "wo": f32(p + "attn.proj.weight").T.reshape(Nv, Dv // Nv, Dv),
      "bo": f32(p + "attn.proj.bias"),
      "norm2": f32(p + "norm2.weight"),
      "w_gate": mlp("gate"), "b_gate": mlp_b("gate"), "w_up": mlp("up"), "b_up": mlp_b("up"),
      "w_down": mlp("down"), "b_down": mlp_b("down"),
  }

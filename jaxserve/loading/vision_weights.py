"""A Gemma 3 multimodal checkpoint's names: its text model's weights renamed to a text model's
(weights.hf_params reads them), its vision tower and projector mapped onto model/siglip.py's
VisionTower.

Hugging Face has spelled the parts two ways: the published checkpoints (transformers 4) as
`language_model.model.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`;
transformers 5 saves `model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`, or (as the tests' do) without the outer `model.`. All read the
same.

Qwen2.5-VL's vision tower (its merger included) is `visual.*` in the published checkpoints and in
what transformers 5 saves (beside a text model's `model.*`), `model.visual.*` in transformers 5's
state_dict (beside `model.language_model.*`); loading/qwen_vision_weights.py maps it.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig

_TEXT_PREFIXES = ("model.language_model.model.", "language_model.model.", "model.language_model.")
_VISION_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.",
                    "model.vision_tower.", "vision_tower.", "model.visual.", "visual.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def split_names(raw: dict) -> tuple[dict, dict, dict]:
  """(text weights named as a text model's `model.*` / `lm_head.*`, the tower's by its own
  names, the projector's)."""
  text, tower, projector = {}, {}, {}
  for name, w in raw.items():
    if name.startswith(("language_model.lm_head.", "model.language_model.lm_head.")):
      text["lm_head." + name.rsplit("lm_head.", 1)[1]] = w
    elif (p := _prefix(name, _TEXT_PREFIXES)) is not None:
      text["model." + name[len(p):]] = w
    elif (p := _prefix(name, _VISION_PREFIXES)) is not None:
      tower[name[len(p):]] = w
    elif (p := _prefix(name, _PROJECTOR_PREFIXES)) is not None:
      projector[name[len(p):]] = w
    else:
      text[name] = w  # lm_head.weight, or a text-only checkpoint's names.
  return text, tower, projector


def _prefix(name: str, prefixes) -> str | None:
  return next((p for p in prefixes if name.startswith(p)), None)


def vision_params(cfg: ModelConfig, tower: dict, projector: dict) -> dict:
  """The tower's and projector's torch-layout arrays -> VisionTower's params (float32)."""
  v = cfg.vision
  Nv = v.num_heads
  Hd = v.dim // Nv
  conv = tower["embeddings.patch_embedding.weight"]  # [Dv, 3, p, p]
  return {
      "patch_w": conv.reshape(v.dim, -1).T,  # [3 * p * p, Dv]
      "patch_b": tower["embeddings.patch_embedding.bias"],
      "position": tower["embeddings.position_embedding.weight"],  # [Pt, Dv]
      "layers": _stacked([_layer(tower, f"encoder.layers.{i}.", Nv, Hd)
                          for i in range(v.num_layers)]),  # Each [Lv, ...].
      "post_norm_w": tower["post_layernorm.weight"],
      "post_norm_b": tower["post_layernorm.bias"],
      "soft_norm": projector["mm_soft_emb_norm.weight"],
      "project": projector["mm_input_projection_weight"],  # [Dv, D]: stored input-first.
  }


def _stacked(layers: list[dict]) -> dict:
  return {key: np.stack([layer[key] for layer in layers]) for key in layers[0]}


def _layer(tower: dict, p: str, Nv: int, Hd: int) -> dict:
  w = lambda name: tower[p + name]
  attn = lambda name: tower[f"{p}self_attn.{name}"]
  heads_in = lambda m: m.T.reshape(-1, Nv, Hd)  # [out, in] -> [Dv, Nv, Hd]
  return {
      "norm1_w": w("layer_norm1.weight"), "norm1_b": w("layer_norm1.bias"),
      **{"w" + x: heads_in(attn(f"{x}_proj.weight")) for x in "qkv"},
      **{"b" + x: attn(f"{x}_proj.bias").reshape(Nv, Hd) for x in "qkv"},
      "wo": attn("out_proj.weight").T.reshape(Nv, Hd, -1), "bo": attn("out_proj.bias"),
      "norm2_w": w("layer_norm2.weight"), "norm2_b": w("layer_norm2.bias"),
      "w1": w("mlp.fc1.weight").T, "b1": w("mlp.fc1.bias"),
      "w2": w("mlp.fc2.weight").T, "b2": w("mlp.fc2.bias"),
  }

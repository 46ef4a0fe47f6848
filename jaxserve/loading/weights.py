"""Weights from GGUF files and Hugging Face directories, mapped onto our parameter pytree.

Both readers return (ModelConfig, params) where params is a nested dict of numpy arrays shaped
like `nnx.to_pure_dict` of a `Transformer` (layer weights stacked on a leading [L] axis): float32,
or (`load_gguf(..., blocks=True)`) each GGUF-quantized matrix as its blocks, stored the way
model/quant.py reads them ({"values", "scale"[, "minimum"]}, loading/quantize.py).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from jaxserve import gguf_metadata
from jaxserve.config import ModelConfig, ModelFamily, qwen_vl, readers, vision
from jaxserve.loading import gguf_blocks, quantize, qwen_vision_weights, vision_weights

# Gemma 3's norms beyond the Llama block's two: our name -> (GGUF name, Hugging Face name).
GEMMA3_NORMS = {
    "q_norm": ("attn_q_norm", "self_attn.q_norm"),
    "k_norm": ("attn_k_norm", "self_attn.k_norm"),
    "post_attn_norm": ("post_attention_norm", "post_attention_layernorm"),
    "post_mlp_norm": ("post_ffw_norm", "post_feedforward_layernorm"),
}


def gguf_config(path, reader=None) -> ModelConfig:
  """A GGUF file's model config, without reading its weights."""
  import gguf

  reader = reader or gguf.GGUFReader(str(path))
  has_output = any(t.name == "output.weight" for t in reader.tensors)
  # Phi-3's LongRoPE factors are tensors, not metadata.
  factors = {t.name: dequantize(t) for t in reader.tensors
             if t.name in ("rope_factors_short.weight", "rope_factors_long.weight")}
  rope_factors = None
  if factors:
    rope_factors = (factors["rope_factors_short.weight"], factors["rope_factors_long.weight"])
  return readers.from_gguf(gguf_metadata.read_gguf_metadata(path), has_output,
                           name=pathlib.Path(path).stem, rope_factors=rope_factors)


def dequantize(tensor) -> np.ndarray:
  """A GGUF tensor (any type the gguf package knows: F32, Q8_0, Q4_1, Q5_0, Q4_K, Q6_K, ...) as
  float32 in the Hugging Face (torch) layout: [out_features, in_features]."""
  import gguf

  values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
  return values.reshape(tuple(reversed([int(d) for d in tensor.shape])))


def read_matrix(tensor, blocks: bool):
  """A GGUF matrix in torch layout: float32, or (`blocks`, and a block type gguf_blocks reads)
  its gguf_blocks.Blocks."""
  type_name = tensor.tensor_type.name
  if not blocks or type_name in ("F32", "F16", "BF16"):
    return dequantize(tensor)
  shape = tuple(reversed([int(d) for d in tensor.shape]))
  return gguf_blocks.unpack(tensor.data, type_name, shape)


def load_gguf(path, blocks: bool = False) -> tuple[ModelConfig, dict]:
  """Reads a GGUF file (the Llama family, Qwen3, Mistral, Phi-3, or Gemma 3): dequantized, or
  (`blocks`) with each quantized matrix kept as its blocks."""
  import gguf

  reader = gguf.GGUFReader(str(path))
  meta = gguf_metadata.read_gguf_metadata(path, prefix="general.")
  tensors = {t.name: t for t in reader.tensors}
  cfg = gguf_config(path, reader)

  matrices = {"token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output",
              "ffn_gate", "ffn_up", "ffn_down"}
  get = lambda name: (read_matrix(tensors[name], blocks)
                      if name.split(".")[-2] in matrices else dequantize(tensors[name]))

  layers = [_gguf_layer(cfg, meta["general.architecture"], get, tensors, f"blk.{i}.")
            for i in range(cfg.num_layers)]
  final_norm = get("output_norm.weight")
  if cfg.family is ModelFamily.GEMMA3:
    # llama.cpp stores Gemma's norm weights as the scale itself, 1 + w; ours (and Hugging
    # Face's) are w, kept apart from the 1 so a bfloat16 copy keeps its precision. transformers
    # subtracts the 1 from the same F32 values in the same way.
    for i, layer in enumerate(layers):
      layer.update({key: get(f"blk.{i}.{g}.weight") for key, (g, _) in GEMMA3_NORMS.items()})
      layer.update({key: w - 1 for key, w in layer.items() if key.endswith("norm")})
    final_norm = final_norm - 1
  head = get("output.weight") if "output.weight" in tensors else None
  return cfg, to_params(cfg, get("token_embd.weight"), layers, final_norm, head)


def _gguf_layer(cfg: ModelConfig, arch: str, get, tensors, p: str) -> dict:
  """One layer's torch-layout tensors, by our names (`p`: the layer's prefix); Gemma 3's extra
  norms are load_gguf's."""
  layer = {"attn_norm": get(p + "attn_norm.weight"), "o": get(p + "attn_output.weight"),
           "mlp_norm": get(p + "ffn_norm.weight"), "down": get(p + "ffn_down.weight"),
           **_gguf_qkv(cfg, get, tensors, p), **_gguf_gate_up(get, tensors, p)}
  if cfg.qkv_bias:
    layer.update({"b" + key: get(f"{p}attn_{key}.bias") for key in "qkv"})
  # llama.cpp's converter permutes Q/K rows of Llama models for its interleaved RoPE; Qwen2/3
  # and Phi-3 are converted unpermuted (they use NeoX-style RoPE, like us).
  if arch in ("llama", "mistral"):
    for key, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads),
                       ("bq", cfg.num_heads), ("bk", cfg.num_kv_heads)):
      if key in layer:
        layer[key] = _unpermute(layer[key], heads)
  if cfg.qk_norm and cfg.family is not ModelFamily.GEMMA3:  # Qwen3: [H] each.
    layer.update(q_norm=get(p + "attn_q_norm.weight"), k_norm=get(p + "attn_k_norm.weight"))
  return layer


def _gguf_qkv(cfg: ModelConfig, get, tensors, p: str) -> dict:
  """Q, K and V of layer prefix `p`: three tensors, or Phi-3's one fused [(N + 2K) * H, D]."""
  if p + "attn_qkv.weight" not in tensors:
    return {key: get(f"{p}attn_{key}.weight") for key in "qkv"}
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return dict(zip("qkv", _split_rows(get(p + "attn_qkv.weight"), [q, q + kv])))


def _gguf_gate_up(get, tensors, p: str) -> dict:
  """Gate and up of layer prefix `p`: two tensors, or Phi-3's ffn_up holding gate then up
  ([2F, D]; llama.cpp's converter keeps gate_up_proj whole)."""
  if p + "ffn_gate.weight" in tensors:
    return {"gate": get(p + "ffn_gate.weight"), "up": get(p + "ffn_up.weight")}
  fused = get(p + "ffn_up.weight")
  rows = fused.values.shape[0] if isinstance(fused, gguf_blocks.Blocks) else fused.shape[0]
  return dict(zip(("gate", "up"), _split_rows(fused, [rows // 2])))


def _split_rows(w, at: list[int]) -> list:
  """A torch-layout matrix (float, or Blocks: their scales follow their rows) cut into runs of
  rows (output features) at `at`."""
  if isinstance(w, gguf_blocks.Blocks):
    ends = [*at, w.values.shape[0]]
    return [w.map(lambda a, s=s, e=e: a[s:e]) for s, e in zip([0, *at], ends)]
  return np.split(w, at)


def load_hf_dir(path) -> tuple[ModelConfig, dict]:
  """Reads `config.json` + `*.safetensors` of a Hugging Face model directory."""
  from safetensors import safe_open

  path = pathlib.Path(path)
  hf = json.loads((path / "config.json").read_text())
  cfg = readers.from_hf(hf, name=path.name)
  if cfg.vision is not None and (path / "preprocessor_config.json").exists():
    preprocessor = json.loads((path / "preprocessor_config.json").read_text())
    reader = qwen_vl.from_hf if cfg.mrope_section else vision.from_hf
    cfg = dataclasses.replace(cfg, vision=reader(hf, preprocessor))
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors in {path}")
  raw = {}
  for f in files:
    with safe_open(f, framework="flax") as sf:  # flax: reads bfloat16, which numpy cannot.
      raw.update({k: np.asarray(sf.get_tensor(k), np.float32) for k in sf.keys()})
  return cfg, hf_params(cfg, raw)


def hf_params(cfg: ModelConfig, named) -> dict:
  """Hugging Face-named torch-layout arrays (a mapping of names such as
  "model.layers.0.self_attn.q_proj.weight" to arrays: numpy, jax, anything np.asarray reads) ->
  our params (float32, `to_params`' layout): a checkpoint's, or a trainer's weights for
  `LLM.update_weights`. Names the model does not use are ignored; a missing one is a ValueError
  naming it."""
  raw = {k: np.asarray(v, np.float32) for k, v in named.items()}  # A copy: Phi-3's is split.
  tower = projector = None
  if cfg.vision is not None:
    raw, tower, projector = vision_weights.split_names(raw)
  try:
    if cfg.family is ModelFamily.PHI3:
      _split_phi3(cfg, raw)
    layers = [_hf_layer(cfg, raw, f"model.layers.{i}.") for i in range(cfg.num_layers)]
    head = None if cfg.tie_embeddings else raw["lm_head.weight"]
    embed, norm = raw["model.embed_tokens.weight"], raw["model.norm.weight"]
    params = to_params(cfg, embed, layers, norm, head)
    if tower is not None:
      params["vision"] = (qwen_vision_weights.qwen_vision_params(cfg, tower) if cfg.mrope_section
                          else vision_weights.vision_params(cfg, tower, projector))
  except KeyError as e:
    raise ValueError(f"Hugging Face weight {e.args[0]!r} is missing") from None
  return params


def _split_phi3(cfg: ModelConfig, raw: dict) -> None:
  """Phi-3 stores q, k and v as one [(N + 2K) * H, D] matrix, and gate and up as one [2F, D]:
  into Llama's names, in place."""
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    qkv = raw.pop(p + "self_attn.qkv_proj.weight")
    for key, rows in zip("qkv", np.split(qkv, [q, q + kv])):
      raw[f"{p}self_attn.{key}_proj.weight"] = rows
    gate, up = np.split(raw.pop(p + "mlp.gate_up_proj.weight"), 2)
    raw[p + "mlp.gate_proj.weight"], raw[p + "mlp.up_proj.weight"] = gate, up


def _hf_layer(cfg: ModelConfig, raw: dict, p: str) -> dict:
  """One layer's torch-layout tensors, by our names (`p`: the layer's prefix)."""
  # Gemma's post_attention_layernorm follows attention; its MLP's pre-norm has its own name.
  gemma = cfg.family is ModelFamily.GEMMA3
  mlp_norm = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
  layer = {"attn_norm": raw[p + "input_layernorm.weight"],
           "mlp_norm": raw[p + mlp_norm + ".weight"],
           **{key: raw[f"{p}self_attn.{key}_proj.weight"] for key in "qkvo"}}
  if cfg.qkv_bias:
    layer.update({"b" + key: raw[f"{p}self_attn.{key}_proj.bias"] for key in "qkv"})
  if gemma:
    layer.update({key: raw[p + hf + ".weight"] for key, (_, hf) in GEMMA3_NORMS.items()})
  elif cfg.qk_norm:
    layer.update({key: raw[f"{p}self_attn.{key}.weight"] for key in ("q_norm", "k_norm")})
  if not cfg.num_experts:
    layer.update({key: raw[f"{p}mlp.{key}_proj.weight"] for key in ("gate", "up", "down")})
    return layer
  # Mixtral names its experts' projections w1 (gate), w3 (up) and w2 (down).
  moe, names = "mlp.", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
  if cfg.family is ModelFamily.MIXTRAL:
    moe, names = "block_sparse_moe.", {"gate": "w1", "up": "w3", "down": "w2"}
  layer["router"] = raw[p + moe + "gate.weight"]  # [Ex, D]
  for key, name in names.items():  # [Ex, out, in]
    layer["e_" + key] = np.stack([raw[f"{p}{moe}experts.{e}.{name}.weight"]
                                  for e in range(cfg.num_experts)])
  return layer


def _one(w, f):
  """f applied to a float matrix, or to each array of its Blocks (then stored)."""
  return quantize.from_blocks(w.map(f)) if isinstance(w, gguf_blocks.Blocks) else f(w)


def _stack(ws: list, f, name: str):
  """f applied to each layer's matrix, stacked on [L]. Blocks of different types (a Q4_K_M file
  mixes Q4_K and Q6_K layers) share their smallest group and keep a minimum if any has one."""
  if not any(isinstance(w, gguf_blocks.Blocks) for w in ws):
    return np.stack([f(w) for w in ws])
  if not all(isinstance(w, gguf_blocks.Blocks) for w in ws):
    raise ValueError(f"{name}: some layers are quantized and some float; gguf mode needs one "
                     "kind per weight (use --quantization none or int8)")
  group = min(w.group for w in ws)
  with_min = any(w.minimum is not None for w in ws)
  stored = [quantize.from_blocks(w.regroup(group, with_min).map(f)) for w in ws]
  return {key: np.stack([s[key] for s in stored]) for key in stored[0]}


def to_params(cfg: ModelConfig, embed, layers: list[dict], final_norm, lm_head) -> dict:
  """Torch-layout ([out, in]) matrices (float, or gguf_blocks.Blocks) -> our einsum layout,
  layers stacked on [L]. The reshapes leave the input axis as -1: a block's scales follow its
  values (a group never straddles two heads: it divides H)."""
  N, K, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dim
  stack = lambda key, f: _stack([layer[key] for layer in layers], f, key)
  params = {
      "embed": _one(embed, lambda w: w),  # [V, D]
      "layers": {
          "attn_norm": stack("attn_norm", lambda w: w),  # [L, D]
          "wq": stack("q", lambda w: w.T.reshape(-1, N, H)),  # [L, D, N, H]
          "wk": stack("k", lambda w: w.T.reshape(-1, K, H)),  # [L, D, K, H]
          "wv": stack("v", lambda w: w.T.reshape(-1, K, H)),
          "wo": stack("o", lambda w: w.T.reshape(N, -1, D)),  # [L, N, H, D]
          "mlp_norm": stack("mlp_norm", lambda w: w),
      },
      "final_norm": final_norm,
  }
  if cfg.qkv_bias:
    params["layers"].update(bq=stack("bq", lambda b: b.reshape(N, H)),
                            bk=stack("bk", lambda b: b.reshape(K, H)),
                            bv=stack("bv", lambda b: b.reshape(K, H)))
  if cfg.num_experts:
    experts = lambda w: w.transpose(0, 2, 1)  # [Ex, out, in] -> [Ex, in, out]
    params["layers"].update(router=stack("router", lambda w: w.T),  # [L, D, Ex]
                            we_gate=stack("e_gate", experts),  # [L, Ex, D, Fe]
                            we_up=stack("e_up", experts),
                            we_down=stack("e_down", experts))  # [L, Ex, Fe, D]
  else:
    params["layers"].update(w_gate=stack("gate", lambda w: w.T),  # [L, D, F]
                            w_up=stack("up", lambda w: w.T),
                            w_down=stack("down", lambda w: w.T))  # [L, F, D]
  if cfg.family is ModelFamily.GEMMA3:
    # [L, H] (q_norm, k_norm) and [L, D]
    params["layers"].update({key: stack(key, lambda w: w) for key in GEMMA3_NORMS})
  elif cfg.qk_norm:
    params["layers"].update({key: stack(key, lambda w: w) for key in ("q_norm", "k_norm")})
  if lm_head is not None:
    params["lm_head"] = _one(lm_head, lambda w: w.T)  # [D, V]
  return params


def _unpermute(w, num_heads: int):
  """Undoes llama.cpp's Q/K row order: per head, rows (pairs, 2) -> (2, pairs), rotate-half.
  Blocks: their rows (output features) move with their scales."""
  if isinstance(w, gguf_blocks.Blocks):
    return w.map(lambda a: _unpermute(a, num_heads))
  rows = w.shape[0]
  return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))

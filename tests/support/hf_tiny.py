"""Tiny random transformers models, the reference every model family is checked against: built
offline from a config scaled down from the family's real one (norms randomised too: they init to
a constant), saved as safetensors, or written as a float32 GGUF the way llama.cpp's converter
(convert_hf_to_gguf.py) writes that family. torch and transformers are imported when first used,
so a module that skips without them still collects."""

from __future__ import annotations

import json
import math

import numpy as np

from support.tiny import dense_logits

VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False)
# Each family's real config.json shape, scaled down: (transformers config class, its keys).
# Qwen3's qk-norm; Mistral 7B v0.1's window (here 8 positions, shorter than every prompt);
# Qwen3-MoE's 128 experts, top 8 (here 8, top 3, as Qwen3-30B-A3B's norm_topk_prob: true);
# Mixtral's 8, top 2; Phi-3-mini-4k's window (2047 of 4096, here 8), its fused QKV and gate/up.
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(SMALL, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(SMALL, sliding_window=8)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(SMALL, num_experts=8, num_experts_per_tok=3,
                                         moe_intermediate_size=32, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(SMALL, num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", dict(SMALL, sliding_window=8, pad_token_id=0)),
}

# Gemma 3's every specific path: a window shorter than the prompt, a layer pattern that is not
# the 5:1 one, two RoPE bases and linear scaling, query_pre_attn_scalar != head_dim, a final
# logit cap. (An attention cap is set too: Gemma 3 ignores it, in transformers and here.)
GEMMA3_LAYERS = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
GEMMA3 = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
    layer_types=list(GEMMA3_LAYERS), query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
    final_logit_softcapping=3.0, max_position_embeddings=128, initializer_range=0.2,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def build(config_class: str, kwargs: dict, norms: tuple[float, float] = (0.5, 1.5)):
  """A transformers model of `config_class` (a transformers name), random weights, its norm
  weights uniform in `norms`; seeded, so every call gives the same model."""
  import torch
  import transformers

  torch.manual_seed(0)
  config = getattr(transformers, config_class)(**kwargs)
  hf = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if name.endswith("norm.weight"):
        p.uniform_(*norms)
  return hf


def logits(hf, ids: list[int]) -> np.ndarray:
  """[len(ids), V] transformers logits at every position."""
  import torch

  with torch.no_grad():
    return hf(torch.tensor([ids])).logits[0].numpy()


def assert_logits_match(hf, model, n: int = 40, page_size: int = 4):
  """n random tokens: jaxserve's logits at every position (a paged forward over pages of
  `page_size`) within 1e-4 of transformers'."""
  ids = [int(i) for i in np.random.default_rng(0).integers(0, hf.config.vocab_size, n)]
  ours = np.asarray(dense_logits(model, ids, page_size=page_size))
  assert np.abs(ours - logits(hf, ids)).max() < 1e-4


def greedy(hf, prompt: list[int], n: int) -> list[int]:
  """transformers' n greedy tokens after `prompt` (generate, with its KV cache)."""
  import torch

  with torch.no_grad():
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def argmax_tokens(hf, prompt: list[int], n: int) -> list[int]:
  """n greedy tokens after `prompt`, each the argmax of a full forward (no KV cache)."""
  ids = list(prompt)
  for _ in range(n):
    ids.append(int(np.argmax(logits(hf, ids)[-1])))
  return ids[len(prompt):]


def write_gguf(hf, path, arch: str, window: int | None = None):
  """`hf` as a float32 GGUF of architecture `arch` ("llama", "qwen3" or "phi3"), with the
  metadata and tensors llama.cpp's converter writes for it: gguf's own HF -> GGUF tensor-name
  map; Q/K rows permuted for llama (its interleaved RoPE); Phi-3's qkv_proj and gate_up_proj
  kept whole (attn_qkv, ffn_up), its `sliding_window` (0: none) and LongRoPE factors as tensors.
  `window`: a llama file's `llama.attention.sliding_window` (Mistral's window)."""
  import gguf

  c = hf.config
  w = gguf.GGUFWriter(str(path), arch)
  _write_metadata(w, c, arch, window)
  names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
  for name, t in hf.state_dict().items():
    if name == "lm_head.weight" and c.tie_word_embeddings:
      continue  # Tied: save_pretrained stores no head, so the converter writes none.
    t = t.numpy().astype(np.float32)
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
      heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
      t = _llama_cpp_rows(t, heads)
    w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(t))
  for kind in ("long", "short"):  # Phi-3's LongRoPE: one factor per frequency, as tensors.
    if f"{kind}_factor" in c.rope_parameters:
      w.add_tensor(f"rope_factors_{kind}.weight",
                   np.asarray(c.rope_parameters[f"{kind}_factor"], np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _write_metadata(w, c, arch: str, window: int | None):
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_rope_freq_base(c.rope_parameters["rope_theta"])
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_key_length(c.head_dim)
  w.add_value_length(c.head_dim)
  w.add_rope_dimension_count(c.head_dim)
  w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
  if arch == "llama":
    w.add_vocab_size(c.vocab_size)
  if window:
    w.add_sliding_window(window)
  if arch == "phi3":
    original = c.original_max_position_embeddings
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(c.sliding_window or 0)
    if "long_factor" in c.rope_parameters:  # transformers' default attention factor.
      scale = c.max_position_embeddings / original
      w.add_rope_scaling_attn_factors(
          math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _llama_cpp_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's converter reorders Q/K rows per head for its interleaved RoPE:
  (2, pairs) -> (pairs, 2) within each head."""
  return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def save_qwen3(tokenizer, path, sentence_transformers: bool = False):
  """A tiny random Qwen3 with `tokenizer` (its vocabulary) saved in `path`, for pooling models
  (issue 51); with `sentence_transformers`, that library's files asking for mean pooling and
  normalization, and Matryoshka dimensions 16 and 32 in its config.json."""
  hf = build("Qwen3Config", dict(FAMILIES["qwen3"][1], vocab_size=tokenizer.vocab_size))
  hf.save_pretrained(path)
  tokenizer.save(path)
  if sentence_transformers:
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True,
         "pooling_mode_lasttoken": False}))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, matryoshka_dimensions=[16, 32])))
  return hf


# Gemma 3 4B's multimodal shape, scaled down: a SigLIP tower of 2 layers over 28-pixel images in
# 7-pixel patches (16 patches), pooled 2 x 2 into 4 soft tokens; the image token ids inside the
# tiny vocabulary (the real ones sit past the text vocabulary's end; transformers maps those to
# 0 before the lookup, a row the soft tokens replace either way).
GEMMA3_VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=2, image_size=28, patch_size=7, vision_use_head=False)
GEMMA3_IMAGE_IDS = dict(mm_tokens_per_image=4, boi_token_index=251, image_token_index=252,
                        eoi_token_index=253)


def build_gemma3_vision(text: dict = GEMMA3, norms: tuple[float, float] = (-0.5, 0.5)):
  """A tiny random Gemma3ForConditionalGeneration (its text model `text`), norms and the
  projector (which inits to zeros) randomised; seeded."""
  import torch
  import transformers

  torch.manual_seed(0)
  config = transformers.Gemma3Config(text_config=text, vision_config=GEMMA3_VISION,
                                     **GEMMA3_IMAGE_IDS)
  hf = transformers.Gemma3ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if name.endswith("norm.weight") and "vision_tower" not in name:
        p.uniform_(*norms)
      elif "vision_tower" in name and name.endswith(("norm1.weight", "norm2.weight")):
        p.uniform_(0.5, 1.5)
      elif name.endswith("mm_input_projection_weight"):
        p.normal_(0.0, 0.3)
  return hf


def image_features(hf, pixels: np.ndarray) -> np.ndarray:
  """transformers' soft tokens [Im, Mi, D] of pixels [Im, 3, S, S]."""
  import torch

  with torch.no_grad():
    return hf.get_image_features(torch.tensor(pixels)).pooler_output.numpy()

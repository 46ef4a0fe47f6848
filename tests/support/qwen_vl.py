"""The tiny random Qwen2.5-VL model shared by the vision tests (test_qwen_vision) and the engine's
(test_qwen_vl_engine): its config, transformers' model with its vision weights randomized, saved
as a Hugging Face folder with a processor config that keeps images small, and transformers'
greedy tokens and logprobs for a prompt with images."""

from __future__ import annotations

import json

import numpy as np

from support.images import hf_greedy, write_char_tokenizer

VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=48,
              window_size=112, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
              fullatt_block_indexes=[1])
# Head dim 16: M-RoPE's three sections turn its 8 frequencies.
TEXT = dict(vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256,
            bos_token_id=0, eos_token_id=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                             "rope_theta": 1e6})
IDS = dict(image_token_id=250, vision_start_token_id=251, vision_end_token_id=252)
# At most 28 * 28 * 64 pixels: 256 patches, 64 tokens an image; encoder buckets of 64 and 256.
PROCESSOR = {"min_pixels": 3136, "max_pixels": 28 * 28 * 64}
# The engine shapes of test_qwen_vl_engine and test_server_qwen_vl: a run of both loads the
# other's programs from the persistent compilation cache.
ENGINE = dict(num_slots=4, page_size=4, num_pages=128, max_model_len=160,
              prefill_buckets=(32, 128), compilation_cache_dir=None)
# Qwen's chat template's content loop: an image part is start, one placeholder, end.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 3: "<unk>",
           IDS["image_token_id"]: "<|image_pad|>", IDS["vision_start_token_id"]: "<|vision_start|>",
           IDS["vision_end_token_id"]: "<|vision_end|>"}
WORDS = {4: "user", 5: "assistant"}


def build(seed: int = 0):
  """The tiny model, its weights random (norms uniform in [0.5, 1.5], matrices of std
  1 / sqrt(fan_in), biases of std 0.1): transformers' init (std 0.02, norms 1, biases 0) leaves
  attention near uniform, where positions, and so M-RoPE, barely change an output."""
  import torch
  import transformers

  torch.manual_seed(seed)
  config = transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT, **IDS)
  hf = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "norm" in name or "ln_q" in name or "layernorm" in name:
        p.uniform_(0.5, 1.5)
      elif p.ndim == 1:
        p.normal_(0, 0.1)
      else:
        p.normal_(0, p[0].numel() ** -0.5)
  return hf


def save(hf, path) -> None:
  """The model as a Hugging Face folder, with PROCESSOR's preprocessor_config.json and a
  character-level tokenizer that spells Qwen's chat and image tokens."""
  hf.save_pretrained(path)
  (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
  write_char_tokenizer(path, SPECIAL, WORDS, dict(eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                                  add_bos_token=False, chat_template=TEMPLATE))


def reference(hf, ids: list[int], patches: list[np.ndarray], grids: list[tuple[int, int, int]],
              num_tokens: int) -> tuple[list[int], list[float]]:
  """transformers' greedy tokens and their logprobs (of the raw logits) for prompt `ids` whose
  images are `patches` [P, patch_dim] with their `grids`."""
  import torch

  inputs = dict(mm_token_type_ids=(torch.tensor([ids]) == IDS["image_token_id"]).int())
  if patches:
    inputs["pixel_values"] = torch.tensor(np.concatenate(patches))
    inputs["image_grid_thw"] = torch.tensor(grids)
  return hf_greedy(hf, ids, num_tokens, **inputs)

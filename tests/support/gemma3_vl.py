"""The tiny random Gemma 3 vision-language model's reference side, shared by the engine's tests
(test_gemma3_vision) and the server's (test_server_vision): its pictures, transformers' greedy
tokens and logprobs for a prompt with images, and a tokenizer for its 256-token vocabulary that
spells Gemma 3's chat and image tokens, so that a server can template and tokenize its chats."""

from __future__ import annotations

import numpy as np

from support import hf_tiny
from support.images import MM_TEMPLATE, hf_greedy, write_char_tokenizer

IDS = hf_tiny.GEMMA3_IMAGE_IDS
IMAGE = IDS["image_token_index"]

# Gemma 3's special tokens at their ids in its real vocabulary where the tiny one has room for
# them (the image tokens at the tiny model's ids); "user" and "model" one token each, to keep
# prompts short; every other character one token.
SPECIAL = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 105: "<start_of_turn>",
           106: "<end_of_turn>", IDS["boi_token_index"]: "<start_of_image>",
           IMAGE: "<image_soft_token>", IDS["eoi_token_index"]: "<end_of_image>"}
WORDS = {107: "user", 108: "model"}


def pictures(n: int, seed: int = 0) -> list[np.ndarray]:
  """n random uint8 [H, W, 3] images of odd sizes (the resize has work to do)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, (17 + 9 * i, 40 - 5 * i, 3), dtype=np.uint8) for i in range(n)]


def reference(hf, ids: list[int], pixels: list[np.ndarray],
              num_tokens: int) -> tuple[list[int], list[float]]:
  """transformers' greedy tokens and their logprobs: generate with the image tokens typed
  (token_type_ids 1: attended both ways within an image, as the processor marks them). The
  logprobs are of the raw logits: min_new_tokens' processor masks the end token in `scores`."""
  import torch

  inputs = dict(token_type_ids=(torch.tensor([ids]) == IMAGE).long())
  if pixels:
    inputs["pixel_values"] = torch.tensor(np.stack(pixels))
  return hf_greedy(hf, ids, num_tokens, **inputs)


def write_tokenizer(path, vocab_size: int = 256) -> None:
  """A character-level tokenizer.json and tokenizer_config.json (Gemma 3's chat template's
  content loop: support.images.MM_TEMPLATE) for the tiny model, into its folder `path`."""
  write_char_tokenizer(path, SPECIAL, WORDS, dict(bos_token="<bos>", eos_token="<eos>",
                                                  pad_token="<pad>", add_bos_token=True,
                                                  chat_template=MM_TEMPLATE), vocab_size)

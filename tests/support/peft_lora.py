"""peft's side of the LoRA tests: adapters peft itself creates over a transformers model (random
A and B, saved as PEFT writes them), and their greedy tokens and logprobs, one full forward a
token."""

from __future__ import annotations

import copy

import numpy as np
import peft
import torch

from jaxserve.config import LoRARequest
from support import hf_tiny

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, LoraConfig kwargs): rank 8 on every projection, rank 16 with rsLoRA on attention and
# down, rank 4 on the MLP's gate and up.
ADAPTERS = [("a1", dict(r=8, lora_alpha=16, target_modules=ALL)),
            ("a2", dict(r=16, lora_alpha=8, use_rslora=True,
                        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])),
            ("a3", dict(r=4, lora_alpha=4, target_modules=["gate_proj", "up_proj"]))]
N = 8  # Tokens each request generates.


def make_adapters(hf, root, adapters=ADAPTERS) -> dict:
  """name -> (LoRARequest, the peft model): each adapter over its own copy of `hf`, saved."""
  out = {}
  for i, (name, kwargs) in enumerate(adapters, 1):
    torch.manual_seed(i)
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(init_lora_weights=False,
                                                                   **kwargs)).eval()
    model.save_pretrained(root / name)
    out[name] = (LoRARequest(name, i, str(root / name)), model)
  return out


def reference(model, prompt: list[int], n: int = N) -> tuple[list[int], list[float]]:
  """transformers' (or peft's) n greedy tokens alone, each the argmax of a full forward, and
  each one's logprob."""
  ids, logprobs = list(prompt), []
  for _ in range(n):
    x = hf_tiny.logits(model, ids)[-1].astype(np.float64)
    x = x - x.max() - np.log(np.exp(x - x.max()).sum())
    ids.append(int(np.argmax(x)))
    logprobs.append(float(x[ids[-1]]))
  return ids[len(prompt):], logprobs

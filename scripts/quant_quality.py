"""int8 weights against float32 on the default model: top-1 agreement and mean KL(float || int8)
over teacher-forced positions (issue 24's bounds: >= 98% and <= 0.02).

  python scripts/quant_quality.py [--windows 32] [--tokens 64]

The text is this repository's README.md, cut into windows of 16 context tokens + `tokens` scored
ones; both models see the same ids (teacher forcing), so each position compares one next-token
distribution.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONTEXT = 16


def windows(tokenizer, count: int, tokens: int) -> list[list[int]]:
  ids = tokenizer.encode((ROOT / "README.md").read_text())
  size = CONTEXT + tokens
  if len(ids) < count * size:
    raise ValueError(f"README.md has {len(ids)} tokens, fewer than {count} windows of {size}")
  return [ids[i * size:(i + 1) * size] for i in range(count)]


def compare(reference, candidate, sequences, logits_fn) -> dict:
  """Top-1 agreement and mean KL(reference || candidate) at every scored position."""
  import jax

  agree, kls = [], []
  for ids in sequences:
    p = np.asarray(logits_fn(reference, ids))[CONTEXT - 1:-1]  # [tokens, V]: next-token logits.
    q = np.asarray(logits_fn(candidate, ids))[CONTEXT - 1:-1]
    agree.append(p.argmax(-1) == q.argmax(-1))
    lp, lq = jax.nn.log_softmax(p, -1), jax.nn.log_softmax(q, -1)
    kls.append(np.sum(np.exp(lp) * (lp - lq), -1))
  return {"top1_agreement": float(np.mean(np.concatenate(agree))),
          "mean_kl": float(np.mean(np.concatenate(kls))),
          "positions": int(sum(a.size for a in agree))}


def int8_model(model):
  """The same weights, int8 per output channel (loading/quantize.py)."""
  import jax
  from flax import nnx

  from jaxserve.loading import checkpoint, quantize

  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  return checkpoint.build_model(model.cfg, quantize.to_int8(params))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--windows", type=int, default=32)
  p.add_argument("--tokens", type=int, default=64)
  args = p.parse_args()
  import sys
  sys.path.insert(0, str(ROOT / "tests"))
  from jaxserve.loading import checkpoint
  from support.tiny import dense_logits

  model, tokenizer = checkpoint.load_model(None)
  result = compare(model, int8_model(model), windows(tokenizer, args.windows, args.tokens),
                   dense_logits)
  print(json.dumps(result))


if __name__ == "__main__":
  main()

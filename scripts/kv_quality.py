"""Quantized KV against float32 KV on the default model: teacher-forced logits, per KV dtype.

The text is this repository's README.md cut into windows of 16 context tokens + 64 scored ones,
as scripts/quant_quality.py does for int8 weights (--workload: the first tokens of the prompts
of scripts/workloads/peers_64.jsonl instead, words drawn at random from a list: flat, near-tied
next-token distributions, a harsher test of top-1). Each window runs one full forward with its
K/V written to the cache and read back from it, once with float32 KV and once with each
quantized dtype, in the ragged layout (the kernels' pages, on the jnp path;
tests/test_kernels_ragged.py holds the kernels to the same numbers). Per dtype: the fraction of
scored positions whose top-1 token agrees with float32's, and the mean (and max)
KL(p_float32 || p_quant). Issue 24's bar: top-1 >= 98%, mean KL <= 0.02.

  python scripts/kv_quality.py                       # 32 windows x 64 tokens, every 8-bit dtype
  python scripts/kv_quality.py --windows 4 --kv-dtype int8
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import EngineConfig, KVDtype, KVLayout
from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.kv_cache import KVCache

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "scripts" / "workloads" / "peers_64.jsonl"
QUANTIZED = (KVDtype.INT8, KVDtype.FLOAT8_E4M3, KVDtype.FLOAT8_E5M2)
PAGE_SIZE = 32
CONTEXT = 16  # Tokens before the first scored position.


def readme_windows(tokenizer, count: int, tokens: int = 64) -> np.ndarray:
  """[count, CONTEXT + tokens] ids: consecutive windows of README.md."""
  ids = tokenizer.encode((ROOT / "README.md").read_text())
  size = CONTEXT + tokens
  if len(ids) < count * size:
    raise ValueError(f"README.md has {len(ids)} tokens, fewer than {count} windows of {size}")
  return np.asarray(ids[:count * size], np.int32).reshape(count, size)


def workload_windows(count: int, tokens: int = 64) -> np.ndarray:
  """[count, CONTEXT + tokens] ids: the first of each peers_64 prompt that long."""
  rows = [json.loads(line)["prompt_token_ids"] for line in WORKLOAD.read_text().splitlines()]
  long = [r[:CONTEXT + tokens] for r in rows if len(r) >= CONTEXT + tokens]
  if len(long) < count:
    raise ValueError(f"{WORKLOAD.name} has {len(long)} prompts of {CONTEXT + tokens} tokens")
  return np.asarray(long[:count], np.int32)


def _log_probs(model, ids, kv_dtype: KVDtype):
  """[T, V] float32 log-probabilities of one teacher-forced forward over ids [T]."""
  n = ids.shape[0]
  engine = EngineConfig(num_slots=1, page_size=PAGE_SIZE, num_pages=-(-n // PAGE_SIZE) + 1,
                        max_model_len=n, prefill_buckets=(n,), kv_layout=KVLayout.RAGGED,
                        kv_dtype=kv_dtype)
  meta = AttentionMetadata.one_sequence(n, PAGE_SIZE)
  logits, _ = model(ids[None], KVCache.create(model.cfg, engine), meta, last_only=False)
  scored = logits[0, CONTEXT - 1:-1]  # [tokens, V]: the next-token logits of scored positions.
  return jax.nn.log_softmax(scored.astype(jnp.float32), axis=-1)


_log_probs_jit = nnx.jit(_log_probs, static_argnums=(2,))


def compare(model, seqs: np.ndarray, kv_dtypes=QUANTIZED) -> dict[str, dict[str, float]]:
  """{dtype label: {top1_agreement, mean_kl, max_kl}} against float32 KV over every position."""
  ref = [_log_probs_jit(model, jnp.asarray(s), KVDtype.FLOAT32) for s in seqs]
  result = {}
  for kv_dtype in kv_dtypes:
    agree, kls = [], []
    for s, lp_ref in zip(seqs, ref):
      lp = _log_probs_jit(model, jnp.asarray(s), kv_dtype)
      agree.append(np.asarray(jnp.argmax(lp, -1) == jnp.argmax(lp_ref, -1)))
      kls.append(np.asarray(jnp.sum(jnp.exp(lp_ref) * (lp_ref - lp), axis=-1)))  # [T]
    kl = np.concatenate(kls)
    result[kv_dtype.label] = {"top1_agreement": float(np.mean(np.concatenate(agree))),
                              "mean_kl": float(np.mean(kl)), "max_kl": float(np.max(kl)),
                              "positions": int(kl.size)}
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default=None, help="default: the default model")
  parser.add_argument("--windows", type=int, default=32)
  parser.add_argument("--tokens", type=int, default=64, help="scored tokens per window")
  parser.add_argument("--workload", action="store_true", help="peers_64's random-word prompts")
  parser.add_argument("--kv-dtype", action="append", choices=[d.label for d in QUANTIZED])
  args = parser.parse_args()
  from jaxserve.loading import checkpoint

  model, tokenizer = checkpoint.load_model(args.model)
  dtypes = [d for d in QUANTIZED if not args.kv_dtype or d.label in args.kv_dtype]
  seqs = (workload_windows(args.windows, args.tokens) if args.workload else
          readme_windows(tokenizer, args.windows, args.tokens))
  result = compare(model, seqs, dtypes)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()

"""Which 8-bit forms keep the default model's predictions: int8 weight layouts and KV encodings,
each scored by issue 24's measure against the float32 model.

The measure (scripts/quant_quality.py's): 32 README prompts of 16 tokens, each followed by the
float model's own 64 greedy tokens; both models are teacher-forced on those ids and compared at
each scored position: top-1 agreement and mean KL(float || quantized). Bounds: >= 98%, <= 0.02.
Every form runs one full forward per window in the ragged layout (the jnp path).

  python scripts/quant_sweep.py --part weights     # int8 weight layouts (loading/quantize.py)
  python scripts/quant_sweep.py --part kv          # KV encodings, fake-quantized in float32 KV
  python scripts/quant_sweep.py --windows 4        # a quick proof run

KV forms other than the stored ones (int8 as kv_quant.py encodes it, float8 with scale 1.0) are
fake-quantized: K and V are rounded as the form would store them, then kept in float32 KV, so a
form is measured before any kernel stores it. float8's calibrated scales come from the float
model's K/V maxima over README text after the scored windows (not the scored text).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import kv_quality
import quant_quality

from jaxserve.config import KVDtype
from jaxserve.model import kv_cache

F32 = KVDtype.FLOAT32


def sequences(windows: int, tokens: int, cache: pathlib.Path | None):
  """(the float model, [windows, 16 + tokens] ids: prompts and the float model's greedy
  continuations), the ids read from `cache` when it holds them."""
  from jaxserve.config import EngineConfig
  from jaxserve.llm import LLM

  llm = LLM(None, engine_config=EngineConfig(num_slots=8, max_model_len=256, num_pages=256,
                                             prefill_buckets=(32,), quantization="none",
                                             compilation_cache_dir=None))
  key = f"{windows}x{tokens}"
  saved = json.loads(cache.read_text()) if cache and cache.exists() else {}
  if key not in saved:
    prompts = [w[:quant_quality.CONTEXT] for w in quant_quality.windows(llm.tokenizer, windows, 0)]
    saved[key] = quant_quality.continue_greedily(llm, prompts, tokens)
    if cache:
      cache.write_text(json.dumps(saved))
  return llm.model, llm.tokenizer, np.asarray(saved[key], np.int32)


def score(model, seqs, refs, kv_dtype=F32) -> dict:
  """Top-1 agreement and mean KL(ref || model) over every scored position; a fresh jit, so a
  patched KVCache.write is traced anew."""
  run = nnx.jit(kv_quality._log_probs, static_argnums=(2,))
  agree, kls = [], []
  for s, ref in zip(seqs, refs):
    lp = run(model, jnp.asarray(s), kv_dtype)
    agree.append(np.asarray(jnp.argmax(lp, -1) == jnp.argmax(ref, -1)))
    kls.append(np.asarray(jnp.sum(jnp.exp(ref) * (ref - lp), -1)))
  kl = np.concatenate(kls)
  return {"top1": round(float(np.mean(np.concatenate(agree))), 4),
          "mean_kl": round(float(np.mean(kl)), 5), "max_kl": round(float(np.max(kl)), 3)}


# ---- Weights: each form is a params -> params transform (loading/quantize.py).

def weight_forms():
  from jaxserve.loading import quantize
  from jaxserve.model.quant import IN_AXES, Layout

  every = lambda layout: {n: layout for n in IN_AXES}
  no_embed = lambda layout: {n: layout for n in IN_AXES if n not in ("embed", "lm_head")}
  q = lambda layouts: lambda p: quantize.to_int8(p, layouts)
  return {
      "per channel": q(every(Layout(None))),
      "per channel, embedding float": q(no_embed(Layout(None))),
      "per channel, least-error clip": least_error_per_channel,
      "g32": q(every(Layout(32))),
      "g16": q(every(Layout(16))),
      "g32 + minimum": q(every(Layout(32, True))),
      "g16 + minimum": q(every(Layout(16, True))),
      "g32, embedding float": q(no_embed(Layout(32))),
  }


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def least_error_per_channel(params):
  """int8 per output channel with each channel's scale shrunk to the one (max |w| / 127 times a
  ratio of CLIP_RATIOS) whose rounding has the least squared error (MSE clipping, as AWQ's and
  GPTQ's scale searches do): a few large weights clipped to give every other one a finer step."""
  from jaxserve.loading import quantize
  from jaxserve.model.quant import IN_AXES

  params = quantize.to_float(params)
  for holder, name, lead in quantize._weights(params):
    w, axes = holder[name], tuple(a + lead for a in IN_AXES[name])
    amax = np.maximum(np.max(np.abs(w), axis=axes, keepdims=True), 1e-30) / 127
    best, best_err = amax, np.full(amax.shape, np.inf, np.float32)
    for r in CLIP_RATIOS:
      s = amax * np.float32(r)
      err = np.sum(np.square(np.clip(np.rint(w / s), -127, 127) * s - w), axes, keepdims=True)
      best, best_err = np.where(err < best_err, s, best), np.minimum(err, best_err)
    holder[name] = {"values": np.clip(np.rint(w / best), -127, 127).astype(np.int8),
                    "scale": best.astype(np.float32)}
  return params


def alignment(params) -> dict:
  """Relative RMS rounding error of each group form on two weights (w_up and the embedding) and
  on Gaussian weights of their shapes: a form far better on the model than on Gaussians rides on
  the source's own blocks (the default model is a dequantized Q4_1/Q8_0 GGUF)."""
  from jaxserve.model.quant import IN_AXES, Layout

  rng, out = np.random.default_rng(0), {}
  for name, w, in_axes in (("w_up", params["layers"]["w_up"][0], IN_AXES["w_up"]),
                           ("embed", params["embed"], IN_AXES["embed"])):
    gauss = rng.standard_normal(w.shape).astype(np.float32)
    for label, layout in (("per channel", Layout(None)), ("g32", Layout(32)),
                          ("g16", Layout(16)), ("g32 + minimum", Layout(32, True))):
      out[f"{name} {label}"] = {"model": _rel_error(np.asarray(w), in_axes, layout),
                                "gaussian": _rel_error(gauss, in_axes, layout)}
  return out


def _rel_error(x, in_axes, layout) -> float:
  from jaxserve.loading import quantize

  err = quantize.dequantize(quantize.int8(x, in_axes, layout)) - x
  return round(float(np.sqrt(np.mean(np.square(err)) / np.mean(np.square(x)))), 5)


def run_weights(model, seqs, refs) -> None:
  from jaxserve.loading import checkpoint

  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  print(json.dumps({"alignment": alignment(params)}), flush=True)
  for label, form in weight_forms().items():
    t = time.perf_counter()
    r = score(checkpoint.build_model(model.cfg, form(params)), seqs, refs)
    print(json.dumps({"weights": label, **r, "s": round(time.perf_counter() - t)}), flush=True)


# ---- KV: each form rounds one token's K or V [B, T, K, H] as it would be stored.

def _int8(x, scale_of, block: int | None = None):
  """Symmetric int8 per token-head (or per `block` lanes of it) with scale_of(amax / 127)."""
  shape = x.shape
  if block:
    x = x.reshape(*shape[:-1], shape[-1] // block, block)
  s = scale_of(jnp.maximum(jnp.max(jnp.abs(x), -1, keepdims=True), 1e-30) / 127)
  return (jnp.clip(jnp.round(x / s), -127, 127) * s).reshape(shape)


def _cast(dtype):
  return lambda s: s.astype(dtype).astype(jnp.float32)


def _log_steps(n: int):
  """A scale rounded up to a power of 2^(1/n) whose exponent fits one int8."""
  return lambda s: jnp.exp2(jnp.clip(jnp.ceil(n * jnp.log2(s)), -128, 127) / n)


def _float8(x, dtype, scale):
  top = float(jnp.finfo(dtype).max)
  return jnp.clip(x / scale, -top, top).astype(dtype).astype(jnp.float32) * scale


def kv_forms(amax):
  """label -> (kv dtype, rounding (x, layer, 0 for K / 1 for V) or None: stored as it is).
  amax [L, 2]: the float model's K and V maxima per layer (calibration)."""
  e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
  per_layer = lambda dtype: jnp.asarray(amax / float(jnp.finfo(dtype).max), jnp.float32)
  per_tensor = lambda dtype: jnp.max(per_layer(dtype), 0)  # [2]: one for K, one for V.
  forms = {
      "int8 2^e (stored)": (KVDtype.INT8, None),
      "int8 f32 scale": (F32, lambda x, l, i: _int8(x, lambda s: s)),
      "int8 f16 scale": (F32, lambda x, l, i: _int8(x, _cast(jnp.float16))),
      "int8 2^(e/4)": (F32, lambda x, l, i: _int8(x, _log_steps(4))),
      "int8 2^(e/8)": (F32, lambda x, l, i: _int8(x, _log_steps(8))),
      "int8 f32 scale per 32": (F32, lambda x, l, i: _int8(x, lambda s: s, 32)),
      "e4m3 scale 1 (stored)": (KVDtype.FLOAT8_E4M3, None),
      "e4m3 per tensor": (F32, lambda x, l, i: _float8(x, e4, per_tensor(e4)[i])),
      "e4m3 per layer": (F32, lambda x, l, i: _float8(x, e4, per_layer(e4)[l, i])),
      "e5m2 scale 1 (stored)": (KVDtype.FLOAT8_E5M2, None),
      "e5m2 per layer": (F32, lambda x, l, i: _float8(x, e5, per_layer(e5)[l, i])),
  }
  return forms


def calibrate(model, tokenizer, skip: int, count: int = 4, size: int = 256) -> np.ndarray:
  """[L, 2]: max |K| and max |V| per layer over `count` windows of README text after its first
  `skip` tokens."""
  from jaxserve.config import EngineConfig, KVLayout
  from jaxserve.model.attention import AttentionMetadata

  ids = tokenizer.encode((ROOT / "README.md").read_text())[skip:skip + count * size]
  engine = EngineConfig(num_slots=1, page_size=32, num_pages=size // 32 + 1, max_model_len=size,
                        prefill_buckets=(size,), kv_layout=KVLayout.RAGGED, kv_dtype=F32)
  meta = AttentionMetadata.one_sequence(size, 32)

  @nnx.jit
  def rows(model, x):
    return model(x[None], kv_cache.KVCache.create(model.cfg, engine), meta)[1].k  # [L, P, Z, Cr]

  n = model.cfg.num_kv_heads * model.cfg.head_dim
  amax = np.zeros((model.cfg.num_layers, 2), np.float32)
  for i in range(count):
    r = np.abs(np.asarray(rows(model, jnp.asarray(ids[i * size:(i + 1) * size], jnp.int32))))
    kv = np.stack([r[..., :n].max((1, 2, 3)), r[..., n:2 * n].max((1, 2, 3))], -1)  # [L, 2]
    amax = np.maximum(amax, kv)
  return amax


def run_kv(model, tokenizer, seqs, refs) -> None:
  amax = calibrate(model, tokenizer, skip=seqs.size)
  print(json.dumps({"calibration amax K, V (min/max over layers)": [
      [float(amax[:, i].min()), float(amax[:, i].max())] for i in (0, 1)]}), flush=True)
  write = kv_cache.KVCache.write
  for label, (kv_dtype, rounding) in kv_forms(amax).items():
    t = time.perf_counter()
    if rounding is not None:
      kv_cache.KVCache.write = lambda self, layer, index, k, v, f=rounding: write(
          self, layer, index, f(k, layer, 0), f(v, layer, 1))
    try:
      r = score(model, seqs, refs, kv_dtype)
    finally:
      kv_cache.KVCache.write = write
    print(json.dumps({"kv": label, **r, "s": round(time.perf_counter() - t)}), flush=True)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--part", choices=("weights", "kv", "all"), default="all")
  p.add_argument("--windows", type=int, default=32)
  p.add_argument("--tokens", type=int, default=64)
  p.add_argument("--cache", type=pathlib.Path, default=None, help="a JSON file for the ids")
  args = p.parse_args()
  model, tokenizer, seqs = sequences(args.windows, args.tokens, args.cache)
  ref_fn = nnx.jit(kv_quality._log_probs, static_argnums=(2,))
  refs = [ref_fn(model, jnp.asarray(s), F32) for s in seqs]
  print(json.dumps({"float32 greedy = teacher top-1": float(np.mean(
      [np.mean(np.asarray(jnp.argmax(r, -1)) == s[quant_quality.CONTEXT:])
       for r, s in zip(refs, seqs)]))}), flush=True)
  if args.part in ("weights", "all"):
    run_weights(model, seqs, refs)
  if args.part in ("kv", "all"):
    run_kv(model, tokenizer, seqs, refs)


if __name__ == "__main__":
  main()

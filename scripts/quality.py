"""How close 8-bit weights and KV stay to the float32 default model, teacher-forced: one command
per question (issue 24's bounds: top-1 agreement >= 98%, mean KL(float32 || quantized) <= 0.02).

  python scripts/quality.py weights [--windows 32] [--tokens 64]   # --quantization int8's weights
  python scripts/quality.py kv [--windows 4 --kv-dtype int8] [--workload]   # the served KV dtypes
  python scripts/quality.py sweep --part weights|kv [--windows 4]  # every 8-bit form, stored or not
  python scripts/quality.py sweep --part activations   # --cpu-activations int8 against float

weights: the prompts are 16-token windows of this repository's README.md; the scored tokens are
the float model's own greedy continuation of each (`continue_greedily`), fed to both models
(teacher forcing), so each position compares one next-token distribution. (Scored on README text
itself, where many positions are near-ties, per-channel int8 agreed on 91-93% and Q8_0-like
groups of 32 on 96%, at mean KL 0.006-0.008 and 0.002: BENCHMARKS.md.)

kv: the text is README.md itself cut into windows of 16 context tokens + 64 scored ones
(--workload: the first tokens of the prompts of scripts/workloads/peers_64.jsonl instead, words
drawn at random from a list: flat, near-tied next-token distributions, a harsher test of top-1).
Each window runs one full forward with its K/V written to the cache and read back from it, once
with float32 KV and once with each quantized dtype, in the ragged layout (the kernels' pages, on
the jnp path; tests/test_kernels_ragged.py holds the kernels to the same numbers). Per dtype: the
fraction of scored positions whose top-1 token agrees with float32's, and the mean (and max)
KL(p_float32 || p_quant).

sweep: int8 weight layouts (loading/quantize.py) and KV encodings, each scored by `weights`'
measure (32 README prompts of 16 tokens, each followed by the float model's own 64 greedy tokens)
in the ragged layout (the jnp path). KV forms other than the stored ones (int8 as kv_quant.py
encodes it, float8 with scale 1.0) are fake-quantized: K and V are rounded as the form would
store them, then kept in float32 KV, so a form is measured before any kernel stores it. float8's
calibrated scales come from the float model's K/V maxima over README text after the scored
windows (not the scored text). activations: the GGUF blocks read by kernels_cpu, with int8
activations (`--cpu-activations int8`) against float activations and against float32, on the same
sequences.
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

from jaxserve.config import EngineConfig, KVDtype, KVLayout
from jaxserve.engine import kv_spec
from jaxserve.model import kv_cache
from jaxserve.model.attention import AttentionMetadata

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "scripts" / "workloads" / "peers_64.jsonl"
CONTEXT = 16  # Tokens before the first scored position.
QUANTIZED = (KVDtype.INT8, KVDtype.FLOAT8_E4M3, KVDtype.FLOAT8_E5M2)
PAGE_SIZE = 32
F32 = KVDtype.FLOAT32


# ---- weights: int8 weights against float32


def windows(tokenizer, count: int, tokens: int) -> list[list[int]]:
  ids = tokenizer.encode((ROOT / "README.md").read_text())
  size = CONTEXT + tokens
  if len(ids) < count * size:
    raise ValueError(f"README.md has {len(ids)} tokens, fewer than {count} windows of {size}")
  return [ids[i * size:(i + 1) * size] for i in range(count)]


def continue_greedily(llm, prompts: list[list[int]], tokens: int) -> list[list[int]]:
  """Each prompt followed by `tokens` greedy tokens of `llm` (jaxserve.LLM): the sequences both
  models are then teacher-forced on."""
  from jaxserve.config import SamplingParams

  greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
  return [p + list(out.token_ids) for p, out in zip(prompts, llm.generate(prompts, greedy))]


def compare_weights(reference, candidate, sequences, logits_fn) -> dict:
  """Top-1 agreement and mean KL(reference || candidate) at every scored position."""
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
  """The same weights as `--quantization int8` stores them (loading/quantize.py)."""
  from jaxserve.loading import checkpoint, quantize

  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  return checkpoint.build_model(model.cfg, quantize.to_int8(params))


def main_weights(args) -> None:
  sys.path.insert(0, str(ROOT / "tests"))
  from jaxserve.llm import LLM
  from support.tiny import dense_logits

  llm = LLM(None, engine_config=EngineConfig(num_slots=8, max_model_len=256, num_pages=256,
                                             prefill_buckets=(32,), quantization="none",
                                             compilation_cache_dir=None))
  prompts = [w[:CONTEXT] for w in windows(llm.tokenizer, args.windows, 0)]
  sequences = continue_greedily(llm, prompts, args.tokens)
  result = compare_weights(llm.model, int8_model(llm.model), sequences, dense_logits)
  print(json.dumps(result))


# ---- kv: quantized KV against float32 KV


def readme_windows(tokenizer, count: int, tokens: int = 64) -> np.ndarray:
  """[count, CONTEXT + tokens] ids: consecutive windows of README.md."""
  return np.asarray(windows(tokenizer, count, tokens), np.int32)


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
  logits, _ = model(ids[None], kv_spec.create_one_group(model.cfg, engine), meta, last_only=False)
  scored = logits[0, CONTEXT - 1:-1]  # [tokens, V]: the next-token logits of scored positions.
  return jax.nn.log_softmax(scored.astype(jnp.float32), axis=-1)


_log_probs_jit = nnx.jit(_log_probs, static_argnums=(2,))


def compare_kv(model, seqs: np.ndarray, kv_dtypes=QUANTIZED) -> dict[str, dict[str, float]]:
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


def main_kv(args) -> None:
  from jaxserve.loading import checkpoint

  model, tokenizer = checkpoint.load_model(args.model)
  dtypes = [d for d in QUANTIZED if not args.kv_dtype or d.label in args.kv_dtype]
  seqs = (workload_windows(args.windows, args.tokens) if args.workload else
          readme_windows(tokenizer, args.windows, args.tokens))
  result = compare_kv(model, seqs, dtypes)
  print(json.dumps(result, indent=1))


# ---- sweep: every 8-bit form of the weights and the KV


def sequences(count: int, tokens: int, cache: pathlib.Path | None):
  """(the float model, [count, 16 + tokens] ids: prompts and the float model's greedy
  continuations), the ids read from `cache` when it holds them."""
  from jaxserve.config import EngineConfig
  from jaxserve.llm import LLM

  llm = LLM(None, engine_config=EngineConfig(num_slots=8, max_model_len=256, num_pages=256,
                                             prefill_buckets=(32,), quantization="none",
                                             compilation_cache_dir=None))
  key = f"{count}x{tokens}"
  saved = json.loads(cache.read_text()) if cache and cache.exists() else {}
  if key not in saved:
    prompts = [w[:CONTEXT] for w in windows(llm.tokenizer, count, 0)]
    saved[key] = continue_greedily(llm, prompts, tokens)
    if cache:
      cache.write_text(json.dumps(saved))
  return llm.model, llm.tokenizer, np.asarray(saved[key], np.int32)


def score(model, seqs, refs, kv_dtype=F32) -> dict:
  """Top-1 agreement and mean KL(ref || model) over every scored position; a fresh jit, so a
  patched KVPool.write is traced anew."""
  run = nnx.jit(_log_probs, static_argnums=(2,))
  agree, kls = [], []
  for s, ref in zip(seqs, refs):
    lp = run(model, jnp.asarray(s), kv_dtype)
    agree.append(np.asarray(jnp.argmax(lp, -1) == jnp.argmax(ref, -1)))
    kls.append(np.asarray(jnp.sum(jnp.exp(ref) * (ref - lp), -1)))
  kl = np.concatenate(kls)
  return {"top1": round(float(np.mean(np.concatenate(agree))), 4),
          "mean_kl": round(float(np.mean(kl)), 5), "max_kl": round(float(np.max(kl)), 3)}


# sweep, weights: each form is a params -> params transform (loading/quantize.py).

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


# sweep, KV: each form rounds one token's K or V [B, T, K, H] as it would be stored.

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
  ids = tokenizer.encode((ROOT / "README.md").read_text())[skip:skip + count * size]
  engine = EngineConfig(num_slots=1, page_size=32, num_pages=size // 32 + 1, max_model_len=size,
                        prefill_buckets=(size,), kv_layout=KVLayout.RAGGED, kv_dtype=F32)
  meta = AttentionMetadata.one_sequence(size, 32)

  @nnx.jit
  def rows(model, x):
    cache = model(x[None], kv_spec.create_one_group(model.cfg, engine), meta)[1]
    return cache.groups[0].k  # [L, P, Z, Cr]

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
  write = kv_cache.KVPool.write
  for label, (kv_dtype, rounding) in kv_forms(amax).items():
    t = time.perf_counter()
    if rounding is not None:
      kv_cache.KVPool.write = lambda self, layer, index, k, v, f=rounding: write(
          self, layer, index, f(k, layer, 0), f(v, layer, 1))
    try:
      r = score(model, seqs, refs, kv_dtype)
    finally:
      kv_cache.KVPool.write = write
    print(json.dumps({"kv": label, **r, "s": round(time.perf_counter() - t)}), flush=True)


# sweep, activations: the CPU kernel's int8 activation products against its float ones.

def run_activations(seqs, refs) -> None:
  """The default model's GGUF blocks as `--quantization gguf` serves them (kernels_cpu), with
  float activations against the float32 model (`refs`), then with int8 activations
  (`--cpu-activations int8`) against float activations and against the float32 model."""
  from jaxserve.config import CpuActivations, Quantization
  from jaxserve.loading import checkpoint
  from jaxserve.model import quant_linear

  gguf, _ = checkpoint.load_model(None, quantization=Quantization.GGUF)
  as_float = quant_linear.with_activations(gguf, CpuActivations.FLOAT)
  as_int8 = quant_linear.with_activations(gguf, CpuActivations.INT8)
  run = nnx.jit(_log_probs, static_argnums=(2,))
  floats = [run(as_float, jnp.asarray(s), F32) for s in seqs]
  for label, model, against in (("gguf, float activations vs float32", as_float, refs),
                                ("gguf, int8 activations vs float activations", as_int8, floats),
                                ("gguf, int8 activations vs float32", as_int8, refs)):
    t = time.perf_counter()
    r = score(model, seqs, against)
    print(json.dumps({"activations": label, **r, "s": round(time.perf_counter() - t)}), flush=True)


def main_sweep(args) -> None:
  model, tokenizer, seqs = sequences(args.windows, args.tokens, args.cache)
  ref_fn = nnx.jit(_log_probs, static_argnums=(2,))
  refs = [ref_fn(model, jnp.asarray(s), F32) for s in seqs]
  print(json.dumps({"float32 greedy = teacher top-1": float(np.mean(
      [np.mean(np.asarray(jnp.argmax(r, -1)) == s[CONTEXT:])
       for r, s in zip(refs, seqs)]))}), flush=True)
  if args.part in ("weights", "all"):
    run_weights(model, seqs, refs)
  if args.part in ("kv", "all"):
    run_kv(model, tokenizer, seqs, refs)
  if args.part in ("activations", "all"):
    run_activations(seqs, refs)



def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest="command", required=True)
  weights = commands.add_parser("weights", help="--quantization int8's weights against float32")
  weights.add_argument("--windows", type=int, default=32)
  weights.add_argument("--tokens", type=int, default=64)
  kv = commands.add_parser("kv", help="each quantized KV dtype against float32 KV")
  kv.add_argument("--model", default=None, help="default: the default model")
  kv.add_argument("--windows", type=int, default=32)
  kv.add_argument("--tokens", type=int, default=64, help="scored tokens per window")
  kv.add_argument("--workload", action="store_true", help="peers_64's random-word prompts")
  kv.add_argument("--kv-dtype", action="append", choices=[d.label for d in QUANTIZED])
  sweep = commands.add_parser("sweep", help="int8 weight layouts and KV encodings, served or not")
  sweep.add_argument("--part", choices=("weights", "kv", "activations", "all"), default="all")
  sweep.add_argument("--windows", type=int, default=32)
  sweep.add_argument("--tokens", type=int, default=64)
  sweep.add_argument("--cache", type=pathlib.Path, default=None, help="a JSON file for the ids")
  args = parser.parse_args(argv)
  {"weights": main_weights, "kv": main_kv, "sweep": main_sweep}[args.command](args)


if __name__ == "__main__":
  main()

"""Separate q/k/v and gate/up matmuls against one fused QKV and one fused gate/up matmul, on
SmolLM2-135M's layer shapes under a scan of 30 layers (as the model runs them), float32 and a
GGUF-like int8 layout (groups of 32 input values, a scale and a minimum each).

  python scripts/bench_fused_projections.py [--tokens 1,64,512]

Random weights; the attention and the down projection are left out, so the ratio is of the
projections the fusion would change. Median of 7 runs; print ratios, fused / separate.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

D, N, K, H, F, L = 576, 9, 3, 64, 1536, 30  # Shape letters: jaxserve/model/__init__.py.


def dequant(w):
  """(values int8 [L?, D, ...], scale, minimum [D / 32, ...]) -> float32, as quant.dequant."""
  values, scale, minimum = w
  x = values.astype(jnp.float32).reshape(D // 32, 32, *values.shape[1:])
  return (x * scale[:, None] + minimum[:, None]).reshape(values.shape)


def weight(shape, quantized: bool, rng):
  if not quantized:
    return jnp.asarray(rng.normal(size=(L,) + shape).astype(np.float32))
  scale = jnp.asarray(rng.random((L, D // 32) + shape[1:]).astype(np.float32))
  return jnp.asarray(rng.integers(-8, 8, (L,) + shape).astype(np.int8)), scale, scale


def layer_fn(quantized: bool, fused: bool):
  """One layer's projections: x [T, D] -> [T, D] (a cheap mix of their outputs)."""
  value = dequant if quantized else (lambda w: w)

  def mix(q, k, v, gate, up):
    return (q.sum(1)[:, :H].repeat(N, 1) + (k.sum(1) + v.sum(1))[:, :1]
            + (jax.nn.silu(gate) * up)[:, :D])

  if fused:
    def layer(x, w):
      qkv = jnp.einsum("TD,DNH->TNH", x, value(w[0]))  # [T, N + 2K, H]
      gate_up = jnp.einsum("TD,DF->TF", x, value(w[1]))  # [T, 2F]
      return x + mix(qkv[:, :N], qkv[:, N:N + K], qkv[:, N + K:], gate_up[:, :F],
                     gate_up[:, F:]), None
  else:
    def layer(x, w):
      q, k, v = (jnp.einsum("TD,DNH->TNH", x, value(a)) for a in w[:3])
      gate, up = (jnp.einsum("TD,DF->TF", x, value(a)) for a in w[3:])
      return x + mix(q, k, v, gate, up), None
  return layer


def run_ms(tokens: int, quantized: bool, fused: bool) -> float:
  rng = np.random.default_rng(0)
  if fused:
    shapes = [(D, N + 2 * K, H), (D, 2 * F)]
  else:
    shapes = [(D, N, H), (D, K, H), (D, K, H), (D, F), (D, F)]
  weights = tuple(weight(s, quantized, rng) for s in shapes)
  layer = layer_fn(quantized, fused)
  step = jax.jit(lambda x, ws: jax.lax.scan(layer, x, ws)[0])
  x = jnp.full((tokens, D), 0.01, jnp.float32)
  step(x, weights).block_until_ready()
  times = []
  for _ in range(7):
    start = time.perf_counter()
    step(x, weights).block_until_ready()
    times.append(time.perf_counter() - start)
  return 1000 * float(np.median(times))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokens", default="1,64,512")
  args = parser.parse_args()
  print("| tokens | weights | separate ms | fused ms | fused / separate |\n|---|---|---|---|---|")
  for tokens in (int(t) for t in args.tokens.split(",")):
    for quantized in (False, True):
      apart, fused = run_ms(tokens, quantized, False), run_ms(tokens, quantized, True)
      print(f"| {tokens} | {'gguf-like int8' if quantized else 'float32'} | {apart:.1f} | "
            f"{fused:.1f} | {fused / apart:.2f} |", flush=True)


if __name__ == "__main__":
  main()

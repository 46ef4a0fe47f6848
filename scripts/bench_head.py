"""The LM head as the model stores it (tied: the embedding [V, D]) against the same head laid
out as column blocks [Vb, D, Vk] under a scan, for a few rows, on this machine's XLA backend.
An experiment (BENCHMARKS.md, "Tried and not adopted"): the engine does not use blocks.

  python scripts/bench_head.py [--rows 1,2,5,16,32,64] [--vocab 49152] [--dim 576] [--rounds 5]

Random weights of the default model's head shape (SmolLM2-135M's tied embedding [V, D]); each
form jitted once, then timed in interleaved rounds (median of `--steps` calls each, then the
median over rounds), so drift hits both forms alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

BLOCK = 2048  # Vk: columns a block.


def blocks_of(w_DV):
  """The head [D, V] as [Vb, D, Vk] blocks of its columns, the last padded with 0."""
  D, V = w_DV.shape
  pad = -V % BLOCK
  blocks = jnp.pad(w_DV, ((0, 0), (0, pad))).reshape(D, (V + pad) // BLOCK, BLOCK)
  return jnp.transpose(blocks, (1, 0, 2))


def blocked_logits(x_BD, blocks, V: int):
  """x [B, D] times the head, one block of columns at a time -> [B, V]."""
  _, y_VbBVk = jax.lax.scan(lambda carry, w_DVk: (carry, x_BD @ w_DVk), None, blocks)
  return jnp.transpose(y_VbBVk, (1, 0, 2)).reshape(x_BD.shape[0], -1)[:, :V]


def timed(fn, *args, steps: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", default="1,2,5,16,32,64")
  p.add_argument("--vocab", type=int, default=49152)
  p.add_argument("--dim", type=int, default=576)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--steps", type=int, default=10)
  args = p.parse_args(argv)
  V, D = args.vocab, args.dim
  embed = jax.random.normal(jax.random.key(0), (V, D), jnp.float32) * 0.02
  blocks = blocks_of(embed.T)
  stored = jax.jit(lambda x, w: jnp.einsum("...D,VD->...V", x, w))
  blocked = jax.jit(lambda x, b: blocked_logits(x, b, V))
  rows = [int(r) for r in args.rows.split(",")]
  xs = {m: jax.random.normal(jax.random.key(m), (m, D), jnp.float32) for m in rows}
  times = {(m, form): [] for m in rows for form in ("stored", "blocks")}
  for _ in range(args.rounds):
    for m in rows:
      times[m, "stored"].append(timed(stored, xs[m], embed, steps=args.steps))
      times[m, "blocks"].append(timed(blocked, xs[m], blocks, steps=args.steps))
  print(f"| rows | head as stored [V, D] ms | blocks [V/{BLOCK}, D, "
        f"{BLOCK}] ms | blocks / stored |")
  print("|---|---|---|---|")
  for m in rows:
    a, b = statistics.median(times[m, "stored"]), statistics.median(times[m, "blocks"])
    print(f"| {m} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")


if __name__ == "__main__":
  main()

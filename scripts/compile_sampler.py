"""Compiles engine/sample.py's `sample` alone for a TPU on this host (libtpu, no chip), whole and
with one part stubbed out at a time, and prints each compile's CPU seconds: where a step's
compile time goes (issue 23: `plan --compile` time).

  python scripts/compile_sampler.py                       # 64 rows x Qwen2.5's 151,936 tokens
  python scripts/compile_sampler.py --rows 64 --vocab 512
  TPU_STDERR_LOG_LEVEL=0 TPU_MIN_LOG_LEVEL=0 python scripts/compile_sampler.py 2>&1 \
      | grep -E "^(whole|no_)|BACKEND_PASSES|bundle count"   # the compiler's own stage times

Each variant compiles in this process after jax.clear_caches() (a `lax.cond` caches its traced
branches by function, so a patch inside a branch would otherwise not take).
"""

import argparse
import os

import jax
import jax.numpy as jnp

from jaxserve.engine import sample as S
from jaxserve.engine import targets
from jaxserve.engine.sampling_state import SamplingState

_zeros = lambda *a: jnp.zeros_like(a[-1])  # Tokens [B] like positions, the last argument.
# Each: the sample.py function replaced, and by what (the variant's name says which part goes).
VARIANTS = {
    "whole": {},
    "no_full_draw": {"_full_draw": _zeros},  # The whole-vocabulary fallback of a random draw.
    "no_draw": {"_draw": _zeros},  # Every random draw: greedy only.
    "no_logprobs": {"_logprobs": lambda raw, tokens, n: (
        jnp.zeros(tokens.shape), jnp.zeros((tokens.shape[0], n)),
        jnp.zeros((tokens.shape[0], n), jnp.int32))},
}


def compile_seconds(target: str, rows: int, vocab: int) -> float:
  """CPU seconds (user + sys, every thread) of lowering and compiling `sample` for `target`."""
  st = jax.eval_shape(lambda: SamplingState.create(rows, vocab))
  sds = jax.ShapeDtypeStruct
  args = (sds((rows, vocab), jnp.float32), st, sds((rows,), jnp.int32), sds((1,), jnp.int32),
          sds((rows, -(-vocab // 32)), jnp.int32))
  device = targets.abstract_device(target)
  start = os.times()
  targets.lower(lambda *a: S.sample(*a), args, device)()
  end = os.times()
  return (end.user - start.user) + (end.system - start.system)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="v5e")
  parser.add_argument("--rows", type=int, default=64)
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--variants", default=",".join(VARIANTS))
  a = parser.parse_args()
  jax.config.update("jax_platforms", "cpu")
  original = {name: getattr(S, name) for patch in VARIANTS.values() for name in patch}
  for variant in a.variants.split(","):
    jax.clear_caches()
    for name, fn in {**original, **VARIANTS[variant]}.items():
      setattr(S, name, fn)
    seconds = compile_seconds(a.target, a.rows, a.vocab)
    print(f"{variant:<14} {a.target} {a.rows} x {a.vocab}: {seconds:.1f} s CPU", flush=True)


if __name__ == "__main__":
  main()

"""`python -m scripts.bench moe`: a small mixture of experts' decode step beside a dense model of
the same active size, and `jax.lax.ragged_dot` alone (main_moe's docstring says how)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig, ModelFamily
from jaxserve.model.families import model_class

from . import harness
from .decode import decode_ms

MOE = ModelConfig(vocab_size=4096, dim=512, num_layers=4, num_heads=8, num_kv_heads=2,
                  head_dim=64, hidden_dim=1024, max_seq_len=1024, tie_embeddings=False,
                  name="tiny-moe", family=ModelFamily.QWEN3_MOE, num_experts=8,
                  experts_per_token=2, expert_hidden_dim=512)
DENSE = dataclasses.replace(MOE, name="tiny-dense", family=ModelFamily.QWEN3, num_experts=0,
                            experts_per_token=0, expert_hidden_dim=0,
                            hidden_dim=MOE.experts_per_token * MOE.expert_hidden_dim)


def ragged_vs_dense_ms(rows: int, cfg: ModelConfig, repeats: int = 20) -> tuple[float, float]:
  """(ms of ragged_dot over `rows` rows spread evenly over the experts, ms of one plain matmul
  of the same rows), best of `repeats`."""
  E, D, F = cfg.num_experts, cfg.dim, cfg.expert_hidden_dim
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(rows, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(E, D, F)), jnp.float32)
  sizes = jnp.full((E,), rows // E, jnp.int32).at[0].add(rows % E)
  ragged = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s))
  dense = jax.jit(lambda x, w: x @ w[0])
  best_ms = lambda fn: 1000 * min(harness.timed(lambda: fn().block_until_ready(), repeats))
  return best_ms(lambda: ragged(x, w, sizes)), best_ms(lambda: dense(x, w))


def main_moe(argv=None) -> None:
  """The decode step of a small mixture of experts beside a dense model of the same active size,
  and what XLA does with `jax.lax.ragged_dot` on this backend.

    python -m scripts.bench moe [--batches 1,8,32] [--context 128] [--steps 20]

  Both models are Qwen3 blocks with random weights and the same attention: the MoE has 8 experts
  of hidden dim F, 2 a token; the dense one an MLP of 2F, so a token runs through the same number
  of weights (`num_active_params` equal but for the router's D x 8 a layer). The MoE step also
  routes (a softmax and top-k over the experts), sorts the step's rows by expert and runs three
  ragged matmuls. The ratio MoE / dense is the figure to keep (a loaded machine slows both
  alike).

  `ragged_dot` alone: the grouped matmul of the step's routed rows against every expert's
  weights, timed beside one plain matmul of the same rows against one expert's weights (the
  useful FLOPs). Where XLA has no grouped kernel (CPU) it computes every row against every expert
  and masks, so the ratio approaches the number of experts.
  """
  p = harness.parser("moe", main_moe.__doc__)
  p.add_argument("--batches", default="1,8,32")
  p.add_argument("--context", type=int, default=128)
  p.add_argument("--steps", type=int, default=20)
  args = p.parse_args(argv)
  batches = [int(b) for b in args.batches.split(",")]
  # The same weights a token, but for the router's.
  router = MOE.num_layers * MOE.dim * MOE.num_experts
  assert MOE.num_active_params - DENSE.num_active_params == router
  out = {"backend": jax.default_backend(), "active_params": MOE.num_active_params,
         "moe_params": MOE.num_params, "decode_ms": {}, "ragged_dot_ms": {}}
  for cfg in (DENSE, MOE):
    model = model_class(cfg)(cfg, jnp.float32, rngs=nnx.Rngs(0))
    out["decode_ms"][cfg.name] = {b: decode_ms(model, b, args.context, args.steps)
                                  for b in batches}
  for b in batches:
    rows = b * MOE.experts_per_token
    out["ragged_dot_ms"][b] = dict(zip(("ragged", "one_expert"), ragged_vs_dense_ms(rows, MOE)))
  print(json.dumps(out, indent=1))
  print(f"{'batch':>5} {'dense ms':>9} {'moe ms':>9} {'moe/dense':>9} "
        f"{'ragged_dot/one matmul':>22}")
  for b in batches:
    d, m = out["decode_ms"]["tiny-dense"][b], out["decode_ms"]["tiny-moe"][b]
    r = out["ragged_dot_ms"][b]
    print(f"{b:>5} {d:>9.2f} {m:>9.2f} {m / d:>9.2f} {r['ragged'] / r['one_expert']:>22.1f}")


COMMANDS = {"moe": main_moe}
